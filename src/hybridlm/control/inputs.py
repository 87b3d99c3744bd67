"""Input channels of the token-clock recursion (SPEC.md §2 made controlled; survey, "Safety and Alignment").

The uncontrolled recursion w_{t+1} ~ p_θ(· | s_t) gets three kinds of input:

    kernel   p_u(v | s_t) ∝ M_t(v) · exp((z_t(v) + v_t(v)) / τ)     logit input v_t, hard mask M_t
    state    H⁽ℓ⁾(i) ← H⁽ℓ⁾(i) + u(ℓ, t)   at chosen layers ℓ and positions i  (residual input)
    context  H⁽⁰⁾ = [P; U(s) W_e] + P W_p,  P ∈ ℝ^{p×d}                    (soft prefix)

Every input defaults to zero / absent; then nothing is attached and the system is the
uncontrolled one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridlm.errors import InputError

NEG_INF = float("-inf")


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


def residual_hook(u: torch.Tensor, *, from_pos: int = 0) -> Callable:
    """A hook adding u ([d] or [B, d]) to every row at position ≥ from_pos: H⁽ℓ⁾(i) + u(ℓ, t)."""

    def add(h: torch.Tensor, hook) -> torch.Tensor:
        uu = u.to(h.dtype) if u.dim() == 1 else u.to(h.dtype)[:, None, :]
        if from_pos <= 0:
            return h + uu
        pos = hook.ctx.pos
        on = (pos >= from_pos).to(h.dtype)[:, None]  # [n, 1]
        return h + on * uu

    return add


def residual_point(model, layer: int) -> str:
    """The hook point of H⁽ℓ⁾ for ℓ ∈ 0..L: the input of block ℓ, or the output of the last block."""
    L = model.config.n_layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= L:
        raise InputError(f"layer {layer!r}: expected an integer in 0..{L} (H⁽ℓ⁾, ℓ = 0 is the embedding)")
    return f"blocks.{layer}.hook_resid_pre" if layer < L else f"blocks.{L - 1}.hook_resid_post"


@torch.no_grad()
def prefill(model, ids, prefix: torch.Tensor | None = None, *, batch: int | None = None):
    """x_0 from the string(s) ids, with the soft prefix P prepended to H⁽⁰⁾ when given.

    The state then holds p + n positions; its token record marks the prefix rows with −1.
    """
    ids = model._check_ids(ids)
    if batch is not None and ids.shape[0] != batch:
        ids = ids.expand(batch, -1)
    if prefix is None:
        return model.init_state(ids)
    p = prefix.shape[-2]
    if p + ids.shape[1] > model.config.n_ctx:
        raise InputError(f"soft prefix ({p}) and prompt ({ids.shape[1]}) exceed the horizon T={model.config.n_ctx}")
    x = model.empty_state(ids.shape[0], capacity=p + ids.shape[1])
    x.logits = model(ids, x, last_only=True, prefix=prefix.detach())[:, -1]
    return x
