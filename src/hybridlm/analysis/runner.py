"""The consensus experiment: looped transformer over random prompts, E(k) to CSV, JSON and PNG.

Output folder:
- `consensus.csv`: one row per layer-step: layer_step, pass, layer, E_mean, E_std, E_min, E_max;
- `summary.json`: configuration, seed, versions, E after the first and the last pass, the
  first layer-step where the mean E < 0.05 (null if never);
- `consensus.png`: the mean E(k) with a band of ± one standard deviation across prompts;
- `checkpoint.safetensors`: the token states after the last completed pass, so that an
  interrupted run continues from there (same command, same folder), and a finished run
  can be continued to more passes (same command with a larger --passes).

The prompts are independent of each other: prompt i depends on (seed, i, prompt_len) only,
and E of a prompt depends on that prompt only. So a run splits into shards of prompts
(`consensus_shard`), which `merge_rows` joins into the rows the whole run writes; this is
how `hybridlm.distributed` spreads a run over a cluster without changing a digit.
"""

from __future__ import annotations

import csv
import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridlm.analysis.consensus import WEIGHTS, embed, first_below, looped, random_prompts
from hybridlm.analysis.folder import CHECKPOINT, COLUMNS, THRESHOLD
from hybridlm.figures import save_figure
from hybridlm.errors import InputError


@dataclass(frozen=True)
class ConsensusConfig:
    model: str
    weights: str = "pretrained"
    attention_only: bool = False
    prompts: int = 8
    prompt_len: int = 64
    passes: int = 20
    seed: int = 0
    block: str = "pre-norm"  # or "sphere": the post-norm sphere block (hybridlm.lm.sphere_block)

    def __post_init__(self) -> None:
        from hybridlm.lm.sphere_block import BLOCKS

        if self.weights not in WEIGHTS:
            raise InputError(f"--weights {self.weights!r}: expected one of {WEIGHTS}")
        if self.block not in BLOCKS:
            raise InputError(f"--block {self.block!r}: expected one of {', '.join(BLOCKS)}")
        for name in ("prompts", "prompt_len", "passes"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)}: expected ≥ 1")

    def same_run(self, other: dict) -> bool:
        """Whether a saved configuration (a dict) is this run, up to the number of passes."""
        mine = {k: v for k, v in asdict(self).items() if k != "passes"}
        other = {"block": "pre-norm", **other}  # (a run saved before blocks were selectable)
        return {k: v for k, v in other.items() if k != "passes"} == mine


def prepare_model(cfg: ConsensusConfig, device: str):
    """The run's model: loaded, and re-drawn at random when the weights are not pretrained."""
    from hybridlm.analysis.consensus import reinit
    from hybridlm.lm.sphere_block import select_block
    from hybridlm.weights.loading import drawn_from_seed, load_model

    # random:<preset> / random-<family>:<size>: the loader draws them from the seed (once, not twice)
    drawn = cfg.weights != "pretrained" and drawn_from_seed(cfg.model)
    model = load_model(cfg.model, device=device, seed=cfg.seed if drawn else 0)
    check_horizon(model, cfg)
    if cfg.weights != "pretrained" and not drawn:
        reinit(model, cfg.seed)
    return select_block(model, cfg.block)


def check_horizon(model, cfg: ConsensusConfig) -> None:
    if cfg.prompt_len > model.config.n_ctx:
        raise InputError(f"--prompt-len {cfg.prompt_len} exceeds the model's horizon T={model.config.n_ctx}")


def prompt_ids(model, cfg: ConsensusConfig, start: int, stop: int) -> torch.Tensor:
    """Prompts start..stop-1 of the run. The generator's stream is drawn row after row, so
    prompt i is the same whatever the number of prompts drawn with it: a shard draws the
    rows up to its last prompt and keeps its own."""
    return random_prompts(model, stop, cfg.prompt_len, cfg.seed)[start:stop]


def model_info(model) -> dict:
    """What the summary says of the model (the worker that loaded it sends this along)."""
    c = model.config
    return {"model_source": model.source, "shape": {"L": c.n_layer, "d": c.d_model, "N_h": c.n_head, "family": c.family}}


