"""The survey's optimal-control claims as runs: each writes a JSON summary and a PNG into a folder.

Used by ``hybridlm survey …``. The autograd gradients here are the independent reference
for the explicit adjoint; the adjoint module itself never calls autograd.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from hybridlm.errors import InputError
from hybridlm.optimal import adjoint as adj
from hybridlm.optimal import memorise as mem
from hybridlm.optimal import neural_ode as node
from hybridlm.optimal import plots
from hybridlm.optimal.costate import costate_errors
from hybridlm.optimal.resnet_ode import euler_study, random_model


def autograd_gradients(net: adj.Network, x: torch.Tensor, y: torch.Tensor) -> adj.Gradients:
    """∂L/∂W(k) (and ∂L/∂w(k), ∂L/∂b(k)) by torch.autograd through the plain recursions."""
    W = net.W.detach().clone().requires_grad_()
    w = net.w.detach().clone().requires_grad_() if net.w is not None else None
    b = net.b.detach().clone().requires_grad_() if net.b is not None else None
    sigma = adj.activation(net.act).sigma
    z = x
    for k in range(net.depth - 1):
        v = z @ W[k].T + (b[k] if b is not None else 0.0)
        z = z + w[k] * sigma(v) if w is not None else sigma(v)
    adj.loss(z, y).backward()
    assert W.grad is not None  # every W(k) enters the loss
    return adj.Gradients(W.grad, w.grad if w is not None else None, b.grad if b is not None else None)


def gradient_error_per_layer(net: adj.Network, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """‖∂J/∂W(k)_adjoint − ∂L/∂W(k)_autograd‖ / ‖∂L/∂W(k)_autograd‖ for k = 1, …, ℓ−1."""
    _, g, _, _ = adj.backprop(net, x, y)
    ref = autograd_gradients(net, x, y)
    return ((g.W - ref.W).flatten(1).norm(dim=1) / ref.W.flatten(1).norm(dim=1)).tolist()


# the survey's experiments are small: sizes beyond these only exhaust memory, after minutes
MAX_DEPTH, MAX_WIDTH, MAX_SAMPLES, MAX_STEPS = 4096, 1024, 100_000, 1_000_000


def _check_depth(name: str, depth: int, least: int = 2) -> None:
    if not least <= depth <= MAX_DEPTH:
        raise InputError(f"{name} = {depth}: expected a depth ℓ ≥ {least} (and ≤ {MAX_DEPTH})")


def _check_sizes(*, width: int = 1, samples: int = 1, steps: int = 0) -> None:
    for name, value, low, high in (("width", width, 1, MAX_WIDTH), ("samples", samples, 1, MAX_SAMPLES),
                                   ("steps", steps, 0, MAX_STEPS)):
        if not low <= value <= high:
            raise InputError(f"{name} = {value}: expected {low} ≤ {name} ≤ {high:,}")


def _write(out: str | Path, stem: str, summary: dict, plot) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / f"{stem}.png")
    summary["files"] = [str(out / f"{stem}.json"), str(out / f"{stem}.png")]
    return summary


def run_adjoint(out, *, depth: int = 8, width: int = 6, samples: int = 16, steps: int = 300,
                lr: float = 0.5, seed: int = 0) -> dict:
    """Adjoint vs autograd per layer; costate rules vs adjoint per layer; training by (0.32)."""
    _check_depth("--depth", depth)
    _check_sizes(width=width, samples=samples, steps=steps)
    if not (math.isfinite(lr) and lr > 0):
        raise InputError(f"steps = {steps}, learning rate η = {lr}: expected steps ≥ 0 and a finite η > 0")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, width, generator=g, dtype=torch.float64)
    y = 0.5 * torch.randn(samples, width, generator=g, dtype=torch.float64)
    summary: dict = {"depth": depth, "width": width, "samples": samples, "gradient_error_per_layer": {},
                     "training": {}}
    for kind, residual in (("feedforward (0.24)", False), ("resnet (0.18)", True)):
        net = adj.random_network(depth, width, residual=residual, seed=seed + 1, scale=1.5)
        summary["gradient_error_per_layer"][kind] = gradient_error_per_layer(net, x, y)
        teacher = adj.random_network(depth, width, residual=residual, seed=seed + 2, scale=1.5)
        target = adj.forward(teacher, x).Z[-1]
        history = adj.train(net, x, target, steps=steps, lr=lr)
        summary["training"][kind] = {"loss_before": history[0], "loss_after": history[-1], "steps": steps, "lr": lr}
    model = random_model(width, seed=seed + 3)
    traj = adj.forward(model.resnet(depth), x)
    lam_end = adj.terminal_costate(traj.Z[-1], y)
    lam = adj.adjoint(model.resnet(depth), traj, lam_end)
    summary["costate_depth"] = depth
    summary["costate_error_per_layer"] = costate_errors(model, traj.Z, lam_end, lam)
    summary["max_gradient_error"] = max(max(v) for v in summary["gradient_error_per_layer"].values())
    summary["max_costate_error"] = {r: max(v) for r, v in summary["costate_error_per_layer"].items()}
    return _write(out, "adjoint", summary, plots.plot_adjoint)


def run_euler(out, *, depths=(8, 16, 32, 64, 128), width: int = 4, samples: int = 8, seed: int = 0,
              kind: str = "affine") -> dict:
    """Error (0.21) vs depth for the ResNet and the second-order schemes; log-log slopes."""
    for d in depths:
        _check_depth("depth", int(d))
    _check_sizes(width=width, samples=samples)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, width, generator=g, dtype=torch.float64)
    model = random_model(width, seed=seed, kind=kind)
    summary = {"width": width, "samples": samples, "kind": kind, **euler_study(model, x, depths)}
    return _write(out, "euler", summary, plots.plot_euler)


def run_memorise(out, *, depths=(2, 4, 8, 16, 32), samples: int = 12, steps: int = 300, lr: float = 0.05,
                 seed: int = 0) -> dict:
    """One control for all samples: memorisation error vs depth, width 2·max(n_in, n_out)+1."""
    for d in depths:
        _check_depth("depth", int(d))
    _check_sizes(samples=samples, steps=steps)
    x, y = mem.sample_task(samples, seed=seed)
    runs = mem.error_vs_depth(x, y, depths, steps=steps, lr=lr, seed=seed)
    summary = {"samples": samples, "steps": steps, "lr": lr, "n_in": x.shape[1], "n_out": y.shape[1], "runs": runs}
    return _write(out, "memorise", summary, plots.plot_memorise)


def run_neural_ode(out, *, steps: int = 150, samples: int = 64, lr: float = 0.02, seed: int = 0) -> dict:
    """Neural ODE on the spiral's time-1 map, adjoint gradients; adjoint vs autograd check."""
    _check_sizes(samples=samples, steps=steps)
    x, y = node.spiral_task(samples, seed=seed)
    result = node.train(x, y, steps=steps, lr=lr, seed=seed)
    check = node.adjoint_vs_autograd(node.Field(seed=seed + 1), x, y, tol=1e-8)
    summary = {"samples": samples, "steps": steps, "lr": lr, "history": result["history"],
               "loss_before": result["history"][0], "loss_after": result["history"][-1],
               "adjoint_vs_autograd": check}
    return _write(out, "neural_ode", summary, plots.plot_neural_ode)
