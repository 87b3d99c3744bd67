"""Pontryagin's costate for ż = w(t)Σ(W(t)z), discretised three ways (the survey's (0.33)–(0.37)).

The costate equation λ̇ = −(∂f/∂z)ᵀ λ (the survey's (0.37)) is integrated backwards from
λ(ℓ) = −∂L/∂z(ℓ) on the ResNet's grid t_k = (k−1)/(ℓ−1), along the states z(k) of the
forward-Euler pass (the ResNet's own forward pass). The Jacobian is formed as a matrix from
the continuous model, w(t) diag(σ′(W(t)z)) W(t), independently of the ResNet's weight list.

* ``semi-implicit`` (symplectic Euler): forward Euler for z, the implicit rule for λ,
  λ(k+1) = λ(k) − τ J(t_k, z(k))ᵀ λ(k+1): the Jacobian at the *old* state z(k) meets the
  *new* costate λ(k+1). Solved for λ(k) this is the ResNet adjoint (0.33).
* ``explicit``: explicit Euler backwards in time, λ(k) = λ(k+1) + τ J(t_{k+1}, z(k+1))ᵀ λ(k+1):
  everything at the known end, so the Jacobian sits at z(k+1).
* ``forward``: the survey's naive forward Euler in forward time,
  λ(k+1) = λ(k) − τ J(t_k, z(k))ᵀ λ(k), solved backwards for λ(k) (a linear solve per step).

Both of the last two are consistent O(τ) discretisations of (0.37), but neither reproduces
the discrete adjoint; the semi-implicit one does, to round-off.
"""

from __future__ import annotations

import torch

from hybridlm.errors import InputError
from hybridlm.optimal.resnet_ode import ContinuousModel, grid, step_size

RULES = ("semi-implicit", "explicit", "forward")


def costate(model: ContinuousModel, Z: torch.Tensor, lam_end: torch.Tensor, rule: str) -> torch.Tensor:
    """λ(k) for k = ℓ, …, 1 by ``rule`` along the states Z [ℓ, s, n]: [ℓ, s, n] (the survey's (0.37))."""
    if rule not in RULES:
        raise InputError(f"rule {rule!r}: expected one of {', '.join(RULES)}")
    if Z.ndim != 3 or Z.shape[-1] != model.width or lam_end.shape != Z.shape[1:]:
        raise InputError(f"states {tuple(Z.shape)} and λ(ℓ) {tuple(lam_end.shape)}: "
                         f"expected [ℓ, s, {model.width}] and [s, {model.width}] (width mismatch)")
    depth = Z.shape[0]
    t, tau = grid(depth), step_size(depth, "grid")
    lams = [lam_end]
    for k in reversed(range(depth - 1)):
        lam = lams[-1]
        if rule == "semi-implicit":
            J = model.jacobian(float(t[k]), Z[k])
            lams.append(lam + tau * _vjp(J, lam))
        elif rule == "explicit":
            J = model.jacobian(float(t[k + 1]), Z[k + 1])
            lams.append(lam + tau * _vjp(J, lam))
        else:
            J = model.jacobian(float(t[k]), Z[k])
            eye = torch.eye(model.width, dtype=J.dtype)
            lams.append(torch.linalg.solve(eye - tau * J.transpose(1, 2), lam))
    return torch.stack(lams[::-1])


def _vjp(J: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Jᵀλ for each sample: J [s, n, n], λ [s, n]."""
    return torch.einsum("sij,si->sj", J, lam)


def costate_errors(model: ContinuousModel, Z: torch.Tensor, lam_end: torch.Tensor,
                   lam_adjoint: torch.Tensor) -> dict[str, list[float]]:
    """Per layer k, max over samples of ‖λ_rule(k) − λ_adjoint(k)‖ / ‖λ_adjoint(k)‖, each rule."""
    scale = lam_adjoint.norm(dim=-1).clamp_min(torch.finfo(lam_adjoint.dtype).tiny)
    return {rule: ((costate(model, Z, lam_end, rule) - lam_adjoint).norm(dim=-1) / scale).amax(dim=-1).tolist()
            for rule in RULES}
