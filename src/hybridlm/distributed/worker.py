"""What a worker process keeps between the shards it runs: the last model it loaded."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

_kept: dict[Hashable, Any] = {}


def cached(key: Hashable, build: Callable[[], Any]) -> Any:
    """`build()` once per process for `key`; a new key frees the object kept before (a model
    of the survey's size is GBs: a worker keeps one)."""
    if key not in _kept:
        _kept.clear()
        _kept[key] = build()
    return _kept[key]


def worker_model(spec: str | None, *, device: str = "cpu", precision: str = "float32"):
    """`load_model(spec)` once per worker process (the shard functions of evaluations call this)."""
    from hybridlm.weights.loading import load_model

    return cached(("model", spec, device, precision), lambda: load_model(spec, device=device, precision=precision))
