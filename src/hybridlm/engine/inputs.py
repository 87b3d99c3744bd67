"""The inputs of the token-clock recursion and how they compose (docs/theory.md §2 made controlled;
survey, "Safety and Alignment"):

    y_t = (z_t, x_t, text_t, h_t⁽ᴸ⁾),   (v_t, M_t) = κ(y_t),
    w_{t+1} ~ p_θ,u(· | s_t) ∝ M_t · exp((z_t + v_t)/τ),   x_{t+1} = F_u(x_t, w_{t+1})

where F_u is F with the residual inputs u(ℓ, t) attached and x_0 holds the soft prefix. A
`Controller` is a feedback law κ (the concrete ones live in `hybridlm.control`); the
`ControlLoop` of a sequence composes its controllers in order of `order` (steering <
objectives < safety, so a safety filter acts last), keeps the text each barrier reads, and is
what the engine calls at every token step of that sequence.

Every input defaults to zero / absent; then nothing is attached and the system is the
uncontrolled one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridlm.engine.sampling import Kernel
from hybridlm.errors import InputError
from hybridlm.lm.capture import Recorder

if TYPE_CHECKING:
    from hybridlm.lm.state import KVState
    from hybridlm.ssm.state import SSMState

NEG_INF = float("-inf")
TEXT_TAIL = 256  # characters of the prompt kept as the text a barrier sees


@dataclass
class KernelInput:
    """(v_t, M_t) for one token step: additive logits v [B, V] and allowed set M [B, V] (bool)."""

    v: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    note: dict | None = None  # what the controller wants recorded (e.g. rows with nothing safe left)
    override: list[int] | None = None  # rows the input takes over: uniform on M there, whatever z was

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """z ↦ z + v, then −∞ outside M (rows in `override`: 0 on M, −∞ outside)."""
        if self.v is not None:
            z = z + self.v.to(z.dtype)
        if self.override:
            z = z.clone()
            z[self.override] = 0.0
        if self.mask is not None:
            z = z.masked_fill(~self.mask.to(z.device), NEG_INF)
        return z


def removed_mass(p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_{v ∉ M} p(v) per row: the probability the mask takes away from the kernel p [B, V]."""
    return (p * (~mask.to(p.device)).to(p.dtype)).sum(dim=-1)


@dataclass
class Observation:
    """y_t: what a controller may read at token step t (rows b = 0..B−1)."""

    t: int  # token step about to be taken (1 for the first generated token)
    z: torch.Tensor  # logits [B, V], with the inputs of earlier controllers applied
    state: KVState | SSMState  # the state x_t
    texts: list[str]  # the text of each row: the prompt's tail and the generated text
    stop_ids: set[int]
    kernel: Kernel  # the Kernel p is shaped by
    hidden: torch.Tensor | None = None  # h⁽ᴸ⁾ of the last position [B, d], when a controller asks


