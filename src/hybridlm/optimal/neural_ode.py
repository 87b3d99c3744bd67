"""A Neural ODE trained with torchdiffeq's adjoint solver (docs/theory.md §5.2, the survey's "Neural ODEs").

The network *is* the right-hand side: ż = f_θ(z) = W₂ Σ(W₁ z + b₁) on t ∈ [0, 1], and the
model's output is the solution at t = 1. Gradients come from torchdiffeq's ``odeint_adjoint``,
which integrates the costate (0.37) backwards alongside the state instead of differentiating
through the solver's steps. The tiny task: learn the time-1 map of the damped rotation
ż = A z in the plane from point pairs (x_i, e^A x_i).
"""

from __future__ import annotations

import math

import torch

from hybridlm.errors import InputError

SPIRAL = ((-0.1, -2.0), (2.0, -0.1))


class Field(torch.nn.Module):
    """f_θ(t, z) = W₂ tanh(W₁ z + b₁), autonomous."""

    def __init__(self, dim: int = 2, hidden: int = 16, *, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        if dim < 1 or hidden < 1:
            raise InputError(f"dim = {dim}, hidden = {hidden}: expected both ≥ 1")
        g = torch.Generator().manual_seed(seed)
        self.W1 = torch.nn.Parameter(torch.randn(hidden, dim, generator=g, dtype=dtype) / math.sqrt(dim))
        self.b1 = torch.nn.Parameter(0.1 * torch.randn(hidden, generator=g, dtype=dtype))
        self.W2 = torch.nn.Parameter(torch.randn(dim, hidden, generator=g, dtype=dtype) / math.sqrt(hidden))

    def forward(self, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(z @ self.W1.T + self.b1) @ self.W2.T


def spiral_task(s: int = 64, *, seed: int = 0, dtype: torch.dtype = torch.float64):
    """s points uniform in [−1, 1]² and their images under the time-1 flow e^A of ż = Az."""
    from scipy.linalg import expm

    if s < 1:
        raise InputError(f"s = {s} samples: expected s ≥ 1")
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(s, 2, generator=g, dtype=dtype) - 1
    flow = torch.from_numpy(expm(torch.tensor(SPIRAL).numpy())).to(dtype)
    return x, x @ flow.T


def solve(field: Field, x: torch.Tensor, *, adjoint: bool = True, method: str = "rk4",
          step: float = 0.2, rtol: float = 1e-7, atol: float = 1e-9) -> torch.Tensor:
    """z(1) from z(0) = x; ``adjoint`` selects torchdiffeq's adjoint backward pass."""
    from torchdiffeq import odeint, odeint_adjoint

    t = torch.tensor([0.0, 1.0], dtype=x.dtype)
    options = {"step_size": step} if method in ("rk4", "euler", "midpoint") else None
    solver = odeint_adjoint if adjoint else odeint
    kw = {"adjoint_params": tuple(field.parameters())} if adjoint else {}
    return solver(field, x, t, method=method, options=options, rtol=rtol, atol=atol, **kw)[-1]


def train(x: torch.Tensor, y: torch.Tensor, *, steps: int = 150, lr: float = 0.02, hidden: int = 16,
          seed: int = 0) -> dict:
    """Adam on the mean squared error, gradients from the adjoint solver; the loss history."""
    if steps < 1 or not (math.isfinite(lr) and lr > 0):
        raise InputError(f"steps = {steps}, lr = {lr}: expected steps ≥ 1 and a finite lr > 0")
    if x.shape != y.shape or x.ndim != 2:
        raise InputError(f"x {tuple(x.shape)} and y {tuple(y.shape)}: expected two [s, dim] tensors")
    field = Field(x.shape[1], hidden, seed=seed, dtype=x.dtype)
    opt = torch.optim.Adam(field.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        L = (solve(field, x) - y).pow(2).mean()
        L.backward()
        opt.step()
        history.append(float(L.detach()))
    with torch.no_grad():
        history.append(float((solve(field, x) - y).pow(2).mean()))
    return {"history": history, "field": field}


def adjoint_vs_autograd(field: Field, x: torch.Tensor, y: torch.Tensor, *, tol: float = 1e-10) -> float:
    """Relative difference of the adjoint gradient and autograd through DOP5 at tolerance ``tol``."""
    grads = []
    for adjoint in (True, False):
        field.zero_grad()
        (solve(field, x, adjoint=adjoint, method="dopri5", rtol=tol, atol=tol) - y).pow(2).mean().backward()
        flat = []
        for p in field.parameters():
            assert p.grad is not None  # every parameter of the field enters the solution
            flat.append(p.grad.reshape(-1))
        grads.append(torch.cat(flat))
    return float((grads[0] - grads[1]).norm() / grads[1].norm())
