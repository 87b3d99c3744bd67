"""The controlled recursion (SPEC.md §2 with inputs; survey, "Safety and Alignment"):

    y_t = (z_t, x_t, text_t, h_t⁽ᴸ⁾),   (v_t, M_t) = κ(y_t),
    w_{t+1} ~ p_θ,u(· | s_t) ∝ M_t · exp((z_t + v_t)/τ),   x_{t+1} = F_u(x_t, w_{t+1})

where F_u is F with the residual inputs u(ℓ, t) attached and x_0 holds the soft prefix.
`ControlLoop` is the closed loop's bookkeeping, shared by `token_clock`, the agent's
flow map and the batched `rollout`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from hybridlm.control.controllers import (
    ControlRecord, Observation, all_hooks, control_step, ordered, the_prefix,
)
from hybridlm.control.inputs import prefill, residual_point
from hybridlm.errors import InputError

TEXT_TAIL = 256  # characters of the prompt kept as the text a barrier sees


class ControlLoop:
    def __init__(self, model, controllers, *, kernel, stop_ids=()):
        self.model, self.kernel = model, kernel
        self.controllers = ordered(controllers)
        self.stop_ids = set(stop_ids)
        self.prefix = the_prefix(self.controllers)
        self.table = None if model.tokenizer is None else model.tokenizer.table
        self.hidden: torch.Tensor | None = None
        self.texts: list[str] = []

    # ------------------------------------------------------------------ setup
    def attached(self):
        """Attach the residual inputs (and the h⁽ᴸ⁾ probe when a controller reads it) for a run."""
        pairs = all_hooks(self.controllers, self.model)
        if any(c.needs_hidden for c in self.controllers):
            pairs.append((residual_point(self.model, self.model.config.n_layer), self._keep_hidden))
        return self.model.hooks(pairs) if pairs else contextlib.nullcontext()

    def _keep_hidden(self, h, hook):
        self.hidden = h[:, -1].detach()

    def start(self, prompt_rows: list[list[int]]) -> None:
        """The text each barrier starts from: the tail of the decoded prompt."""
        tok = self.model.tokenizer
        self.texts = [tok.decode(r)[-TEXT_TAIL:] if tok is not None else "" for r in prompt_rows]

    def prefill(self, ids, *, batch: int | None = None):
        return prefill(self.model, ids, self.prefix, batch=batch)

    def check_horizon(self, n0: int, steps: int) -> None:
        """With a soft prefix, Π_T must not drop tokens (the prefix rows have no token to re-prefill)."""
        T = self.model.config.n_ctx
        if self.prefix is not None and n0 + steps > T:
            raise InputError(f"soft prefix with {n0} positions and {steps} new tokens exceeds T={T}; "
                             "shorten the prompt or the budget")

    # ------------------------------------------------------------------ one step
    def step(self, t: int, z: torch.Tensor, x) -> tuple[torch.Tensor, list[ControlRecord]]:
        """(v_t, M_t) from the observation y_t, applied to z."""
        obs = Observation(t=t, z=z, state=x, texts=self.texts, stop_ids=self.stop_ids, kernel=self.kernel,
                          hidden=self.hidden)
        return control_step(self.controllers, obs)

    def advance(self, w: torch.Tensor) -> None:
        """Append the text of each row's new token w_{t+1}."""
        if self.table is None:
            return
        texts = self.table.texts
        for b, token in enumerate(w.tolist()):
            piece = texts[token] if token < len(texts) else ""
            self.texts[b] = (self.texts[b] + piece)[-TEXT_TAIL:]


@dataclass
class Rollout:
    """B sampled continuations of one prompt under the controlled recursion."""

    prompt_ids: list[int]
    tokens: torch.Tensor  # [B, steps]
    records: list[list[ControlRecord]] = field(default_factory=list)  # per token step

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
    """Sample `batch` continuations at once: the state carries B copies of s_0, F takes [B] tokens."""
    ids = [int(i) for i in prompt_ids]
    stops = set(model.tokenizer.stop_ids() if stop_ids is None and model.tokenizer is not None else (stop_ids or ()))
    loop = ControlLoop(model, controllers, kernel=kernel, stop_ids=stops)
    generator = torch.Generator(device=model.W_e.device).manual_seed(seed)
    out, records = [], []
    with loop.attached():
        x = loop.prefill(torch.tensor([ids]), batch=batch)
        loop.check_horizon(x.n, max_new_tokens)
        loop.start([ids] * batch)
        for t in range(1, max_new_tokens + 1):
            z, recs = loop.step(t, model.G(x), x)
            w = kernel.sample(z, generator)
            model.F(x, w)
            loop.advance(w)
            out.append(w)
            records.append(recs)
    tokens = torch.stack(out, dim=1) if out else torch.zeros(batch, 0, dtype=torch.long)
    return Rollout(ids, tokens, records)
