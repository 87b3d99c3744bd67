"""The hybrid arc on disk: one JSON event per line, written and flushed as it happens.

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

The engine's `TraceWriter` (hybridlm.engine.trace) writes each line as it happens, so a run
killed at any moment leaves a file whose every line parses; optional tensors (the
final-layer state of each token) go to a safetensors file beside it. This module reads
traces back and prints them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridlm.engine.trace import NullTrace, TraceWriter  # noqa: F401 - the writer is an observer of the engine
from hybridlm.errors import InputError


def read_trace(path: str | os.PathLike) -> list[dict]:
    """All events of a trace file; a malformed line is an error naming its number."""
    return list(iter_trace(path))


def iter_trace(path: str | os.PathLike) -> Iterator[dict]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no trace file at {p}")
    with open(p, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError as exc:
                raise InputError(f"{p}:{number}: not a JSON line ({exc})") from None
            if not isinstance(event, dict) or "event" not in event:
                raise InputError(f"{p}:{number}: not a trace event")
            yield event


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
        stamp = f"t={e.get('t', 0):<4} k={e.get('k', 0):<2} {e.get('wall_s', 0.0):7.2f}s"
        if kind == "token":
            if tokens:
                lines.append(f"{stamp} │   token {e['token']:>6} {e['text']!r}")
            else:
                text.append(e["text"])
        elif kind == "phase":
            flush_text()
            extra = f" ({e['tokens']} tokens)" if "tokens" in e else ""
            lines.append(f"{stamp} │ {e['mode']} {e['phase']}{extra}")
        elif kind == "control" and (tokens or e.get("no_safe_token")):
            flush_text()
            mass = f" removed mass {e['removed_mass']:.3f}" if e.get("removed_mass") is not None else ""
            empty = f"; no safe token → {e.get('action')}" if e.get("no_safe_token") else ""
            lines.append(f"{stamp} │   control {e['controller']}{mass}{empty}")
        elif kind == "jump":
            flush_text()
            status = f"error={e['error']}" if e.get("error") else "ok"
            lines.append(
                f"{stamp} │ JUMP {e['k']}: {e['tool']}({json.dumps(e['arguments'])}) → "
                f"{e['observation'][:80]!r} [{status}, {e['duration_s']:.3f}s]"
            )
        elif kind == "start":
            lines.append(f"{stamp} │ start: {e.get('task')!r} model={e.get('model')} seed={e.get('seed')}")
        elif kind == "end":
            flush_text()
            lines.append(
                f"{stamp} │ end ({e.get('stop_reason')}): {e.get('answer')!r}; "
                f"q_G {e.get('wall_generate_s', 0):.2f}s, q_E {e.get('wall_external_s', 0):.2f}s"
            )
    flush_text()
    return "\n".join(lines)
