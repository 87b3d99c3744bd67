"""The hybrid arc on disk: one JSON event per line, written and flushed as it happens, and read back.

Events (every one carries the hybrid time (t, k) and the wall time `wall_s`):
- `start`: the run's configuration (task, model, kernel, limits, tools, seed);
- `phase`: a phase change (prefill, decode, constrained, external) and the mode q_G / q_E;
- `token`: one token step of the flow, with the token and its text;
- `control`: what a controller did before a token step (e.g. the probability mass a
  safety filter removed, or that no safe token remained and what was done then);
- `jump`: one jump, with the tool, arguments, observation, error and duration;
- `batch`: the sequence left or joined the engine's batch (it leaves for q_E);
- `context`: a jump of the context horizon (the block policy cut the string);
- `end`: the answer, the stop reason and totals.

`TraceWriter`, an observer of the engine, writes each event as one JSON line the moment it
happens, in one write(2) (fsynced at the start, at phase changes, jumps and the end when the
trace is a regular file), so a run killed at any moment leaves whole lines that parse. A FIFO
that no process reads is refused at once, not waited on; a pipe with a reader, a terminal or
/dev/null is written without fsync. `StateRecorder` is the recorder (hybridlm.lm.capture) set
to keep the final-layer residual state h⁽ᴸ⁾ of each decode step of its sequence (a hook point
read on that sequence's rows only) and to write them, beside the trace, when the arc ends.

The format is published as a JSON Schema, `trace.schema.json` beside this module; the reader
(`read_trace`, `iter_trace`) checks every event against it (unknown fields and event kinds are
allowed; t, k and wall_s never are missing). A last line cut off (no newline, no JSON: the run
was killed while writing it) is skipped with a `CutTraceWarning`; a file without events is an
error. `format_timeline` prints an arc.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema

from hybridlm.engine.arc import HybridArc, format_rates
from hybridlm.errors import InputError
from hybridlm.files import output_flags, refusal

if TYPE_CHECKING:
    from hybridlm.lm.capture import Recorder

_SYNCED = ("start", "phase", "jump", "end")


class TraceWriter:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: a FIFO no process reads would block open(2) until one comes; this way it fails at once
        flags = output_flags(self.path) | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise InputError(f"{self.path}: a FIFO or socket that no process reads; a trace is written to a "
                                 "regular file (or a pipe with a reader)") from None
            raise refusal(self.path, "trace", exc) from None
        os.set_blocking(fd, True)  # a slow reader of a pipe makes writes wait, not fail with EAGAIN
        self._fd: int | None = fd
        self.failed: str | None = None  # why the trace ended early (a write error), else None
        # fsync is for files on disk; a pipe, a terminal or /dev/null refuses it (EINVAL)
        self._sync = stat.S_ISREG(os.fstat(fd).st_mode)

    def on_event(self, s, event) -> None:
        self.write(event.to_dict())

    def write(self, record: dict | str, **fields) -> None:
        """One event: a whole record, or its kind and fields (`write("plant", t=…, k=…, wall_s=…, …)`)."""
        if isinstance(record, str):
            record = {"event": record, **fields}
        if self._fd is None:
            if self.failed is not None:  # the trace ended at a write error; the run goes on
                return
            raise ValueError(f"trace {self.path} is closed")
        line = memoryview((json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8"))
        try:
            while line:  # one write(2) for a file: a kill lands between lines; a pipe may take it in parts
                line = line[os.write(self._fd, line):]
            if self._sync and record.get("event") in _SYNCED:
                os.fsync(self._fd)
        except OSError as exc:  # a full disk, /dev/full, a reader gone: the trace ends, the run does not
            self.failed = f"{self.path}: the trace could not be written ({exc.strerror or exc}); it ends here"
            self.close()
            warnings.warn(self.failed, TraceWriteWarning, stacklevel=2)

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
    from hybridlm.lm.capture import Recorder  # (here: reading a trace needs no PyTorch)

    point = f"blocks.{model.config.n_layer - 1}.hook_resid_post"
    return Recorder(model, [point], last=True, decode_only=True, save=Path(path), save_as="resid_final")


# ---------------------------------------------------------------------- reading
SCHEMA_PATH = Path(__file__).with_name("trace.schema.json")
MAX_LINE_BYTES = 16 << 20  # one event; a jump's observation is capped far below this


class TraceWriteWarning(UserWarning):
    """A trace could not be written on (a full disk): it ends there, the run goes on."""


class CutTraceWarning(UserWarning):
    """The trace's last line is cut off (a run killed while writing it); the events before it were read."""


@functools.cache
def schema() -> dict:
    """The trace format as a JSON Schema (draft 2020-12), published beside this module."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


@functools.cache
def _validator(definition: str | None = None) -> jsonschema.protocols.Validator:
    """A validator for a whole event (None) or for one of the schema's $defs, refs resolved in the schema."""
    root = schema()
    cls = jsonschema.validators.validator_for(root)
    target = root if definition is None else {"$ref": f"#/$defs/{definition}", "$defs": root["$defs"]}
    return cls(target)


def check_event(event: Any, where: str, definition: str | None = None) -> dict:
    """`event` against the schema (or one of its $defs); an InputError naming `where` and the field."""
    if not isinstance(event, dict):
        raise InputError(f"{where}: a trace event is a JSON object, got a JSON {type(event).__name__}")
    error = jsonschema.exceptions.best_match(_validator(definition).iter_errors(event))
    if error is not None:
        field = "/".join(str(p) for p in error.absolute_path)
        at = f"field '{field}'" if field else f"event {event.get('event')!r}"
        raise InputError(f"{where}: {at}: {_short(error.message)}")
    return event


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " …"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_trace(path: str | os.PathLike) -> list[dict]:
    """All events of a trace file, each checked against the schema; the error names line and field."""
    return list(iter_trace(path))


