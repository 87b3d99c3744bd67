"""Memorisation as simultaneous control (docs/theory.md §5.2, the survey's "Universal approximation").

The memorisation problem asks for one open-loop input (w, W) that steers every sample x_i
of a finite set to its target y_i = ψ(x_i) through the same flow: ‖ψ − h∘γ∘f‖ ≤ ε on the
samples. Here the flow is a narrow deep ResNet z(k+1) = z(k) + w(k)Σ(W(k)z(k) + b(k)) of
width n = 2·max(n_in, n_out) + 1, f embeds ℝ^{n_in} into ℝⁿ by zero padding and h reads the
first n_out coordinates. The weights (w(k), W(k), b(k)), shared by all samples, are the
control; they start from w(k) = 1/(ℓ−1) (a flow on [0, 1]) and are trained with the explicit
adjoint gradients of :mod:`hybridlm.optimal.adjoint` (0.33)–(0.34), stepped by Adam. Deeper
networks reach smaller errors for the same number of steps (until the step budget, not the
depth, limits the fit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridlm.errors import InputError
from hybridlm.optimal.adjoint import Network, backprop, check_finite, forward, random_network


def memorisation_width(n_in: int, n_out: int) -> int:
    """n = 2·max(n_in, n_out) + 1."""
    if n_in < 1 or n_out < 1:
        raise InputError(f"n_in = {n_in}, n_out = {n_out}: expected both ≥ 1")
    return 2 * max(n_in, n_out) + 1


def embed(x: torch.Tensor, width: int) -> torch.Tensor:
    """f: ℝ^{n_in} → ℝⁿ, zero padding."""
    if x.ndim != 2 or x.shape[1] > width:
        raise InputError(f"x has shape {tuple(x.shape)}: expected [s, n_in] with n_in ≤ width {width}")
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def readout(z: torch.Tensor, n_out: int) -> torch.Tensor:
    """h: ℝⁿ → ℝ^{n_out}, projection on the first n_out coordinates."""
    return z[:, :n_out]


def sample_task(s: int = 12, *, n_in: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
    """s points uniform in [−1, 1]^{n_in}, targets ψ(x) = sin(πx₁)·cos(πx₂)… (n_out = 1)."""
    if s < 1:
        raise InputError(f"s = {s} samples: expected s ≥ 1")
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(s, n_in, generator=g, dtype=dtype) - 1
    y = torch.sin(math.pi * x[:, :1]) * torch.cos(math.pi * x[:, 1:]).prod(dim=1, keepdim=True)
    return x, y


def memorise(x: torch.Tensor, y: torch.Tensor, depth: int, *, steps: int = 400, lr: float = 0.05,
             seed: int = 0, train_w: bool = True, scale: float = 0.5) -> dict:
    """Train one control (w(k), W(k), b(k)) for all samples; report the errors on the samples.

    ``train_w=False`` keeps w(k) = 1/(ℓ−1) fixed; ``scale`` sets the initial weights' size.
    Returns the loss history and, after training, ``max_error`` = max_i ‖h(z_i(ℓ)) − y_i‖ and
    ``rms_error``.
    """
    check_finite("x", x)
    check_finite("y", y)
    if y.ndim != 2 or x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise InputError(f"x {tuple(x.shape)} and y {tuple(y.shape)}: expected [s, n_in] and [s, n_out]")
    if depth < 2:
        raise InputError(f"depth ℓ = {depth}: expected ℓ ≥ 2")
    if steps < 1 or not (math.isfinite(lr) and lr > 0):
        raise InputError(f"steps = {steps}, lr = {lr}: expected steps ≥ 1 and a finite lr > 0")
    n = memorisation_width(x.shape[1], y.shape[1])
    net = random_network(depth, n, residual=True, seed=seed, scale=scale, bias=True, dtype=x.dtype)
    assert net.b is not None and net.w is not None  # residual=True, bias=True
    params = [net.W.clone(), net.b.clone(), net.w.clone()]
    opt = torch.optim.Adam(params if train_w else params[:2], lr=lr)
    z1 = embed(x, n)
    history = []
    for _ in range(steps):
        L, g, _, _ = backprop(Network(params[0], params[2], params[1], net.act), z1, y)
        history.append(float(L))
        params[0].grad, params[1].grad, params[2].grad = g.W, g.b, g.w
        opt.step()
    net = Network(params[0], params[2], params[1], net.act)
    err = (readout(forward(net, z1).Z[-1], y.shape[1]) - y).norm(dim=1)
    return {"depth": depth, "width": n, "history": history, "max_error": float(err.max()),
            "rms_error": float(err.pow(2).mean().sqrt()), "network": net}


def error_vs_depth(x: torch.Tensor, y: torch.Tensor, depths: Sequence[int], **kw) -> list[dict]:
    """:func:`memorise` at each depth with the same step budget (without the networks)."""
    out = []
    for d in depths:
        r = memorise(x, y, int(d), **kw)
        r.pop("network")
        out.append(r)
    return out
