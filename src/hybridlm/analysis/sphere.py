"""The continuous model of self-attention: tokens on the unit sphere (the survey's (0.42)–(0.45)).

n tokens z_i ∈ S^{d−1} move by

    ż_i = P_{z_i} Σ_h W_U^h Σ_j a^h_ij z_j,   P_z = I − z zᵀ,                 (0.43)/(0.44)
    a^h_ij = exp(z_iᵀ W_P^h z_j/√e) / Σ_k exp(z_iᵀ W_P^h z_k/√e),              (0.42)

with j, k ≤ i in the causal variant and 1..n in the full one. P_z is the tangent map of the
normalisation n(z) = z/‖z‖ on the sphere, so the flow stays on (S^{d−1})^n. W_U^h = W_o^h W_V^h
and e is the query/key dimension. Orientation of W_P: the survey writes the column-wise
softmax of Zᵀ W_P Z with W_P = W_Kᵀ W_Q, whose (j, i) entry is z_jᵀ W_P z_i; here, as in
docs/theory.md §5.3, the score of query i on key j is z_iᵀ W_P z_j, i.e. W_P = W_Qᵀ W_K (pass the
transpose of the survey's matrix).

Known cases (causal; [98] in the survey): W_U = I, any heads → every token converges to the
first token's initial position z_1(0) (token 1 attends only to itself and P_{z_1} z_1 = 0);
one head with constant symmetric W_U → token 1 follows z_1(t) = e^{tW_U} z_1(0)/‖·‖ and so
converges to ± the principal eigenvector of W_U, with the sign of ⟨z_1(0), v⟩.

Consensus is measured by E = 1 − (1/n) Σ_i cos(z_1, z_i), eq. (0.45): `consensus_E`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import numpy as np
from scipy.integrate import solve_ivp
from scipy.special import softmax

try:  # torch is a dependency of hybridlm, but the simulator itself needs only numpy
    import torch

    _TENSOR_TYPES: tuple[type, ...] = (torch.Tensor,)
except ImportError:  # pragma: no cover
    _TENSOR_TYPES = ()

Weights = Union[np.ndarray, Callable[[float], np.ndarray]]


# ---------------------------------------------------------------------- consensus
def consensus_E(z):
    """Consensus error E = 1 − (1/n) Σ_i ⟨z_1, z_i⟩/(‖z_1‖‖z_i‖), eq. (0.45): [..., n, d] → [...].

    Works on numpy arrays and torch tensors alike (batched over leading axes; the result has
    the input's kind). Evaluated as (1/2n) Σ_i ‖ẑ_1 − ẑ_i‖² with ẑ = z/‖z‖, the same number
    without the cancellation of 1 − cos near consensus: E ≥ 0 exactly, and E ≈ θ²/2 stays
    accurate far below machine epsilon. E = 0 iff all tokens align; a zero token gives nan.
    """
    if not isinstance(z, _TENSOR_TYPES):
        z = np.asarray(z, dtype=float)
    u = z / ((z * z).sum(-1, keepdims=True) ** 0.5)
    diff = u[..., :1, :] - u
    return (diff * diff).sum(-1).mean(-1) / 2


# ---------------------------------------------------------------------- the vector field
def _heads(W, t: float, d: int, what: str) -> np.ndarray:
    """Weights at time t as [heads, d, d]: a [d, d] matrix is one head; callables are W(t)."""
    W = np.asarray(W(t) if callable(W) else W, dtype=float)
    W = W[None] if W.ndim == 2 else W
    if W.ndim != 3 or W.shape[1:] != (d, d):
        raise ValueError(f"{what} must be [d, d] or [heads, d, d] with d={d}; got shape {W.shape}")
    return W


def sphere_field(
    z: np.ndarray,
    W_U: np.ndarray,
    W_P: np.ndarray,
    *,
    e: float | None = None,
    causal: bool = True,
) -> np.ndarray:
    """ż for tokens z [n, d] and weights [d, d] or [heads, d, d] (one per head or shared)."""
    n, d = z.shape
    W_U, W_P = _heads(W_U, 0.0, d, "W_U"), _heads(W_P, 0.0, d, "W_P")
    W_U, W_P = np.broadcast_arrays(W_U, W_P)
    # matrix products (BLAS), not a three-operand einsum, which numpy evaluates as one slow loop at a real model's d
    scores = (z @ W_P) @ z.T / np.sqrt(d if e is None else e)  # [head, i, j]: z_iᵀ W_P^h z_j
    if causal:
        scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    a = softmax(scores, axis=-1)  # [head, query pos, key pos], row-stochastic
    u = ((a @ z) @ W_U.transpose(0, 2, 1)).sum(0)  # Σ_h W_U^h Σ_j a^h_ij z_j
    return u - (u * z).sum(-1, keepdims=True) * z  # P_{z_i} u_i


# ---------------------------------------------------------------------- integration
@dataclass(frozen=True)
class SphereTrajectory:
    """Solution of (0.43) on a grid: t [m], z [m, n, d]; `drift` = max |‖z_i(t)‖ − 1| on it."""

    t: np.ndarray
    z: np.ndarray
    causal: bool
    drift: float
    nfev: int
    method: str

    @property
    def E(self) -> np.ndarray:
        """Consensus error (0.45) at every time of the grid: [m]."""
        return consensus_E(self.z)

    @property
    def final(self) -> np.ndarray:
        return self.z[-1]


def normalize_tokens(z0) -> np.ndarray:
    """Project the rows of z0 [n, d] onto S^{d−1}; a zero row has no direction and is an error."""
    z0 = np.asarray(z0, dtype=float)
    if z0.ndim != 2:
        raise ValueError(f"z0 must be [n, d]; got shape {z0.shape}")
    norm = np.linalg.norm(z0, axis=-1, keepdims=True)
    if not np.all(np.isfinite(z0)) or np.any(norm == 0):
        raise ValueError(f"rows {np.flatnonzero((norm[:, 0] == 0) | ~np.isfinite(norm[:, 0])).tolist()} "
                         "of z0 are zero or not finite and cannot be put on the sphere")
    return z0 / norm


def simulate_sphere(
    z0,
    W_U: Weights,
    W_P: Weights,
    *,
    t_end: float,
    n_eval: int = 201,
    causal: bool = True,
    e: float | None = None,
    method: str = "DOP853",
    rtol: float = 1e-8,
    atol: float = 1e-10,
) -> SphereTrajectory:
    """Integrate (0.43) from z0 [n, d] (rows normalised onto the sphere) over [0, t_end].

    W_U, W_P: [d, d] (one head), [heads, d, d], or callables t ↦ such (time-varying weights).
    e: query/key dimension in the √e of (0.42) (default d). The solution is reported on
    `n_eval` evenly spaced times by scipy's `solve_ivp` (`method`: RK45, DOP853, ...).
    """
    z0 = normalize_tokens(z0)
    n, d = z0.shape

    def rhs(t, y):
        return sphere_field(y.reshape(n, d), _heads(W_U, t, d, "W_U"), _heads(W_P, t, d, "W_P"),
                            e=e, causal=causal).ravel()

    t_eval = np.linspace(0.0, t_end, n_eval)
    sol = solve_ivp(rhs, (0.0, t_end), z0.ravel(), method=method, t_eval=t_eval, rtol=rtol, atol=atol)
    if not sol.success:
        raise RuntimeError(f"solve_ivp ({method}) failed: {sol.message}")
    z = sol.y.T.reshape(len(sol.t), n, d)
    drift = float(np.abs(np.linalg.norm(z, axis=-1) - 1).max())
    return SphereTrajectory(t=sol.t, z=z, causal=causal, drift=drift, nfev=int(sol.nfev), method=method)
