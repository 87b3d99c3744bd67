"""Figures for the sphere model (the survey's (0.43)–(0.45)), drawn with matplotlib's Agg canvas.

Figures are built with `matplotlib.figure.Figure` and saved through the Agg canvas, so no
pyplot state or display backend is touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridlm.analysis.sphere import SphereTrajectory, consensus_E
from hybridlm.figures import save_figure


def plot_sphere_trajectory(
    traj: SphereTrajectory, path: str | Path, *, title: str | None = None, dpi: int = 110
) -> Path:
    """Save a PNG: E(t) of (0.45) on a log scale, and the token paths on S² when d = 3.

    For d ≠ 3 the right panel shows each token's own error 1 − cos(z_1, z_i) instead.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n, d = traj.z.shape[1:]
    fig = Figure(figsize=(11, 4.8))
    fig.subplots_adjust(left=0.08, right=0.97, bottom=0.11, top=0.87, wspace=0.22)  # fixed: fast
    FigureCanvasAgg(fig)
    colors = _colors(n)

    ax = fig.add_subplot(1, 2, 1)
    E = traj.E
    ax.semilogy(traj.t, np.maximum(E, 1e-300), color="k", lw=1.8)
    ax.set_xlabel("t")
    ax.set_ylabel("E = 1 − (1/n) Σ cos(z₁, zᵢ)")
    ax.set_ylim(max(E.min(), 1e-16) / 3, max(E.max(), 1e-15) * 3)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(f"consensus error (0.45); drift max|‖zᵢ‖−1| = {traj.drift:.1e}", fontsize=10)

    if d == 3:
        ax3 = fig.add_subplot(1, 2, 2, projection="3d", computed_zorder=False)  # draw order wins
        _sphere_wireframe(ax3)
        for i in [*range(1, n), 0]:  # token 1 last, on top
            p = traj.z[:, i]
            ax3.plot(p[:, 0], p[:, 1], p[:, 2], color=colors[i], lw=1.6)
            ax3.scatter(*p[0], color=colors[i], marker="o", s=22, depthshade=False)
            ax3.scatter(*p[-1], color=colors[i], marker="*", s=90, edgecolor="k", lw=0.5, depthshade=False)
        ax3.scatter([], [], color="gray", marker="o", label="start")
        ax3.scatter([], [], color="gray", marker="*", s=90, label="end")
        ax3.plot([], [], color=colors[0], label="token 1")
        ax3.legend(loc="upper left", fontsize=8)
        ax3.set_box_aspect((1, 1, 1))
        for axis in (ax3.xaxis, ax3.yaxis, ax3.zaxis):
            axis.set_ticks([-1, 0, 1])
        ax3.set_xlim(-1, 1), ax3.set_ylim(-1, 1), ax3.set_zlim(-1, 1)
        ax3.set_title(f"{n} tokens on S², {'causal' if traj.causal else 'full'} attention", fontsize=10)
    else:
        ax2 = fig.add_subplot(1, 2, 2)
        pairs = np.stack([np.broadcast_to(traj.z[:, :1], traj.z.shape), traj.z], axis=-2)  # [m, n, 2, d]
        per_token = 2 * consensus_E(pairs)  # 1 − cos(z₁, zᵢ): [m, n]
        for i in range(1, n):
            ax2.semilogy(traj.t, np.maximum(per_token[:, i], 1e-300), color=colors[i], lw=1.2)
        ax2.set_ylim(1e-16, 3)
        ax2.set_xlabel("t")
        ax2.set_ylabel("1 − cos(z₁, zᵢ)")
        ax2.grid(True, alpha=0.3)
        ax2.set_title(f"{n} tokens on S^{d - 1}, per token", fontsize=10)

    if title:
        fig.suptitle(title)
    return save_figure(fig, path, dpi=dpi)


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return ["crimson"] + [cmap(x) for x in np.linspace(0.0, 0.9, max(n - 1, 1))][: n - 1]


def _sphere_wireframe(ax) -> None:
    u, v = np.meshgrid(np.linspace(0, 2 * np.pi, 37), np.linspace(0, np.pi, 19))
    ax.plot_wireframe(np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v), color="0.8", lw=0.4)
