"""The linear recurrence along positions, c_i = a_i ⊙ c_{i−1} + b_i, two ways (docs/theory.md §5.4, the survey's (S17)).

For a diagonal state matrix Ā(k, z) the position recursion of (S17) is element-wise, and
the pairs (a, b) compose under the associative operator

    (a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂,  a₂ b₁ + b₂)

("apply step 1, then step 2"). `parallel_scan` evaluates all prefixes with Hillis–Steele
doubling: after the round with offset 2^r every position holds the composition of the
2^{r+1} steps ending there, so ⌈log₂ n⌉ rounds of element-wise work give every c_i
(prefill). `recurrence` applies the steps one after another (decode, and the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One position: c_i = a_i ⊙ c_{i−1} + b_i."""
    return a * c + b


def recurrence(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor | None = None) -> torch.Tensor:
    """All states c_1..c_n by the step recursion; a, b: [B, n, ...], c0: [B, ...] (default 0)."""
    c = torch.zeros_like(b[:, 0]) if c0 is None else c0
    out = []
    for i in range(b.shape[1]):
        c = step(a[:, i], b[:, i], c)
        out.append(c)
    return torch.stack(out, dim=1)


def parallel_scan(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor | None = None) -> torch.Tensor:
    """All states c_1..c_n in ⌈log₂ n⌉ rounds of the operator ∘; same shapes as `recurrence`."""
    if c0 is not None:  # fold the initial state into the first step: b_1 ← a_1 c_0 + b_1
        b = torch.cat([step(a[:, :1], b[:, :1], c0[:, None]), b[:, 1:]], dim=1)
    offset = 1
    while offset < b.shape[1]:
        # position i absorbs the block ending at i − offset: (a_{<}, b_{<}) ∘ (a_i, b_i)
        b = step(a, b, _shift(b, offset, 0.0))
        a = a * _shift(a, offset, 1.0)
        offset *= 2
    return b


def _shift(x: torch.Tensor, offset: int, identity: float) -> torch.Tensor:
    """x at position i − offset, padded with the identity of ∘, (1, 0), where i < offset."""
    return F.pad(x[:, :-offset], [0, 0] * (x.dim() - 2) + [offset, 0], value=identity)
