"""Watching an agent's arc as it happens: observers of its events (hybridlm.engine.sequence).

- `Stream`: the text of every turn as its tokens are drawn, and each jump (tool, arguments,
  observation) as it lands, written to a text stream (`hybridlm agent --stream`, to stderr).
- `Progress`: one line kept up to date in place (token step t, jump k, the phase, tokens per
  second), cleared when the arc ends; for a terminal only (`hybridlm agent` on a TTY).
"""

from __future__ import annotations

import json
import time
from typing import TextIO


class Stream:
    """Writes each turn's text as it grows (decoded whole, so a character split across tokens is
    written once complete) and a line per jump."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.turn: list[int] = []
        self.sent = 0

    def on_event(self, s, event) -> None:
        if event.kind == "token" and not event.get("stop"):
            self.turn.append(event["token"])
            text = self.tokenizer.decode(self.turn).rstrip("\ufffd")
            if len(text) > self.sent:
                self._write(text[self.sent:])
                self.sent = len(text)
        elif event.kind == "jump":
            error = f" [{event['error']}]" if event.get("error") else ""
            self._write(f"\n[jump {event.k}: {event['tool']}({json.dumps(event['arguments'], ensure_ascii=False)}) → "
                        f"{event['observation'][:200]}{error}]\n")
            self.turn, self.sent = [], 0

    def on_end(self, s) -> None:
        self._write("\n")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


class Progress:
    """One status line, rewritten in place at most every `every_s` seconds."""

    def __init__(self, out: TextIO, *, every_s: float = 0.1) -> None:
        self.out, self.every_s = out, every_s
        self.start = self.last = None  # type: float | None
        self.phase, self.width = "prefill", 0

    def on_event(self, s, event) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        if event.kind == "phase":
            self.phase = event.get("phase", self.phase)
        elif event.kind == "jump":
            self.phase = f"jump {event['tool']}"
        if self.last is not None and now - self.last < self.every_s and event.kind == "token":
            return
        self.last = now
        elapsed = now - self.start
        rate = s.t / elapsed if elapsed > 0 else 0.0
        self._show(f"t={s.t} k={s.k} {self.phase} {elapsed:.1f} s {rate:.1f} tok/s")

    def on_end(self, s) -> None:
        self._show("")

    def _show(self, line: str) -> None:
        self.out.write("\r" + line.ljust(self.width) + ("\r" if not line else ""))
        self.out.flush()
        self.width = len(line)