def layer_steps(model, cfg: ConsensusConfig, h: torch.Tensor, start_pass: int = 1):
    """The run's loop from `start_pass` on: (LayerStep, h) after every block (see `looped`)."""
    redraw = (lambda p: cfg.seed * 1_000_003 + p) if cfg.weights == "random-redrawn" else None
    return looped(model, h, passes=cfg.passes, attention_only=cfg.attention_only, redraw_seed=redraw,
                  start_pass=start_pass)


def consensus_row(k: int, pass_: int, layer: int, E: torch.Tensor) -> dict:
    """One CSV row: the statistics of E over the prompts after layer-step k. E is brought to
    the CPU in float32 first, so that a whole batch and the joined shards of it reduce alike."""
    E = E.detach().float().cpu().contiguous()
    return {"layer_step": k, "pass": pass_, "layer": layer, "E_mean": E.mean().item(),
            "E_std": E.std(unbiased=False).item(), "E_min": E.min().item(), "E_max": E.max().item()}


# ---------------------------------------------------------------------- a local run
def run_consensus(cfg: ConsensusConfig, out: str | Path, *, device: str = "cpu", progress: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(cfg, device)
    info = model_info(model)
    L = model.config.n_layer
    h, start_pass = _resume(cfg, out, device)
    if h is None:
        h = embed(model, prompt_ids(model, cfg, 0, cfg.prompts))
        write_rows(out, [], fresh=True)
    bar = _bar(total=cfg.passes * L, done=(start_pass - 1) * L, enabled=progress)
    rows: list[dict] = []
    for step, h in layer_steps(model, cfg, h, start_pass):  # noqa: B020 - h: the state carried to the checkpoint
        rows.append(consensus_row(step.k, step.pass_, step.layer, step.E))
        if step.k:
            bar.update(1)
            bar.set_postfix(E=f"{rows[-1]['E_mean']:.4f}")
        if step.layer == L - 1:  # a pass is complete: persist it
            write_rows(out, rows)
            rows = []
            save_checkpoint(out, cfg, h, step.pass_, info)
    bar.close()
    return finish(cfg, out, info, device)


def finish(cfg: ConsensusConfig, out: Path, info: dict, device: str) -> dict:
    """summary.json and consensus.png from the folder's CSV."""
    summary = write_summary(cfg, out, info, device)
    plot_run(out, summary)
    return summary


# ---------------------------------------------------------------------- shards of prompts
@dataclass
class ShardResult:
    """E of prompts start..stop-1 after each layer-step of a stretch of passes, and the states
    after the last one (to continue the run later)."""

    start: int
    stop: int
    steps: list[tuple[int, int, int]]  # (layer_step, pass, layer) of each row of E
    E: torch.Tensor  # [steps, stop - start], float32 on the CPU
    h: torch.Tensor  # [stop - start, n, d] after the last pass, on the CPU
    info: dict  # model_info of the model that ran it
    ran: dict = field(default_factory=dict)  # where and how long it ran (filled in by whoever ran it)


def consensus_shard(cfg: ConsensusConfig, model, start: int, stop: int, *, h: torch.Tensor | None = None,
                    start_pass: int = 1) -> ShardResult:
    """Prompts start..stop-1 of the run through passes start_pass..cfg.passes: from their
    embedding (h None, start_pass 1) or from the saved states h of pass start_pass - 1."""
    check_horizon(model, cfg)
    if h is None:
        if start_pass != 1:
            raise ValueError("a shard after pass 1 needs the states it continues from")
        h = embed(model, prompt_ids(model, cfg, start, stop))
    else:
        h = h.to(model.W_e.device, model.W_e.dtype)
    steps: list[tuple[int, int, int]] = []
    rows: list[torch.Tensor] = []
    for step, h in layer_steps(model, cfg, h, start_pass):  # noqa: B007, B020 - h: the last state, returned
        steps.append((step.k, step.pass_, step.layer))
        rows.append(step.E.detach().float().cpu())
    E = torch.stack(rows) if rows else torch.empty(0, stop - start)
    return ShardResult(start, stop, steps, E, h.detach().cpu(), model_info(model))


def merge_rows(results: list[ShardResult]) -> list[dict]:
    """The CSV rows of the prompts of all shards (given in prompt order, covering them once)."""
    steps = results[0].steps
    if any(r.steps != steps for r in results):
        raise ValueError("shards of one run cover different layer-steps")
    E = torch.cat([r.E for r in results], dim=1)
    return [consensus_row(k, p, layer, E[j]) for j, (k, p, layer) in enumerate(steps)]


# ---------------------------------------------------------------------- persistence
def _resume(cfg: ConsensusConfig, out: Path, device: str):
    saved = load_checkpoint(cfg, out)
    if saved is None:
        return None, 1
    h, done = saved
    write_rows(out, [r for r in read_rows(out) if int(r["pass"]) <= done], fresh=True)
    return h.to(device), done + 1


def load_checkpoint(cfg: ConsensusConfig, out: Path) -> tuple[torch.Tensor, int] | None:
    """(states, passes done) of the run saved in `out`, None if none is; another run there is an error."""
    from safetensors import safe_open

    ckpt = out / CHECKPOINT
    if not ckpt.exists():
        return None
    with safe_open(str(ckpt), framework="pt") as f:
        meta = f.metadata()
        h = f.get_tensor("h")
    done = int(meta["pass"])
    if not cfg.same_run(json.loads(meta["config"])) or done > cfg.passes:
        raise InputError(f"{out} holds a run with another configuration ({meta['config']}, {done} passes done); "
                         "use another --out (a run may only be continued to more passes)")
    return h, done


def save_checkpoint(out: Path, cfg: ConsensusConfig, h: torch.Tensor, done: int, info: dict) -> None:
    from safetensors.torch import save_file

    tmp = out / (CHECKPOINT + ".tmp")
    save_file({"h": h.detach().cpu().contiguous()}, str(tmp),
              metadata={"config": json.dumps(asdict(cfg)), "pass": str(done), "model": json.dumps(info)})
    tmp.replace(out / CHECKPOINT)


def checkpoint_info(out: Path) -> dict | None:
    """The model_info saved with the checkpoint (None for a checkpoint without it)."""
    from safetensors import safe_open

    with safe_open(str(out / CHECKPOINT), framework="pt") as f:
        info = f.metadata().get("model")
    return json.loads(info) if info else None


def read_rows(out: Path) -> list[dict]:
    path = out / "consensus.csv"
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write_rows(out: Path, rows: list[dict], *, fresh: bool = False) -> None:
    path = out / "consensus.csv"
    with open(path, "w" if fresh else "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if fresh:
            writer.writeheader()
        writer.writerows(rows)


def write_summary(cfg: ConsensusConfig, out: Path, info: dict, device: str) -> dict:
    rows = read_rows(out)
    E = [float(r["E_mean"]) for r in rows]
    L = info["shape"]["L"]
    below = first_below(E, THRESHOLD)
    summary = {
        "config": asdict(cfg),
        "model_source": info["model_source"],
        "shape": info["shape"],
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


def plot_run(out: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(out)
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


def plot_compare(runs: dict[str, str | Path], out: str | Path, *, title: str = "", data: bool = False) -> Path:
    """Mean E(k) of several consensus runs (label → output folder) on one axes, e.g. a
    transformer beside a selective SSM and a hybrid stack; returns the PNG's path. With `data`,
    the curves also go to a CSV beside it (layer_step, then one column of mean E per run, empty
    past the last pass a run finished)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    curves: dict[str, dict[int, str]] = {}
    for label, folder in runs.items():
        rows = read_rows(Path(folder))
        if not rows:
            raise InputError(f"{folder} holds no consensus.csv: run `hybridlm consensus --out {folder}` first")
        curves[label] = {int(r["layer_step"]): r["E_mean"] for r in rows}
        ax.plot(list(curves[label]), [float(e) for e in curves[label].values()], lw=1.3, label=label)
    if data:
        with open(Path(out).with_suffix(".csv"), "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["layer_step", *curves])
            for k in sorted(set().union(*curves.values())):
                writer.writerow([k, *(curve.get(k, "") for curve in curves.values())])
    ax.axhline(THRESHOLD, color="grey", lw=0.8, ls="--", label=f"E = {THRESHOLD}")
    ax.set_xlabel("layer-step k")
    ax.set_ylabel("mean E(k)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)
