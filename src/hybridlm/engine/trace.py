"""Observers of the engine that keep a sequence's arc outside the process.

`TraceWriter` writes each event as one JSON line the moment it happens, flushed (and
fsynced at the start, at phase changes, jumps and the end), so a run killed at any moment
leaves a file whose every line parses. `StateRecorder` is the recorder (hybridlm.lm.capture)
set to keep the final-layer residual state h⁽ᴸ⁾ of each decode step of its sequence (a hook
point read on that sequence's rows only) and to write them when the arc ends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridlm.lm.capture import Recorder

_SYNCED = ("start", "phase", "jump", "end")


class TraceWriter:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "w", encoding="utf-8")

    def on_event(self, s, event) -> None:
        self.write(event.to_dict())

    def write(self, record: dict | str, **fields) -> None:
        """One event: a whole record, or its kind and fields (`write("plant", t=…, k=…, wall_s=…, …)`)."""
        if isinstance(record, str):
            record = {"event": record, **fields}
        self._fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._fh.flush()
        if record.get("event") in _SYNCED:
            os.fsync(self._fh.fileno())

    def on_end(self, s) -> None:
        self.close()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullTrace:
    """Stands in for a TraceWriter when no trace is asked for."""

    path = None

    def write(self, record, **fields) -> None:
        pass

    def close(self) -> None:
        pass


def StateRecorder(model, path: str | os.PathLike) -> Recorder:
    """h⁽ᴸ⁾ of the new token at every decode step of one sequence, written to `path` when its arc
    ends as `resid_final` [steps, d] beside `t`, the token step of each row."""
    point = f"blocks.{model.config.n_layer - 1}.hook_resid_post"
    return Recorder(model, [point], last=True, decode_only=True, save=path, save_as="resid_final")
