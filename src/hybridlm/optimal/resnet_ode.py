"""ResNets as Euler discretisations of ż = w(t)Σ(W(t)z) (docs/theory.md §5.1, the survey's (0.18)–(0.21)).

A continuous model with a given, smooth input W(t) (the "fixed inputs" case of the survey)
is solved to high accuracy with scipy's DOP853. A ResNet of depth ℓ is built from it on the
grid t_k = (k−1)/(ℓ−1), k = 1, …, ℓ, with W(k) = W(t_k) (the survey's (0.20)); its step w(k)
is the grid spacing 1/(ℓ−1) (``step="grid"``) or the survey's w(k) = 1/ℓ (``step="survey"``;
then z(ℓ) sits at time (ℓ−1)/ℓ, an extra O(1/ℓ) error). The error (0.21) falls like 1/ℓ.

A second-order version z̈ = w(t)Σ(W(t)z), ż(0) = p(0), gives the momentum-style
architectures: forward Euler, semi-implicit (symplectic) Euler and velocity Verlet
(leapfrog) on the pair (z, p).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridlm.errors import InputError
from hybridlm.optimal.adjoint import Network, activation, check_finite

STEPS = ("grid", "survey")
SCHEMES = ("euler", "semi-implicit", "verlet")


@dataclass(frozen=True)
class Affine:
    """W(t) = W0 + t W1."""

    W0: torch.Tensor
    W1: torch.Tensor

    def __call__(self, t: float) -> torch.Tensor:
        return self.W0 + t * self.W1


@dataclass(frozen=True)
class Sinusoid:
    """W(t) = W0 + sin(ω t) W1."""

    W0: torch.Tensor
    W1: torch.Tensor
    omega: float = 2 * math.pi

    def __call__(self, t: float) -> torch.Tensor:
        return self.W0 + math.sin(self.omega * t) * self.W1


def _one(t: float) -> float:
    return 1.0


@dataclass(frozen=True)
class ContinuousModel:
    """ż = w(t) Σ(W(t) z) on t ∈ [0, 1] (the survey's (0.19) with the scalar input of (0.38))."""

    W: Callable[[float], torch.Tensor]
    w: Callable[[float], float] = field(default=_one)
    act: str = "tanh"

    @property
    def width(self) -> int:
        return self.W(0.0).shape[0]

    def field(self, t: float, z: torch.Tensor) -> torch.Tensor:
        """f(t, z) = w(t) Σ(W(t) z), z: [s, n]."""
        return self.w(t) * activation(self.act).sigma(z @ self.W(t).T)

    def jacobian(self, t: float, z: torch.Tensor) -> torch.Tensor:
        """∂f/∂z = w(t) diag(σ′(W(t) z)) W(t), one [n, n] matrix per sample: [s, n, n]."""
        Wt = self.W(t)
        return self.w(t) * activation(self.act).dsigma(z @ Wt.T)[:, :, None] * Wt[None]

    def resnet(self, depth: int, *, step: str = "grid") -> Network:
        """The ResNet (0.20): W(k) = W((k−1)/(ℓ−1)), w(k) = τ w(t_k), τ = 1/(ℓ−1) or 1/ℓ."""
        t = grid(depth)
        tau = step_size(depth, step)
        W = torch.stack([self.W(float(tk)) for tk in t[:-1]])
        w = torch.tensor([tau * self.w(float(tk)) for tk in t[:-1]], dtype=W.dtype)
        return Network(W, w, None, self.act)


def grid(depth: int) -> np.ndarray:
    """t_k = (k−1)/(ℓ−1) for k = 1, …, ℓ (the survey's (0.20)–(0.21))."""
    if not isinstance(depth, int | np.integer) or depth < 2:
        raise InputError(f"depth ℓ = {depth}: expected an integer ℓ ≥ 2")
    return np.linspace(0.0, 1.0, depth)


def step_size(depth: int, step: str) -> float:
    if step not in STEPS:
        raise InputError(f"step {step!r}: expected one of {', '.join(STEPS)}")
    return 1.0 / (depth - 1) if step == "grid" else 1.0 / depth


def random_model(width: int, *, seed: int = 0, kind: str = "affine", scale: float = 1.5,
                 act: str = "tanh", dtype: torch.dtype = torch.float64) -> ContinuousModel:
    """A model with W(t) = W0 + t W1 (``affine``) or W0 + sin(2πt) W1 (``sinusoid``)."""
    if width < 1:
        raise InputError(f"width n = {width}: expected n ≥ 1")
    if not math.isfinite(scale):
        raise InputError(f"scale = {scale}: expected a finite number")
    g = torch.Generator().manual_seed(seed)
    W0, W1 = (torch.randn(2, width, width, generator=g, dtype=dtype) * (scale / math.sqrt(width))).unbind(0)
    if kind == "affine":
        return ContinuousModel(Affine(W0, W1), act=act)
    if kind == "sinusoid":
        return ContinuousModel(Sinusoid(W0, W1), act=act)
    raise InputError(f"kind {kind!r}: expected affine or sinusoid")


def reference(rhs: Callable[[float, torch.Tensor], torch.Tensor], y0: torch.Tensor,
              t_eval: Sequence[float] | np.ndarray, *, rtol: float = 1e-12, atol: float = 1e-12) -> torch.Tensor:
    """Solution of ẏ = rhs(t, y) at t_eval by scipy's DOP853 (all samples at once): [T, *y0.shape]."""
    from scipy.integrate import solve_ivp

    check_finite("initial state", y0)
    shape, dtype = y0.shape, y0.dtype

    def f(t, y):
        return rhs(t, torch.from_numpy(y).reshape(shape)).reshape(-1).numpy()

    sol = solve_ivp(f, (0.0, float(t_eval[-1])), y0.detach().double().reshape(-1).numpy(),
                    method="DOP853", t_eval=np.asarray(t_eval, dtype=float), rtol=rtol, atol=atol)
    if not sol.success:  # pragma: no cover - DOP853 on a smooth bounded field
        raise RuntimeError(f"DOP853 failed: {sol.message}")
    return torch.from_numpy(sol.y.T.copy()).reshape(len(t_eval), *shape).to(dtype)


def resnet_error(model: ContinuousModel, x: torch.Tensor, depth: int, *, step: str = "grid") -> dict:
    """The error (0.21) of the depth-ℓ ResNet: ‖z(ℓ) − z_c(1)‖ and max_k ‖z(k) − z_c(t_k)‖.

    Norms are Euclidean per sample, then the largest over the samples.
    """
    from hybridlm.optimal.adjoint import forward

    net = model.resnet(depth, step=step)
    Z = forward(net, x).Z
    ref = reference(model.field, x, grid(depth))
    per_k = (Z - ref).norm(dim=-1).amax(dim=-1)  # t_ℓ = 1: per_k[-1] is ‖z(ℓ) − z_c(1)‖
    return {"depth": depth, "final": float(per_k[-1]), "uniform": float(per_k.max())}


def loglog_slope(depths: Sequence[int], errors: Sequence[float]) -> float:
    """Least-squares slope of log(error) against log(ℓ)."""
    e = np.asarray(errors, dtype=float)
    if len(depths) < 2 or not np.all(np.isfinite(e)) or np.any(e <= 0):
        raise InputError(f"errors {list(e)}: expected at least two finite positive values for a log-log fit")
    return float(np.polyfit(np.log(np.asarray(depths, dtype=float)), np.log(e), 1)[0])


def second_order_field(model: ContinuousModel) -> Callable[[float, torch.Tensor], torch.Tensor]:
    """(ż, ṗ) = (p, w(t)Σ(W(t)z)) for z̈ = w(t)Σ(W(t)z); the state stacks z and p: [2, s, n]."""

    def rhs(t: float, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([y[1], model.field(t, y[0])])

    return rhs


def second_order_resnet(model: ContinuousModel, z0: torch.Tensor, p0: torch.Tensor, depth: int,
                        scheme: str) -> torch.Tensor:
    """Momentum-style ResNet of depth ℓ on t_k = (k−1)/(ℓ−1): the states z(1..ℓ), [ℓ, s, n].

    ``euler``: z⁺ = z + τp, p⁺ = p + τf(t_k, z); ``semi-implicit`` (symplectic Euler):
    p⁺ = p + τf(t_k, z), z⁺ = z + τp⁺; ``verlet`` (leapfrog): half kick, drift, half kick
    with f(t_{k+1}, z⁺), i.e. W(k+1) is shared with the next layer.
    """
    if scheme not in SCHEMES:
        raise InputError(f"scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    t, tau = grid(depth), step_size(depth, "grid")
    z, p, out = z0, p0, [z0]
    for k in range(depth - 1):
        f = model.field(float(t[k]), z)
        if scheme == "euler":
            z, p = z + tau * p, p + tau * f
        elif scheme == "semi-implicit":
            p = p + tau * f
            z = z + tau * p
        else:
            p = p + 0.5 * tau * f
            z = z + tau * p
            p = p + 0.5 * tau * model.field(float(t[k + 1]), z)
        out.append(z)
    return torch.stack(out)


def euler_study(model: ContinuousModel, x: torch.Tensor, depths: Sequence[int], *,
                p0: torch.Tensor | None = None) -> dict:
    """Errors at t = 1 against DOP853 for every depth and scheme, and their log-log slopes."""
    depths = [int(d) for d in depths]
    if len(depths) < 2:
        raise InputError(f"depths {depths}: expected at least two depths for a slope")
    for d in depths:
        grid(d)
    on_grid = [resnet_error(model, x, d) for d in depths]
    rows = {
        "resnet (0.20), w(k)=1/(ℓ−1)": [e["final"] for e in on_grid],
        "resnet (0.20), w(k)=1/ℓ": [resnet_error(model, x, d, step="survey")["final"] for d in depths],
        "resnet (0.21) max over k": [e["uniform"] for e in on_grid],
    }
    p0 = torch.zeros_like(x) if p0 is None else p0
    z1 = reference(second_order_field(model), torch.stack([x, p0]), [0.0, 1.0])[-1, 0]
    for scheme in SCHEMES:
        rows[f"2nd order, {scheme}"] = [
            float((second_order_resnet(model, x, p0, d, scheme)[-1] - z1).norm(dim=-1).amax()) for d in depths
        ]
    return {"depths": depths, "errors": rows,
            "slopes": {name: loglog_slope(depths, e) for name, e in rows.items()}}
