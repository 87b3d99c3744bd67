"""`hybridlm bench` and its speed references."""

from hybridlm.bench.run import BenchConfig, run_bench, write_report

__all__ = ["BenchConfig", "run_bench", "write_report"]
