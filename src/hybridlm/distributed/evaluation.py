"""`hybridlm eval agent` over shards of problems: the same report as one process makes."""

from __future__ import annotations

from pathlib import Path

from hybridlm.agent.evaluation import MODES, problems, solve, summarize
from hybridlm.distributed.shards import map_shards
from hybridlm.distributed.worker import worker_model


def agent_shard(model_spec: str | None, seed: int, device: str, precision: str, shard: list) -> list[dict]:
    """The rows of a shard of (index, (mode, problem index, problem)) items, on a worker."""
    model = worker_model(model_spec, device=device, precision=precision)
    rows = []
    for mode in dict.fromkeys(item[0] for _, item in shard):  # the modes in the shard, in order
        tasks = [(i, problem) for _, (m, i, problem) in shard if m == mode]
        rows += solve(model, mode, tasks, seed=seed)
    return rows


def evaluate_sharded(model_spec: str | None, *, pool, n: int = 50, modes=MODES, seed: int = 0,
                     shard_size: int = 5, store: str | Path | None = None, progress=None,
                     precision: str = "float32") -> dict:
    """`evaluate` with the problems of every mode in shards of `shard_size` run on `pool`.
    With `store`, finished shards are kept there and a rerun skips them."""
    items = [(mode, i, problem) for mode in modes for i, problem in enumerate(problems(n))]
    key = {"eval": "agent", "model": model_spec, "n": n, "modes": list(modes), "seed": seed, "device": pool.device,
           **({"precision": precision} if precision != "float32" else {})}

    def arrived(shard: list, rows: list[dict]) -> None:
        if progress:
            for (_, (mode, _, _)), row in zip(shard, rows):
                progress(mode, row)

    rows = map_shards(agent_shard, items, pool=pool, shard_size=shard_size,
                      args=(model_spec, seed, pool.device, precision), store=store, key=key, on_shard=arrived)
    by_mode = {mode: [r for r, (m, *_) in zip(rows, items) if m == mode] for mode in modes}
    return summarize(n, by_mode)
