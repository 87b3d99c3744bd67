"""The model hub's GPT-2 file layout: `config.json` + `model.safetensors`.

The hub stores GPT-2's projections as Conv1D weights of shape [in, out] (y = x W + b);
hybridlm's linear maps are [out, in] (y = x Wᵀ + b), so those matrices are transposed on
the way in and out. Buffers the hub keeps beside the weights (`attn.bias`, the causal
mask) carry no parameters and are skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridlm.config import HUB_REPOS, ModelConfig
from hybridlm.errors import ConfigError, ModelNotFoundError, WeightsError
from hybridlm.model import DecoderLM

# hub name (after the optional "transformer." prefix) → (our name, transpose)
_GLOBAL = {"wte.weight": ("W_e", False), "wpe.weight": ("pos_embed.W_p", False),
           "ln_f.weight": ("ln_final.weight", False), "ln_f.bias": ("ln_final.bias", False)}
_BLOCK = {
    "ln_1.weight": ("ln1.weight", False), "ln_1.bias": ("ln1.bias", False),
    "attn.c_attn.weight": ("attn.W_qkv.weight", True), "attn.c_attn.bias": ("attn.W_qkv.bias", False),
    "attn.c_proj.weight": ("attn.W_O.weight", True), "attn.c_proj.bias": ("attn.W_O.bias", False),
    "ln_2.weight": ("ln2.weight", False), "ln_2.bias": ("ln2.bias", False),
    "mlp.c_fc.weight": ("mlp.W_fc.weight", True), "mlp.c_fc.bias": ("mlp.W_fc.bias", False),
    "mlp.c_proj.weight": ("mlp.W_proj.weight", True), "mlp.c_proj.bias": ("mlp.W_proj.bias", False),
}
_SKIP_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


def hub_to_ours(name: str) -> tuple[str, bool] | None:
    """Map a hub tensor name to (our parameter name, transpose?), or None for skipped buffers."""
    name = name.removeprefix("transformer.")
    if name in _GLOBAL:
        return _GLOBAL[name]
    if name.endswith(_SKIP_SUFFIXES):
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "h" and parts[1].isdigit() and parts[2] in _BLOCK:
        ours, transpose = _BLOCK[parts[2]]
        return f"blocks.{parts[1]}.{ours}", transpose
    raise WeightsError(f"unexpected tensor {name!r} in a GPT-2 checkpoint")


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except Exception as exc:  # safetensors raises its own error type for every defect
            raise WeightsError(f"{f}: not a readable safetensors file ({exc}); is it truncated or corrupt?") from None
    return tensors


def weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise WeightsError(f"{index}: not a valid safetensors index ({exc})") from None
        return [folder / s for s in shards]
    present = sorted(p.name for p in folder.iterdir())[:10]
    raise WeightsError(
        f"{folder} holds no weights: expected model.safetensors (or a sharded "
        f"model.safetensors.index.json) beside config.json; found {present}"
    )


def load_gpt2_folder(folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> DecoderLM:
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise WeightsError(f"{folder} has no config.json: expected the hub layout (config.json + model.safetensors)")
    try:
        hf = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise WeightsError(f"{cfg_file}: not valid JSON ({exc})") from None
    model_type = hf.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ConfigError(f"{cfg_file}: model_type {model_type!r} is not supported here (expected 'gpt2')")
    cfg = ModelConfig.from_hf_gpt2(hf)
    tensors = read_safetensors(weight_files(folder))
    model = DecoderLM(cfg)
    ours = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for name, t in tensors.items():
            target = hub_to_ours(name)
            if target is None:
                continue
            key, transpose = target
            if key not in ours:
                raise WeightsError(f"tensor {name!r} has no place in a {cfg.n_layer}-layer model")
            t = t.T if transpose else t
            if tuple(t.shape) != tuple(ours[key].shape):
                raise WeightsError(
                    f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(ours[key].shape)} from config.json"
                )
            ours[key].copy_(t)
            seen.add(key)
    missing = sorted(set(ours) - seen)
    if missing:
        raise WeightsError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    model.source = str(folder)
    return model.to(dtype)


def save_gpt2_folder(model: DecoderLM, folder: str | os.PathLike) -> Path:
    """Write a GPT-2-family model in the hub layout (readable by transformers)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    inverse = {**{v[0]: (k, v[1]) for k, v in _GLOBAL.items()}}
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            _, layer, rest = name.split(".", 2)
            hub, transpose = next((k, tr) for k, (o, tr) in _BLOCK.items() if o == rest)
            hub = f"h.{layer}.{hub}"
        else:
            hub, transpose = inverse[name]
        t = p.detach().float().cpu()
        tensors[f"transformer.{hub}"] = (t.T if transpose else t).contiguous()
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_gpt2(), indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def fetch_from_hub(name: str) -> Path:
    """Find a preset's files in the local hub cache, or download them when a network exists."""
    repo = HUB_REPOS[name]
    patterns = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        snapshot_download = None
    if snapshot_download is not None:
        for local_only in (True, False):
            if not local_only and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
                break
            try:
                return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=local_only))
            except Exception:  # noqa: BLE001 - every failure ends in the same advice below
                continue
    raise ModelNotFoundError(
        f"could not get the weights of {name!r} ({repo}): not in the local hub cache and the hub is "
        f"unreachable. Download config.json and model.safetensors of {repo} on a machine with a network "
        f"and pass the folder: --model /path/to/{name} (or load_model('/path/to/{name}')). "
        f"For random weights of the same shape use --model random:{name}."
    )
