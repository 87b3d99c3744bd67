"""Backpropagation as a discrete adjoint (docs/theory.md §5.2, the survey's "Optimal control and backpropagation").

Layers are numbered as in the survey, k = 1, …, ℓ. A network of depth ℓ has ℓ states
z(1), …, z(ℓ) and ℓ − 1 weight matrices W(1), …, W(ℓ − 1). In code the layer index is
shifted by one: ``Z[k-1] = z(k)``, ``W[k-1] = W(k)``, ``V[k-1] = v(k+1) = W(k) z(k)``.
Samples are rows: z(k) for the s samples is an [s, n] tensor.

Everything here is written out by hand, with no autograd: the forward recursion, the
adjoint (costate) recursion backwards from λ(ℓ) = −∂L/∂z(ℓ), and the weight gradient built
from the two. The loss is L = (1/2s) Σ_i ‖h(z_i(ℓ)) − y_i‖², where the read-out h keeps the
first o coordinates of z(ℓ) (o = the width of y; o = n reads the whole state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridlm.errors import InputError


@dataclass(frozen=True)
class Activation:
    """σ: ℝ → ℝ and its derivative σ′, applied entry-wise (Σ(v) = (σ(v_1), …, σ(v_n)))."""

    name: str
    sigma: Callable[[torch.Tensor], torch.Tensor]
    dsigma: Callable[[torch.Tensor], torch.Tensor]


def _dtanh(v: torch.Tensor) -> torch.Tensor:
    return 1.0 - torch.tanh(v) ** 2


def _dsigmoid(v: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(v)
    return s * (1.0 - s)


def _softplus(v: torch.Tensor) -> torch.Tensor:
    """log(1 + e^v) everywhere. (torch's softplus returns v beyond v = 20, whose slope 1 is not
    the σ′ = sigmoid(v) of the adjoint: a relative 2·10⁻⁹ that compounds through the layers.)"""
    return torch.logaddexp(v, torch.zeros((), dtype=v.dtype, device=v.device))


ACTIVATIONS = {
    "tanh": Activation("tanh", torch.tanh, _dtanh),
    "sigmoid": Activation("sigmoid", torch.sigmoid, _dsigmoid),
    "softplus": Activation("softplus", _softplus, torch.sigmoid),
}


def activation(name: str | Activation) -> Activation:
    """The activation called ``name`` (tanh, sigmoid or softplus)."""
    if isinstance(name, Activation):
        return name
    if name not in ACTIVATIONS:
        raise InputError(f"unknown activation {name!r}: expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass
class Network:
    """Weights of a feedforward network (``w is None``) or of a ResNet.

    ``W``: [ℓ−1, n, n], W(k); ``w``: [ℓ−1], the scalar ResNet weights w(k); ``b``: [ℓ−1, n]
    or None, an optional bias inside Σ (Σ(W(k)z + b(k)), used for memorisation).
    """

    W: torch.Tensor
    w: torch.Tensor | None = None
    b: torch.Tensor | None = None
    act: str = "tanh"

    def __post_init__(self) -> None:
        check_weights(self.W, self.w, self.b)
        activation(self.act)

    @property
    def depth(self) -> int:
        """ℓ, the number of layers (states)."""
        return self.W.shape[0] + 1

    @property
    def width(self) -> int:
        return self.W.shape[1]

    @property
    def residual(self) -> bool:
        return self.w is not None


@dataclass(frozen=True)
class Trajectory:
    """The forward pass: Z [ℓ, s, n] with Z[k-1] = z(k); V [ℓ−1, s, n] with V[k-1] = v(k+1)."""

    Z: torch.Tensor
    V: torch.Tensor


@dataclass(frozen=True)
class Gradients:
    """∂J/∂W(k) [ℓ−1, n, n], and for a ResNet ∂J/∂w(k) [ℓ−1] and ∂J/∂b(k) [ℓ−1, n]."""

    W: torch.Tensor
    w: torch.Tensor | None = None
    b: torch.Tensor | None = None


def check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{name} has non-finite entries: expected finite real numbers")


def check_weights(W: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """Shapes [ℓ−1, n, n], [ℓ−1], [ℓ−1, n] with ℓ ≥ 2, and finite values."""
    if W.ndim != 3 or W.shape[1] != W.shape[2]:
        raise InputError(f"W has shape {tuple(W.shape)}: expected [ℓ−1, n, n] (square weight matrices)")
    if W.shape[0] < 1:
        raise InputError(f"depth ℓ = {W.shape[0] + 1}: expected ℓ ≥ 2 (at least one weight matrix)")
    check_finite("W", W)
    if w is not None:
        if w.shape != (W.shape[0],):
            raise InputError(f"w has shape {tuple(w.shape)}: expected [{W.shape[0]}] (one scalar per W(k))")
        check_finite("w", w)
    if b is not None:
        if b.shape != W.shape[:2]:
            raise InputError(f"b has shape {tuple(b.shape)}: expected {list(W.shape[:2])}")
        check_finite("b", b)


def check_samples(net: Network, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
    """x: [s, n] with the network's width n; y: [s, o] with o ≤ n; all finite."""
    if x.ndim != 2 or x.shape[1] != net.width:
        raise InputError(f"x has shape {tuple(x.shape)}: expected [s, {net.width}] (width mismatch)")
    check_finite("x", x)
    if y is not None:
        if y.ndim != 2 or y.shape[0] != x.shape[0] or y.shape[1] > net.width:
            raise InputError(f"y has shape {tuple(y.shape)}: expected [{x.shape[0]}, o] with o ≤ {net.width}")
        check_finite("y", y)


