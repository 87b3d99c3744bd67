"""The MLP question, by experiment: with the MLP, what makes E of the looped model (the survey's (0.45))
reach 0 or plateau — the horizon, the normalisation (pre-norm as trained vs the post-norm sphere block
(0.39)–(0.40)), the initialisation scale σ or the model's size?

Random GPT-2-shaped models, weights fixed across passes (the survey's Fig. 8 setting), full blocks; every
combination of size, σ and block is looped over the same horizon, so one run also answers "longer?".

    python -m hybridlm.analysis.mlp_question --out runs/mlp-question --horizon 240    # CSV, PNG, a Markdown table
"""

from __future__ import annotations

import argparse
import csv
import itertools
from pathlib import Path

from hybridlm.analysis.consensus import first_below
from hybridlm.analysis.folder import THRESHOLD
from hybridlm.analysis.runner import ConsensusConfig, consensus_shard
from hybridlm.figures import save_figure

#: name → (blocks L, width d, heads): two small GPT-2-like shapes, 8× apart in parameters per block ×
#: blocks (sized for a shared CPU; the survey's sizes are the Fig. 8 sweep's)
SIZES = {"mini (L=2, d=128)": (2, 128, 2), "tiny (L=4, d=256)": (4, 256, 4)}
SCALES = (0.02, 0.2)  # GPT-2's σ and ten times it
BLOCKS = ("pre-norm", "sphere")


def one_run(size: str, sigma: float, block: str, *, passes: int, prompts: int, prompt_len: int, seed: int) -> list[float]:
    """Mean E over the prompts after every layer-step (k = 0 … passes·L) of one configuration: the
    consensus experiment's own loop (`analysis.runner`), on a model drawn at this size and σ."""
    from hybridlm.lm.config import preset
    from hybridlm.lm.sphere_block import select_block
    from hybridlm.weights.loading import load_model

    L, d, H = SIZES[size]
    shape = preset("gpt2").replace(n_layer=L, d_model=d, n_head=H, n_kv_head=H, init_std=sigma)
    model = select_block(load_model(shape, seed=seed), block)
    run = ConsensusConfig(model=f"{size}, σ={sigma:g}", weights="random-fixed", prompts=prompts,
                          prompt_len=prompt_len, passes=passes, seed=seed, block=block)
    return consensus_shard(run, model, 0, prompts).E.mean(dim=1).tolist()


def run(out: Path, *, horizon: int, prompts: int, prompt_len: int, seed: int = 0) -> list[dict]:
    """Every (size, σ, block) over `horizon` layer-steps (whole passes, at least): mlp-question.csv (one row per
    run and layer-step; not a consensus.csv, whose columns `analysis.runner` reads), mlp-question.png and the
    summary rows (E after pass 1, at k ≈ horizon/4 and at the end, first k with E < 0.05)."""
    out.mkdir(parents=True, exist_ok=True)
    curves, rows = {}, []
    for size, sigma, block in itertools.product(SIZES, SCALES, BLOCKS):
        L = SIZES[size][0]
        E = one_run(size, sigma, block, passes=-(-horizon // L), prompts=prompts, prompt_len=prompt_len, seed=seed)
        name = f"{size}, σ={sigma:g}, {block}"
        curves[name] = E
        below = first_below(E, THRESHOLD)
        rows.append({"size": size, "sigma": sigma, "block": block, "E_pass1": E[L], "E_quarter": E[len(E) // 4],
                     "E_end": E[-1], "layer_steps": len(E) - 1, "first_k_below_0.05": below})
        print(_row(rows[-1]), flush=True)
    with open(out / "mlp-question.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "layer_step", "E_mean"])
        for name, E in curves.items():
            w.writerows([name, k, f"{e:.6g}"] for k, e in enumerate(E))
    _plot(curves, out / "mlp-question.png")
    return rows


def _row(r: dict) -> str:
    below = r["first_k_below_0.05"]
    return (f"| {r['size']} | {r['sigma']:g} | {r['block']} | {r['E_pass1']:.3f} | {r['E_quarter']:.3f} | "
            f"{r['E_end']:.4f} (k={r['layer_steps']}) | {below if below is not None else 'never'} |")


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
    for name, E in curves.items():
        ax.plot(range(len(E)), E, lw=1.1, ls="-" if "pre-norm" in name else "--", label=name)
    ax.axhline(THRESHOLD, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("layer-step k")
    ax.set_ylabel("mean E(k), full blocks")
    ax.set_ylim(bottom=0)
    ax.set_title("The MLP question: random fixed weights, size × init scale σ × block", fontsize=9)
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--horizon", type=int, default=240, help="layer-steps (rounded up to whole passes)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    a = p.parse_args(argv)
    print("| size | σ | block | E after pass 1 | E at k/4 | E at the end | first k with E < 0.05 |")
    print("|---|---|---|---|---|---|---|")
    run(a.out, horizon=a.horizon, prompts=a.prompts, prompt_len=a.prompt_len)


if __name__ == "__main__":
    main()