@dataclass
class ControlRecord:
    """What one controller did at one token step (values per row)."""

    controller: str
    removed_mass: list[float] | None = None  # Σ p(v) over the tokens the mask removed
    removed_tokens: list[int] | None = None
    shift: list[float] | None = None  # max |v_t| of a logit input
    note: dict = field(default_factory=dict)  # e.g. {"no_safe_token": [rows], "action": "stop"}

    def row(self, b: int) -> dict:
        """The record of one row, with scalars instead of per-row lists (for traces)."""
        out: dict = {"controller": self.controller}
        for key in ("removed_mass", "removed_tokens", "shift"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value[b]
        for key, value in self.note.items():
            if key == "no_safe_token":
                if b in value:
                    out["no_safe_token"] = True
            else:
                out[key] = value
        return out

    def to_dict(self) -> dict:
        return asdict(self)


class Controller:
    """A feedback law. Override `act` (kernel inputs), `hooks` (residual inputs), or both."""

    name = "controller"
    order = 50  # composition order: lower acts first
    needs_hidden = False  # ask the loop for h⁽ᴸ⁾ of the last position
    prefix: torch.Tensor | None = None  # a soft prefix P (context input), if any

    def hooks(self, model) -> list[tuple[str, Callable]]:
        """Residual inputs u(ℓ, t) as (hook point, fn) pairs, attached for the whole run."""
        return []

    def act(self, obs: Observation) -> KernelInput | None:
        """(v_t, M_t) for this step, or None for a zero input."""
        return None

    def describe(self) -> dict:
        return {"controller": self.name}


# ---------------------------------------------------------------------- composition
def ordered(controllers: Sequence[Controller] | None) -> list[Controller]:
    out = list(controllers or [])
    for c in out:
        if not isinstance(c, Controller):
            raise InputError(f"{c!r} is not a Controller")
    return sorted(out, key=lambda c: c.order)


def the_prefix(controllers: Sequence[Controller]) -> torch.Tensor | None:
    prefixes = [c.prefix for c in controllers if c.prefix is not None]
    if len(prefixes) > 1:
        raise InputError(f"{len(prefixes)} soft prefixes given: expected at most one")
    return prefixes[0] if prefixes else None


def control_step(controllers: Sequence[Controller], obs: Observation) -> tuple[torch.Tensor, list[ControlRecord]]:
    """Apply the controllers' kernel inputs in order: z ↦ z + v, −∞ outside M; record each.

    The removed mass of a mask is measured under the kernel (τ, top-k, top-p) applied to
    the logits that controller saw.
    """
    z, records = obs.z, []
    for c in controllers:
        obs.z = z
        u = c.act(obs)
        if u is None or (u.v is None and u.mask is None):
            continue
        rec = ControlRecord(controller=c.name, note=dict(u.note or {}))
        if u.v is not None:
            rec.shift = [float(a) for a in u.v.abs().amax(dim=-1).reshape(-1)]
        z_in = z + u.v.to(z.dtype) if u.v is not None else z
        if u.mask is not None:
            p = obs.kernel.probs(z_in)
            rec.removed_mass = [float(m) for m in removed_mass(p, u.mask)]
            rec.removed_tokens = [int(n) for n in ((~u.mask) & torch.isfinite(z_in)).sum(dim=-1)]
        z = u.apply(z)
        records.append(rec)
    obs.z = z
    return z, records


# ---------------------------------------------------------------------- one sequence's loop
class ControlLoop:
    """The controllers of one sequence, as the engine calls them at each of its token steps.

    `reads`: the text a barrier sees, the tail of the whole context ("context") or only the
    current turn ("turn": the agent's free text since the last observation).
    """

    def __init__(self, model, controllers, *, kernel, stop_ids=(), reads: str = "context"):
        if reads not in ("context", "turn"):
            raise InputError(f"reads={reads!r}: expected context or turn")
        self.model, self.kernel, self.reads = model, kernel, reads
        self.controllers = ordered(controllers)
        self.stop_ids = set(stop_ids)
        self.prefix = the_prefix(self.controllers)
        self.table = None if getattr(model, "tokenizer", None) is None else model.tokenizer.table
        self._hidden: Recorder | None = None  # a Recorder of h⁽ᴸ⁾, when a controller reads it
        self.text = ""

    def describe(self) -> list[dict]:
        return [c.describe() for c in self.controllers]

    def hooks(self, model) -> list[tuple[str, Callable]]:
        """The residual inputs, and the h⁽ᴸ⁾ probe when a controller reads it (for this sequence's rows)."""
        pairs = [pair for c in self.controllers for pair in c.hooks(model)]
        if any(c.needs_hidden for c in self.controllers):
            L = model.config.n_layer
            self._hidden = hidden = Recorder(model, [f"blocks.{L - 1}.hook_resid_post"], last=True, keep="latest")
            pairs += hidden.hooks()
        return pairs

    @property
    def hidden(self) -> torch.Tensor | None:
        """h⁽ᴸ⁾ of the last position after the latest step, [1, d] (when a controller reads it)."""
        return None if self._hidden is None else self._hidden.latest(self._hidden.names[0])

    def start(self, prompt: list[int], x, budget: int) -> None:
        """The text each barrier starts from (the tail of the decoded prompt); with a soft prefix,
        Π_T must not drop tokens (the prefix rows have no token to re-prefill)."""
        T = self.model.config.n_ctx
        if self.prefix is not None and x.n + budget > T:
            raise InputError(f"soft prefix with {x.n} positions and {budget} new tokens exceeds T={T}; "
                             "shorten the prompt or the budget")
        tok = self.model.tokenizer
        self.text = tok.decode(prompt)[-TEXT_TAIL:] if tok is not None and self.reads == "context" else ""

    def act(self, t: int, z: torch.Tensor, x) -> tuple[torch.Tensor, list[dict]]:
        """(v_t, M_t) from the observation y_t, applied to z [1, V]; what each controller did."""
        obs = Observation(t=t, z=z, state=x, texts=[self.text], stop_ids=self.stop_ids, kernel=self.kernel,
                          hidden=self.hidden)
        z, records = control_step(self.controllers, obs)
        return z, [r.row(0) for r in records]

    def observe(self, tokens: list[int]) -> None:
        """Text that entered the context (an injected observation): read on, or a new turn starts."""
        if self.reads == "turn":
            self.text = ""
            return
        self._append(tokens)

    def advance(self, token: int) -> None:
        """Append the text of the new token w_{t+1}."""
        self._append([token])

    def _append(self, tokens: list[int]) -> None:
        if self.table is None:
            return
        texts = self.table.texts
        piece = "".join(texts[i] if 0 <= i < len(texts) else "" for i in tokens)
        self.text = (self.text + piece)[-TEXT_TAIL:]
