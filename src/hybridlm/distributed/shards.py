"""Shards: contiguous stretches of a run's prompts or tasks, and the folder that keeps the
finished ones so that a restarted run does only the rest."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridlm.distributed.pool import Job
from hybridlm.errors import InputError


def split(n: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of shards of `size` items covering 0..n-1 in order (the last may be shorter)."""
    if size < 1:
        raise InputError(f"shard size {size}: expected ≥ 1")
    return [(start, min(start + size, n)) for start in range(0, n, size)]


class ShardStore:
    """A folder of finished shards, one file per shard, named by its span; each file is
    written whole (to a temporary name, then renamed), so a killed run leaves only complete
    shards behind."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def path(self, start: int, stop: int, suffix: str) -> Path:
        return self.folder / f"{start:06d}-{stop:06d}{suffix}"

    def write(self, start: int, stop: int, suffix: str, save: Callable[[Path], object]) -> Path:
        """Run save(temporary path), then move the file into place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(start, stop, suffix)
        tmp = final.with_name(final.name + f".{os.getpid()}.tmp")
        save(tmp)
        tmp.replace(final)
        return final

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def map_shards(task: Callable, items: Sequence, *, pool, shard_size: int, args: tuple = (),
               store: str | Path | None = None, key: dict | None = None,
               on_shard: Callable[[list, list], None] | None = None) -> list:
    """Outputs of `task(*args, shard)` over shards of `items`, in the items' order.

    `shard` is a list of (index, item); the task returns one output per item, in order. It
    runs on `pool` (this process or Ray tasks); `task` must be a module-level function and
    should load its model with `worker.worker_model` (once per worker). With `store` (a
    folder), each finished shard is saved there as JSON (so outputs must be JSON values)
    together with `key`, the identity of the job; a rerun with the same key skips the saved
    shards, and the folder is removed once all are done. `on_shard(shard, outputs)` is called on
    this process as each shard arrives (for progress), with its (index, item) list.
    """
    spans = split(len(items), shard_size)
    key = json.loads(json.dumps(key))  # as it reads back from the file
    shelf = ShardStore(store) if store is not None else None
    outputs: dict[tuple[int, int], list] = {}
    if shelf is not None:
        for span in spans:
            saved = _load_json(shelf.path(*span, ".json"), key)
            if saved is not None:
                outputs[span] = saved
    todo = [span for span in spans if span not in outputs]
    shards = [[(i, items[i]) for i in range(*span)] for span in todo]
    jobs = [Job(task, (*args, shard)) for shard in shards]

    def arrived(i: int, out: list) -> None:
        span = todo[i]
        if len(out) != span[1] - span[0]:
            raise RuntimeError(f"{task.__name__} returned {len(out)} outputs for a shard of {span[1] - span[0]}")
        if shelf is not None:
            shelf.write(*span, ".json", lambda p: p.write_text(json.dumps({"key": key, "outputs": out})))
        outputs[span] = out
        if on_shard is not None:
            on_shard(shards[i], out)

    pool.run(jobs, arrived)
    if shelf is not None:
        shelf.clear()
    return [o for span in spans for o in outputs[span]]


def _load_json(path: Path, key: dict | None) -> Any:
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable: the shard is done again
    return saved["outputs"] if saved.get("key") == key else None
