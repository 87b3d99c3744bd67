"""Sampled continuations under the controlled recursion, as a client of the engine.

`rollout` runs `batch` continuations of one prompt, row b as the sequence with seed
`seed + b` (the meaning of a seed everywhere: row b makes the tokens `generate(...,
seed=seed + b)` makes alone), each with its own copy of the controllers' loop, for exactly
`max_new_tokens` steps (a stop token does not end a row; `Rollout.continuations` cuts there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridlm.engine.clock import default_stops, sequence
from hybridlm.engine.engine import Engine
from hybridlm.engine.inputs import ControlLoop, ControlRecord
from hybridlm.errors import InputError


@dataclass
class Rollout:
    """B sampled continuations of one prompt under the controlled recursion."""

    prompt_ids: list[int]
    tokens: torch.Tensor  # [B, steps]
    records: list[list[ControlRecord]] = field(default_factory=list)  # per token step, each over the B rows

    def continuations(self, stop_ids=()) -> list[list[int]]:
        """Each row's generated ids, cut before its first stop token."""
        out = []
        for row in self.tokens.tolist():
            cut = next((i for i, w in enumerate(row) if w in stop_ids), len(row))
            out.append(row[:cut])
        return out


@torch.no_grad()
def rollout(model, prompt_ids, *, batch: int, kernel, controllers=(), max_new_tokens: int = 40, seed: int = 0,
            stop_ids=None) -> Rollout:
    """Sample `batch` continuations at once (row b: seed + b)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch={batch!r}: expected an integer ≥ 1")
    ids = [int(i) for i in prompt_ids]
    stops = set(default_stops(model) if stop_ids is None else stop_ids)
    rows = []
    for b in range(batch):
        s = sequence(model, ids, kernel=kernel, max_new_tokens=max_new_tokens, seed=seed + b, stop_ids=())
        if controllers:
            s.controls = ControlLoop(model, controllers, kernel=kernel, stop_ids=stops)
        rows.append(s)
    Engine(model, max_batch=batch).solve(rows)
    tokens = torch.tensor([s.arc.tokens for s in rows], dtype=torch.long).reshape(batch, -1)
    return Rollout(ids, tokens, [_merged(rows, t) for t in range(1, tokens.shape[1] + 1)])


def _merged(rows, t: int) -> list[ControlRecord]:
    """The controllers' records of token step t, one ControlRecord per controller over the rows
    (a row where that controller did not act counts as a zero input)."""
    acted: dict[str, list[dict | None]] = {}
    for b, s in enumerate(rows):
        for e in s.arc.events:
            if e.kind == "control" and e.t == t:
                acted.setdefault(e["controller"], [None] * len(rows))[b] = e.data
    out = []
    for name, per_row in acted.items():
        rec = ControlRecord(controller=name)
        for key, zero in (("removed_mass", 0.0), ("removed_tokens", 0), ("shift", 0.0)):
            if any(r is not None and key in r for r in per_row):
                setattr(rec, key, [zero if r is None else r.get(key, zero) for r in per_row])
        empty = [b for b, r in enumerate(per_row) if r is not None and r.get("no_safe_token")]
        if empty:
            rec.note = {"no_safe_token": empty, "action": next(r["action"] for r in per_row if r and "action" in r)}
        out.append(rec)
    return out