def loss(z_end: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """L = (1/2s) Σ_i ‖h(z_i(ℓ)) − y_i‖², h = the first o = y.shape[1] coordinates."""
    r = z_end[:, : y.shape[1]] - y
    return 0.5 * (r * r).sum() / y.shape[0]


def terminal_costate(z_end: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """λ(ℓ) = −∂L/∂z(ℓ) (the survey's (0.26)); zero on the coordinates h does not read."""
    lam = torch.zeros_like(z_end)
    lam[:, : y.shape[1]] = -(z_end[:, : y.shape[1]] - y) / y.shape[0]
    return lam


def forward(net: Network, x: torch.Tensor) -> Trajectory:
    """z(k+1) = Σ(W(k)z(k)) (the survey's (0.24)), or z(k) + w(k)Σ(W(k)z(k)) (the survey's (0.18)).

    v(k+1) = W(k) z(k) (the survey's (0.28)) is kept for the backward pass.
    """
    check_samples(net, x)
    sigma = activation(net.act).sigma
    Z, V = [x], []
    for k in range(net.depth - 1):
        v = Z[-1] @ net.W[k].T
        if net.b is not None:
            v = v + net.b[k]
        V.append(v)
        Z.append(Z[-1] + net.w[k] * sigma(v) if net.w is not None else sigma(v))
    return Trajectory(torch.stack(Z), torch.stack(V))


def adjoint(net: Network, traj: Trajectory, lam_end: torch.Tensor) -> torch.Tensor:
    """Λ [ℓ, s, n] with Λ[k-1] = λ(k), backwards from λ(ℓ).

    Feedforward: λ(k) = W(k)ᵀ diag(σ′(v(k+1))) λ(k+1) (the survey's (0.27)); ResNet:
    λ(k) = λ(k+1) + w(k) W(k)ᵀ diag(σ′(v(k+1))) λ(k+1) (the survey's (0.33)).
    """
    dsigma = activation(net.act).dsigma
    lams = [lam_end]
    for k in reversed(range(net.depth - 1)):
        r = dsigma(traj.V[k]) * lams[-1]  # r(k+1) = diag(σ′(v(k+1))) λ(k+1)
        back = r @ net.W[k]  # rows: (W(k)ᵀ r(k+1))ᵀ
        lams.append(lams[-1] + net.w[k] * back if net.w is not None else back)
    return torch.stack(lams[::-1])


def gradients(net: Network, traj: Trajectory, lam: torch.Tensor) -> Gradients:
    """∂J/∂W(k) = −Σ_i r_i(k+1) z_i(k)ᵀ (the survey's (0.31)), r(k+1) = diag(σ′(v(k+1))) λ(k+1).

    For a ResNet every term carries the factor w(k) (the survey's (0.34)), and
    ∂J/∂w(k) = −Σ_i λ_i(k+1)ᵀ Σ(v_i(k+1)), ∂J/∂b(k) = −w(k) Σ_i r_i(k+1).
    """
    act = activation(net.act)
    R = act.dsigma(traj.V) * lam[1:]  # [ℓ−1, s, n]: R[k-1] = r(k+1)
    dW = -torch.einsum("ksa,ksb->kab", R, traj.Z[:-1])
    if net.w is None:
        return Gradients(dW)
    dw = -(lam[1:] * act.sigma(traj.V)).sum(dim=(1, 2))
    db = -net.w[:, None] * R.sum(dim=1) if net.b is not None else None
    return Gradients(net.w[:, None, None] * dW, dw, db)


def backprop(net: Network, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Gradients, Trajectory, torch.Tensor]:
    """Forward pass, λ(ℓ) (0.26), adjoint pass and gradients: (L, ∂J/∂·, trajectory, Λ)."""
    check_samples(net, x, y)
    traj = forward(net, x)
    lam = adjoint(net, traj, terminal_costate(traj.Z[-1], y))
    return loss(traj.Z[-1], y), gradients(net, traj, lam), traj, lam


def train(net: Network, x: torch.Tensor, y: torch.Tensor, *, steps: int, lr: float,
          train_w: bool = False) -> list[float]:
    """Gradient descent W ← W + η Σ_i r_i(k+1) z_i(k)ᵀ (the survey's (0.32)), in place.

    Uses only the explicit gradients of :func:`gradients`; returns the loss before each step
    and after the last one (steps + 1 values). ``train_w`` also updates the ResNet's w(k).
    """
    if steps < 0:
        raise InputError(f"steps = {steps}: expected steps ≥ 0")
    if not (math.isfinite(lr) and lr > 0):
        raise InputError(f"learning rate η = {lr}: expected a finite η > 0")
    history = []
    for _ in range(steps):
        L, g, _, _ = backprop(net, x, y)
        history.append(float(L))
        net.W = net.W - lr * g.W
        if net.b is not None:
            assert g.b is not None, "gradients() gives ∂J/∂b(k) for a ResNet only"
            net.b = net.b - lr * g.b
        if train_w and net.w is not None:
            assert g.w is not None  # gradients() gives ∂J/∂w(k) whenever the network has w
            net.w = net.w - lr * g.w
    history.append(float(loss(forward(net, x).Z[-1], y)))
    return history


def random_network(depth: int, width: int, *, residual: bool, seed: int = 0, scale: float = 1.0,
                   act: str = "tanh", bias: bool = False, dtype: torch.dtype = torch.float64) -> Network:
    """Gaussian weights W(k) with entries of variance scale²/n; ResNet w(k) = 1/(ℓ−1)."""
    if depth < 2:
        raise InputError(f"depth ℓ = {depth}: expected ℓ ≥ 2")
    if width < 1:
        raise InputError(f"width n = {width}: expected n ≥ 1")
    if not math.isfinite(scale):
        raise InputError(f"scale = {scale}: expected a finite number")
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(depth - 1, width, width, generator=g, dtype=dtype) * (scale / math.sqrt(width))
    w = torch.full((depth - 1,), 1.0 / (depth - 1), dtype=dtype) if residual else None
    b = 0.1 * torch.randn(depth - 1, width, generator=g, dtype=dtype) if bias else None
    return Network(W, w, b, act)
