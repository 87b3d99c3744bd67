"""Figures for learning as optimal control (the survey's (0.18)–(0.37)), on matplotlib's Agg canvas.

Each function takes the JSON-able summary of a run (see :mod:`hybridlm.optimal.runs`) and
writes one PNG; no pyplot state or display backend is touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridlm.figures import save_figure


def _figure(ncols: int, width: float = 5.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 4.2))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.09 if ncols > 1 else 0.12, right=0.97, bottom=0.13, top=0.88, wspace=0.3)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _floor(values) -> np.ndarray:
    """Exact zeros cannot sit on a log axis: lift them to 1e-18."""
    return np.maximum(np.asarray(values, dtype=float), 1e-18)


def _depth_ticks(ax, depths) -> None:
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(list(depths), [str(d) for d in depths])


def _save(fig, path: str | Path) -> Path:
    return save_figure(fig, path, dpi=110)


def plot_adjoint(summary: dict, path: str | Path) -> Path:
    """Left: per-layer relative error, explicit adjoint gradient vs autograd (0.31), (0.34).
    Right: per-layer costate error of each discretisation of (0.37) against the adjoint (0.33)."""
    fig, (ax1, ax2) = _figure(2)
    for name, errs in summary["gradient_error_per_layer"].items():
        ax1.semilogy(range(1, len(errs) + 1), _floor(errs), "o-", label=name)
    ax1.set_xlabel("layer k (gradient of W(k))")
    ax1.set_ylabel("‖∂J/∂W(k) − autograd‖ / ‖autograd‖")
    ax1.set_title("explicit adjoint vs autograd", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    for rule, errs in summary["costate_error_per_layer"].items():
        ax2.semilogy(range(1, len(errs)), _floor(errs[:-1]), ".-", label=rule)
    ax2.set_xlabel("layer k (λ(ℓ) is shared by all rules)")
    ax2.set_ylabel("‖λ_rule(k) − λ_adjoint(k)‖ / ‖λ_adjoint(k)‖")
    ax2.set_title(f"costate (0.37) vs discrete adjoint (0.33), ℓ = {summary['costate_depth']}", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_euler(summary: dict, path: str | Path) -> Path:
    """Error at t = 1 against DOP853 vs depth ℓ, log-log, one line per scheme with its slope."""
    fig, (ax,) = _figure(1, width=7.0)
    d = np.asarray(summary["depths"], dtype=float)
    for name, errs in summary["errors"].items():
        ax.loglog(d, _floor(errs), "o-", label=f"{name}: slope {summary['slopes'][name]:+.2f}")
    ax.loglog(d, summary["errors"][next(iter(summary["errors"]))][0] * d[0] / d, "k:", lw=1, label="ℓ⁻¹")
    _depth_ticks(ax, summary["depths"])
    ax.set_xlabel("depth ℓ")
    ax.set_ylabel("‖z(ℓ) − z_c(1)‖ (max over samples)")
    ax.set_title("ResNets as discretisations of ż = w(t)Σ(W(t)z) (0.20)–(0.21)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def plot_memorise(summary: dict, path: str | Path) -> Path:
    """Left: memorisation error on the samples vs depth. Right: training loss per depth."""
    fig, (ax1, ax2) = _figure(2)
    rows = summary["runs"]
    d = [r["depth"] for r in rows]
    ax1.loglog(d, _floor([r["max_error"] for r in rows]), "o-", label="max_i ‖h(z_i(ℓ)) − y_i‖")
    ax1.loglog(d, _floor([r["rms_error"] for r in rows]), "s--", label="rms")
    _depth_ticks(ax1, d)
    ax1.set_xlabel("depth ℓ")
    ax1.set_ylabel("error on the samples")
    ax1.set_title(f"memorisation, width n = {rows[0]['width']}, {summary['steps']} steps", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    for r in rows:
        ax2.semilogy(_floor(r["history"]), lw=1, label=f"ℓ = {r['depth']}")
    ax2.set_xlabel("training step")
    ax2.set_ylabel("loss")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_neural_ode(summary: dict, path: str | Path) -> Path:
    """Training loss of the Neural ODE (adjoint gradients)."""
    fig, (ax,) = _figure(1, width=6.0)
    ax.semilogy(_floor(summary["history"]), "k-")
    ax.set_xlabel("Adam step")
    ax.set_ylabel("mean squared error")
    ax.set_title(f"Neural ODE, adjoint vs autograd gradient: {summary['adjoint_vs_autograd']:.1e}", fontsize=10)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)
