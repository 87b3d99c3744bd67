"""Writing figures: one place where a matplotlib figure becomes a file."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: str | Path, *, dpi: int | None = None) -> Path:
    """Write `fig` to `path` (creating its folder) and release it from pyplot; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    if getattr(fig.canvas, "manager", None) is not None:  # made by pyplot, which keeps it until closed
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path
