"""Controllers: feedback laws that compute the inputs of each token step from the observed state.

At token step t a controller sees y_t = (z_t, x_t, text so far, optionally the final
hidden state h_t⁽ᴸ⁾) and returns a kernel input (v_t, M_t); it may also hold residual
inputs u(ℓ, t) (hooks, attached for the whole run) or a soft prefix P. This is the
survey's test-time alignment: "algorithms that act as external controllers to regulate
the behavior during inference without modifying the underlying weights" ("Safety and
Alignment").

Controllers compose in order of `order` (steering < objectives < safety), each seeing
the logits already shaped by the ones before, so a safety filter always acts last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from hybridlm.control.inputs import KernelInput, removed_mass
from hybridlm.errors import InputError


@dataclass
class Observation:
    """y_t: what a controller may read at token step t (rows b = 0..B−1)."""

    t: int  # token step about to be taken (1 for the first generated token)
    z: torch.Tensor  # logits [B, V], with the inputs of earlier controllers applied
    state: object  # the KVState x_t
    texts: list[str]  # the text of each row: the prompt's tail and the generated text
    stop_ids: set[int]
    kernel: object  # the Kernel p is shaped by
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


# ---------------------------------------------------------------------- registry
REGISTRY: dict[str, type[Controller]] = {}


def register(name: str):
    """Class decorator: make a controller constructible by name with `make_controller`."""

    def put(cls: type[Controller]) -> type[Controller]:
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return put


def make_controller(name: str, *args, **kwargs) -> Controller:
    if name not in REGISTRY:
        raise InputError(f"controller {name!r}: expected one of {sorted(REGISTRY)}")
    return REGISTRY[name](*args, **kwargs)


# ---------------------------------------------------------------------- composition
def ordered(controllers: Sequence[Controller] | None) -> list[Controller]:
    out = list(controllers or [])
    for c in out:
        if not isinstance(c, Controller):
            raise InputError(f"{c!r} is not a Controller")
    return sorted(out, key=lambda c: c.order)


def all_hooks(controllers: Sequence[Controller], model) -> list[tuple[str, Callable]]:
    return [pair for c in controllers for pair in c.hooks(model)]


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
