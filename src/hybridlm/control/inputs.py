"""Input channels of the token-clock recursion (docs/theory.md §2 made controlled; survey, "Safety and Alignment").

The uncontrolled recursion w_{t+1} ~ p_θ(· | s_t) gets three kinds of input:

    kernel   p_u(v | s_t) ∝ M_t(v) · exp((z_t(v) + v_t(v)) / τ)     logit input v_t, hard mask M_t
    state    H⁽ℓ⁾(i) ← H⁽ℓ⁾(i) + u(ℓ, t)   at chosen layers ℓ and positions i  (residual input)
    context  H⁽⁰⁾ = [P; U(s) W_e] + P W_p,  P ∈ ℝ^{p×d}                    (soft prefix)

Every input defaults to zero / absent; then nothing is attached and the system is the
uncontrolled one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridlm.engine.inputs import KernelInput, removed_mass  # noqa: F401 - the kernel channel, defined with the engine
from hybridlm.errors import InputError


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
