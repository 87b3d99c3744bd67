"""Observers of the engine that keep a sequence's arc outside the process.

`TraceWriter` writes each event as one JSON line the moment it happens, in one write(2)
(fsynced at the start, at phase changes, jumps and the end when the trace is a regular
file), so a run killed at any moment leaves whole lines that parse; a last line cut even so
(a kill inside a long write, a full disk) is skipped by the reader with a warning. A FIFO
that no process reads is refused at once, not waited on; a pipe with a reader, a terminal or
/dev/null is written without fsync. `StateRecorder` is the recorder (hybridlm.lm.capture)
set to keep the final-layer residual state h⁽ᴸ⁾ of each decode step of its sequence (a hook
point read on that sequence's rows only) and to write them when the arc ends.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from hybridlm.errors import InputError
from hybridlm.lm.capture import Recorder

_SYNCED = ("start", "phase", "jump", "end")


class TraceWriter:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: a FIFO no process reads would block open(2) until one comes; this way it fails at once
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise InputError(f"{self.path}: a FIFO or socket that no process reads; a trace is written to a "
                                 "regular file (or a pipe with a reader)") from None
            raise InputError(f"{self.path}: the trace cannot be written ({exc.strerror or exc})") from None
        os.set_blocking(fd, True)  # a slow reader of a pipe makes writes wait, not fail with EAGAIN
        self._fd: int | None = fd
        # fsync is for files on disk; a pipe, a terminal or /dev/null refuses it (EINVAL)
        self._sync = stat.S_ISREG(os.fstat(fd).st_mode)

    def on_event(self, s, event) -> None:
        self.write(event.to_dict())

    def write(self, record: dict | str, **fields) -> None:
        """One event: a whole record, or its kind and fields (`write("plant", t=…, k=…, wall_s=…, …)`)."""
        if isinstance(record, str):
            record = {"event": record, **fields}
        if self._fd is None:
            raise ValueError(f"trace {self.path} is closed")
        line = memoryview((json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8"))
        while line:  # one write(2) for a file: a kill lands between lines; a pipe may take it in parts
            line = line[os.write(self._fd, line):]
        if self._sync and record.get("event") in _SYNCED:
            os.fsync(self._fd)

    def on_end(self, s) -> None:
        self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

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
