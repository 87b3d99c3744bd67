"""What a consensus run's folder holds (written by `analysis.runner`, read by the report), with no
PyTorch to import: the CSV's columns, the checkpoint's name and the threshold "E < 0.05" that the
summaries and figures mark."""

THRESHOLD = 0.05
COLUMNS = ["layer_step", "pass", "layer", "E_mean", "E_std", "E_min", "E_max"]
CHECKPOINT = "checkpoint.safetensors"
