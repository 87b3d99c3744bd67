"""State norms ‖c(k, i)‖ over positions i, one curve per block k (docs/theory.md §5.4, the survey's (S16)–(S17))."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridlm.figures import save_figure
from hybridlm.ssm.model import StackLM


@torch.no_grad()
def state_norms(model: StackLM, ids) -> dict[int, torch.Tensor]:
    """{block k: ‖c(k, i)‖ for i = 1..n, averaged over the batch} for every recurrent block."""
    names = [n for n in model.hook_points if n.endswith(("ssm.hook_state", "rnn.hook_state"))]
    _, cache = model.run_with_cache(ids, names=names)
    return {int(n.split(".")[1]): cache[n].flatten(2).norm(dim=-1).mean(0) for n in names}


def plot_state_norms(model: StackLM, ids, out: str | Path) -> Path:
    """Plot `state_norms` (matplotlib, Agg) to a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    norms = state_norms(model, ids)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    for k, v in norms.items():
        ax.plot(range(1, len(v) + 1), v.float().cpu().numpy(), lw=1.2,
                label=f"block {k} ({model.config.layers[k]})")
    ax.set_xlabel("position i")
    ax.set_ylabel("‖c(k, i)‖")
    ax.set_title(f"{model.source} · layers {model.config.layers}", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, out)