def iter_trace(path: str | os.PathLike) -> Iterator[dict]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no trace file at {p}")
    with open(p, "rb") as fh:
        number = read = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            number += 1
            where = f"{p}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{where}: a line longer than {MAX_LINE_BYTES:,} bytes is not a trace event")
            if not raw.strip():
                continue
            try:
                event = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
            except UnicodeDecodeError as exc:
                if _cut(raw, exc):
                    break
                raise InputError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}): not a trace") from None
            except RecursionError:
                raise InputError(f"{where}: JSON nested too deep to be a trace event") from None
            except ValueError as exc:
                if _cut(raw, exc):
                    break
                raise InputError(f"{where}: not a JSON line ({_short(str(exc))})") from None
            read += 1
            yield check_event(event, where)
    if read == 0:
        why = ("its one event line is cut off: a run killed while writing it" if raw
               else "the file is empty" if number == 0 else "only blank lines")
        raise InputError(f"{p}: holds no trace events ({why}); expected JSON lines, one event each")
    if raw:
        events = f"{read} event{'' if read == 1 else 's'}"
        warnings.warn(f"{p}: the last line is cut (a run killed while writing it); {events} read", CutTraceWarning,
                      stacklevel=2)


def _cut(raw: bytes, exc: Exception) -> bool:
    """Whether a line that does not parse is what a kill mid-write leaves: the file's last line (no
    newline), begun as an event object, no bad byte inside and nothing after a closed object.
    Anything else stays an error."""
    if raw.endswith(b"\n") or not raw.lstrip().startswith(b"{"):
        return False
    if isinstance(exc, UnicodeDecodeError):
        return exc.reason == "unexpected end of data"  # a character cut in two, not a bad byte
    return not str(exc).startswith("Extra data")  # a whole object with more after it was not cut


@contextlib.contextmanager
def cut_warnings_to(echo: Callable[[str], None]) -> Iterator[None]:
    """Hands each CutTraceWarning raised inside to `echo` once (a command may read a trace several
    times), when the block ends; an error ending it goes alone (bad input is one line). Other
    warnings are shown as usual."""
    said: list[str] = []
    failed = False
    with warnings.catch_warnings():
        warnings.simplefilter("always", CutTraceWarning)  # repeats are dropped here; a registry would hide them
        show = warnings.showwarning

        def shown(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, CutTraceWarning):
                show(message, category, filename, lineno, file, line)
            elif str(message) not in said:
                said.append(str(message))

        warnings.showwarning = shown
        try:
            yield
        except Exception:
            failed = True
            raise
        finally:
            if not failed:  # (a SystemExit, e.g. "differs", still says what it read)
                for message in said:
                    echo(message)


def cut_short(events: list[dict]) -> bool:
    """Whether the recording stops before its arc ended: no end event (the run was killed, or still runs)."""
    return not any(e["event"] == "end" for e in events)


def format_timeline(events: list[dict], *, tokens: bool = False) -> str:
    """A readable timeline of the arc: phases and jumps, with the text of each decode run."""
    lines: list[str] = []
    text: list[str] = []

    def flush_text() -> None:
        if text:
            lines.append(f"{'':>24}│ {''.join(text)!r}")
            text.clear()

    for e in events:
        kind = e["event"]
        stamp = f"t={e.get('t', 0):<4} k={e.get('k', 0):<2} {_seconds(e.get('wall_s'), 7, 2)}s"
        if kind == "token":
            if tokens:
                lines.append(f"{stamp} │   token {e['token']:>6} {e.get('text')!r}")
            else:
                text.append(e.get("text") or "")  # (the schema lets a token event carry no text)
        elif kind == "phase":
            flush_text()
            extra = f" ({e['tokens']} tokens)" if "tokens" in e else ""
            lines.append(f"{stamp} │ {e['mode']} {e['phase']}{extra}")
        elif kind == "control" and (tokens or e.get("no_safe_token")):
            flush_text()
            mass = f" removed mass {_seconds(e['removed_mass'], 0, 3)}" if e.get("removed_mass") is not None else ""
            empty = f"; no safe token → {e.get('action')}" if e.get("no_safe_token") else ""
            lines.append(f"{stamp} │   control {e['controller']}{mass}{empty}")
        elif kind == "jump":
            flush_text()
            status = f"error={e['error']}" if e.get("error") else "ok"
            lines.append(
                f"{stamp} │ JUMP {e['k']}: {e['tool']}({json.dumps(e['arguments'])[:200]}) → "
                f"{e['observation'][:80]!r} [{status}, {_seconds(e['duration_s'], 0, 3)}s]"
            )
        elif kind == "start":
            lines.append(f"{stamp} │ start: {e.get('task')!r} model={e.get('model')} seed={e.get('seed')}")
        elif kind == "end":
            flush_text()
            lines.append(
                f"{stamp} │ end ({e.get('stop_reason')}): {e.get('answer')!r}; "
                f"q_G {_seconds(e.get('wall_generate_s'), 0, 2)}s, q_E {_seconds(e.get('wall_external_s'), 0, 2)}s"
            )
    flush_text()
    if any(e.get("event") == "token" for e in events):
        lines.append("rates: " + format_rates(HybridArc.from_events(events).rates()))
    return "\n".join(lines)


def _seconds(value: Any, width: int, places: int) -> str:
    """A number as fixed-point text; one too large for a float (the schema allows any integer) as text."""
    try:
        return f"{float(value or 0):{width}.{places}f}"
    except (OverflowError, TypeError, ValueError):
        return str(value)
