"""The consensus experiment: looped transformer over random prompts, E(k) to CSV, JSON and PNG.

Output folder:
- `consensus.csv`: one row per layer-step: layer_step, pass, layer, E_mean, E_std, E_min, E_max;
- `summary.json`: configuration, seed, versions, E after the first and the last pass, the
  first layer-step where the mean E < 0.05 (null if never);
- `consensus.png`: the mean E(k) with a band of ± one standard deviation across prompts;
- `checkpoint.safetensors`: the token states after the last completed pass, so that an
  interrupted run continues from there (same command, same folder), and a finished run
  can be continued to more passes (same command with a larger --passes).
"""

from __future__ import annotations

import csv
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hybridlm.analysis.consensus import WEIGHTS, embed, first_below, looped, random_prompts
from hybridlm.figures import save_figure
from hybridlm.errors import InputError

THRESHOLD = 0.05
COLUMNS = ["layer_step", "pass", "layer", "E_mean", "E_std", "E_min", "E_max"]


@dataclass(frozen=True)
class ConsensusConfig:
    model: str
    weights: str = "pretrained"
    attention_only: bool = False
    prompts: int = 8
    prompt_len: int = 64
    passes: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise InputError(f"--weights {self.weights!r}: expected one of {WEIGHTS}")
        for name in ("prompts", "prompt_len", "passes"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)}: expected ≥ 1")


def prepare_model(cfg: ConsensusConfig, device: str):
    from hybridlm.analysis.consensus import reinit
    from hybridlm.weights.loading import load_model

    model = load_model(cfg.model, device=device)
    if cfg.prompt_len > model.config.n_ctx:
        raise InputError(f"--prompt-len {cfg.prompt_len} exceeds the model's horizon T={model.config.n_ctx}")
    if cfg.weights != "pretrained":
        reinit(model, cfg.seed)
    return model


def run_consensus(cfg: ConsensusConfig, out: str | Path, *, device: str = "cpu", progress: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(cfg, device)
    L = model.config.n_layer
    h, start_pass = _resume(cfg, out, device)
    if h is None:
        h = embed(model, random_prompts(model, cfg.prompts, cfg.prompt_len, cfg.seed))
        _write_rows(out, [], fresh=True)
    redraw = (lambda p: cfg.seed * 1_000_003 + p) if cfg.weights == "random-redrawn" else None
    bar = _bar(total=cfg.passes * L, done=(start_pass - 1) * L, enabled=progress)
    rows: list[dict] = []
    for step, h in looped(model, h, passes=cfg.passes, attention_only=cfg.attention_only,
                          redraw_seed=redraw, start_pass=start_pass):
        E = step.E.float()
        rows.append({"layer_step": step.k, "pass": step.pass_, "layer": step.layer,
                     "E_mean": E.mean().item(), "E_std": E.std(unbiased=False).item(),
                     "E_min": E.min().item(), "E_max": E.max().item()})
        if step.k:
            bar.update(1)
            bar.set_postfix(E=f"{rows[-1]['E_mean']:.4f}")
        if step.layer == L - 1:  # a pass is complete: persist it
            _write_rows(out, rows)
            rows = []
            _checkpoint(out, cfg, h, step.pass_)
    bar.close()
    summary = _summary(cfg, out, model, device)
    _plot(out, summary)
    return summary


# ---------------------------------------------------------------------- persistence
def _resume(cfg: ConsensusConfig, out: Path, device: str):
    from safetensors import safe_open

    ckpt = out / "checkpoint.safetensors"
    if not ckpt.exists():
        return None, 1
    with safe_open(str(ckpt), framework="pt") as f:
        meta = f.metadata()
        h = f.get_tensor("h").to(device)
    saved, done = json.loads(meta["config"]), int(meta["pass"])
    same = {k: v for k, v in saved.items() if k != "passes"} == {k: v for k, v in asdict(cfg).items() if k != "passes"}
    if not same or done > cfg.passes:
        raise InputError(f"{out} holds a run with another configuration ({meta['config']}, {done} passes done); "
                         "use another --out (a run may only be continued to more passes)")
    rows = [r for r in _read_rows(out) if int(r["pass"]) <= done]
    _write_rows(out, rows, fresh=True)
    return h, done + 1


def _checkpoint(out: Path, cfg: ConsensusConfig, h: torch.Tensor, done: int) -> None:
    from safetensors.torch import save_file

    tmp = out / "checkpoint.safetensors.tmp"
    save_file({"h": h.detach().cpu().contiguous()}, str(tmp), metadata={"config": json.dumps(asdict(cfg)), "pass": str(done)})
    tmp.replace(out / "checkpoint.safetensors")


def _read_rows(out: Path) -> list[dict]:
    path = out / "consensus.csv"
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _write_rows(out: Path, rows: list[dict], *, fresh: bool = False) -> None:
    path = out / "consensus.csv"
    with open(path, "w" if fresh else "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if fresh:
            writer.writeheader()
        writer.writerows(rows)


def _summary(cfg: ConsensusConfig, out: Path, model, device: str) -> dict:
    rows = _read_rows(out)
    E = [float(r["E_mean"]) for r in rows]
    L = model.config.n_layer
    below = first_below(E, THRESHOLD)
    summary = {
        "config": asdict(cfg),
        "model_source": model.source,
        "shape": {"L": L, "d": model.config.d_model, "N_h": model.config.n_head, "family": model.config.family},
        "layer_steps": len(E) - 1,
        "E_initial": E[0],
        "E_after_first_pass": E[L] if len(E) > L else None,
        "E_final": E[-1],
        "first_layer_step_below_0.05": int(rows[below]["layer_step"]) if below is not None else None,
        "device": device,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "hybridlm": _version()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridlm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _plot(out: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read_rows(out)
    k = [int(r["layer_step"]) for r in rows]
    mean = [float(r["E_mean"]) for r in rows]
    std = [float(r["E_std"]) for r in rows]
    cfg = summary["config"]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    ax.plot(k, mean, lw=1.4, label="mean over prompts")
    ax.fill_between(k, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25,
                    label="± 1 std")
    ax.axhline(THRESHOLD, color="grey", lw=0.8, ls="--", label=f"E = {THRESHOLD}")
    ax.set_xlabel("layer-step k")
    ax.set_ylabel("E(k)")
    ax.set_ylim(bottom=0)
    variant = "attention only" if cfg["attention_only"] else "full blocks"
    ax.set_title(f"{cfg['model']} · {cfg['weights']} · {variant} · {cfg['prompts']}×{cfg['prompt_len']} tokens"
                 f"\n{summary['model_source']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "consensus.png")


def _bar(total: int, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, unit="layer-step", desc="consensus")


def plot_compare(runs: dict[str, str | Path], out: str | Path, *, title: str = "") -> Path:
    """Mean E(k) of several consensus runs (label → output folder) on one axes, e.g. a
    transformer beside a selective SSM and a hybrid stack; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    for label, folder in runs.items():
        rows = _read_rows(Path(folder))
        if not rows:
            raise InputError(f"{folder} holds no consensus.csv: run `hybridlm consensus --out {folder}` first")
        ax.plot([int(r["layer_step"]) for r in rows], [float(r["E_mean"]) for r in rows], lw=1.3, label=label)
    ax.axhline(THRESHOLD, color="grey", lw=0.8, ls="--", label=f"E = {THRESHOLD}")
    ax.set_xlabel("layer-step k")
    ax.set_ylabel("mean E(k)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)
