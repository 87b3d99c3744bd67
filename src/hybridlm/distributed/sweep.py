"""`hybridlm sweep SPEC.yaml`: a grid of consensus runs, at the survey's size or a small one.

The spec (YAML):

    kind: consensus              # the kind of run (consensus is the one there is)
    shard_prompts: 25            # prompts per shard (a Ray task); numbers do not depend on it
    base: {prompts: 100, prompt_len: 200, seed: 0}   # every run starts from these
    figures: {6: "caption", ...} # optional captions of the figures the runs belong to
    grid:                        # each entry is the product of its lists, over `base`
      - {figure: 8, model: "random:gpt2-xl", weights: [random-fixed], attention_only: [false, true], passes: 42}
    scales:                      # named variants: a value replaces the field, a mapping
      small:                     #   {old: new} replaces the values it names
        prompts: 8
        model: {"random:gpt2-xl": "random:gpt2"}

A run's fields are those of `ConsensusConfig`: model, weights, attention_only, prompts,
prompt_len, passes, seed. Runs that come out equal (e.g. two models mapped to one at a
small scale) are run once and drawn in every figure they belong to.

Output: runs/<name>/ holds each run exactly as `hybridlm consensus --out` writes it;
figures/figure-<id>.png draws the mean E(k) of a figure's runs on one axes; sweep.json
lists the runs, where they ran and how long the sweep took.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridlm.analysis.runner import ConsensusConfig, plot_compare, run_consensus
from hybridlm.distributed.consensus import ShardedConsensus, run_many
from hybridlm.errors import InputError
from hybridlm.files import read_text

FIELDS = {"model": str, "weights": str, "attention_only": bool, "prompts": int, "prompt_len": int, "passes": int,
          "seed": int, "block": str}
TOP = ("kind", "shard_prompts", "base", "figures", "grid", "scales")
DEFAULT_SCALE = "survey"


@dataclass
class SweepRun:
    config: ConsensusConfig
    name: str  # the folder under runs/
    figures: list[str] = field(default_factory=list)


@dataclass
class Sweep:
    source: str
    scale: str
    shard_prompts: int
    runs: list[SweepRun]
    captions: dict[str, str]

    def figures(self) -> dict[str, list[SweepRun]]:
        out: dict[str, list[SweepRun]] = {}
        for run in self.runs:
            for fig in run.figures:
                out.setdefault(fig, []).append(run)
        return out


MAX_SPEC_BYTES = 2**20  # a spec is a page of YAML


def load_sweep(path: str | Path, scale: str = DEFAULT_SCALE) -> Sweep:
    """Read and check a spec, and expand it at `scale`: every mistake is found here, before
    any model is loaded."""
    import yaml

    path = Path(path)
    text = read_text(path, "sweep spec", max_bytes=MAX_SPEC_BYTES)
    try:
        spec = yaml.safe_load(text)
    except RecursionError:
        raise InputError(f"sweep spec {path}: nested too deeply to read") from None
    except yaml.YAMLError as exc:
        raise InputError(f"sweep spec {path}: not YAML ({str(exc).splitlines()[0]})") from None
    where = str(path)
    if not isinstance(spec, dict):
        raise InputError(f"{where}: expected a mapping with keys {', '.join(TOP)}")
    _known(spec, TOP, where)
    if spec.get("kind", "consensus") != "consensus":
        raise InputError(f"{where}: kind {spec['kind']!r}: expected consensus")
    scales = spec.get("scales") or {}
    if not isinstance(scales, dict):
        raise InputError(f"{where}: scales: expected a mapping of scale names to overrides")
    if scale != DEFAULT_SCALE and scale not in scales:
        raise InputError(f"--scale {scale!r}: {where} defines {', '.join([DEFAULT_SCALE, *map(str, scales)])}")
    overrides = dict(scales.get(scale) or {})
    if not isinstance(overrides, dict):
        raise InputError(f"{where}: scales.{scale}: expected a mapping of fields to values")
    _known(overrides, (*FIELDS, "shard_prompts"), f"{where}: scales.{scale}")
    shard_prompts = overrides.pop("shard_prompts", spec.get("shard_prompts", 8))
    if isinstance(shard_prompts, bool) or not isinstance(shard_prompts, int) or shard_prompts < 1:
        raise InputError(f"{where}: shard_prompts = {shard_prompts!r}: expected an integer ≥ 1")
    base = spec.get("base") or {}
    if not isinstance(base, dict):
        raise InputError(f"{where}: base: expected a mapping of fields to values")
    _known(base, FIELDS, f"{where}: base")
    grid = spec.get("grid")
    if not isinstance(grid, list) or not grid:
        raise InputError(f"{where}: grid: expected a list of entries (mappings of fields to values or lists)")
    captions = {str(k): str(v) for k, v in (spec.get("figures") or {}).items()}

    runs: dict[str, SweepRun] = {}
    for i, entry in enumerate(grid):
        at = f"{where}: grid[{i}]"
        if not isinstance(entry, dict):
            raise InputError(f"{at}: expected a mapping of fields to values or lists")
        _known(entry, (*FIELDS, "figure"), at)
        figures = entry.get("figure", [])
        figures = [str(f) for f in (figures if isinstance(figures, list) else [figures])]
        axes = {k: v if isinstance(v, list) else [v] for k, v in {**base, **entry}.items() if k != "figure"}
        for values in itertools.product(*axes.values()):
            fields = _override(dict(zip(axes, values)), overrides, f"{where}: scales.{scale}")
            cfg = _config(fields, at)
            name = run_name(cfg)
            run = runs.setdefault(name, SweepRun(cfg, name))
            run.figures += [f for f in figures if f not in run.figures]
    return Sweep(where, scale, shard_prompts, list(runs.values()), captions)


def _known(mapping: dict, allowed, where: str) -> None:
    for key in mapping:
        if key not in allowed:
            raise InputError(f"{where}: unknown key {key!r}; expected some of {', '.join(map(str, allowed))}")


def _override(fields: dict, overrides: dict, where: str) -> dict:
    out = dict(fields)
    for key, new in overrides.items():
        if isinstance(new, dict):
            if key in out and out[key] in new:
                out[key] = new[out[key]]
        else:
            out[key] = new
    return out


def _config(fields: dict, where: str) -> ConsensusConfig:
    if "model" not in fields:
        raise InputError(f"{where}: no model (give it in the entry or in base)")
    for key, value in fields.items():
        kind = FIELDS[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InputError(f"{where}: {key} = {value!r}: expected {'true or false' if kind is bool else kind.__name__}")
    try:
        return ConsensusConfig(**fields)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def run_name(cfg: ConsensusConfig) -> str:
    """The run's folder name: every field of its configuration, readable."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.model).strip("_")
    if "/" in cfg.model or "\\" in cfg.model:  # a path: its last part and a digest of the whole
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(cfg.model).name) + "-" + hashlib.sha1(cfg.model.encode()).hexdigest()[:8]
    variant = "attn" if cfg.attention_only else "full"
    block = "" if cfg.block == "pre-norm" else f"__{cfg.block}"
    return f"{model}__{cfg.weights}__{variant}{block}__{cfg.prompts}x{cfg.prompt_len}__{cfg.passes}p__seed{cfg.seed}"


def run_sweep(sweep: Sweep, out: str | Path, pool, *, on_run=None, on_shard=None) -> dict:
    """Every run of the sweep on `pool`, then the figures and sweep.json; returns sweep.json.

    In this process each run is a local run (checkpointed after every pass); on Ray, the
    shards of all runs go to the cluster at once and each run is written as its last shard
    arrives. Either way a restart skips what is finished. `on_run(run, summary, done, total)`
    and, on Ray, `on_shard(...)` of `run_many` report progress.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    folder = {run.name: out / "runs" / run.name for run in sweep.runs}
    t0 = time.perf_counter()
    done: dict[str, dict] = {}
    shards: dict[str, list[dict]] = {}

    def finished(run: SweepRun, summary: dict) -> None:
        done[run.name] = summary
        if on_run is not None:
            on_run(run, summary, len(done), len(sweep.runs))

    if pool.kind == "local":
        for run in sweep.runs:
            finished(run, run_consensus(run.config, folder[run.name], device=pool.device, progress=False))
    else:
        plans = [ShardedConsensus(run.config, folder[run.name], shard_prompts=sweep.shard_prompts, device=pool.device)
                 for run in sweep.runs]
        by_plan = {id(plan): run for plan, run in zip(plans, sweep.runs)}

        def plan_finished(plan: ShardedConsensus, summary: dict) -> None:
            shards[by_plan[id(plan)].name] = plan.shards()
            finished(by_plan[id(plan)], summary)

        run_many(plans, pool, on_finish=plan_finished, on_shard=on_shard)
    wall_s = time.perf_counter() - t0
    figures = {}
    for fig, runs in sweep.figures().items():
        labels = _labels(runs)
        title = f"{sweep.captions.get(fig, f'figure {fig}')} · scale {sweep.scale}"
        figures[fig] = str(plot_compare({labels[r.name]: folder[r.name] for r in runs},
                                        out / "figures" / f"figure-{fig}.png", title=title).relative_to(out))
    record = {
        "spec": sweep.source, "scale": sweep.scale, "shard_prompts": sweep.shard_prompts, "pool": pool.describe(),
        "wall_s": round(wall_s, 3),
        "runs": [{"name": r.name, "folder": str(folder[r.name].relative_to(out)), "figures": r.figures,
                  "config": asdict(r.config), "E_final": done[r.name]["E_final"],
                  "first_layer_step_below_0.05": done[r.name]["first_layer_step_below_0.05"],
                  **({"shards": shards[r.name]} if r.name in shards else {})} for r in sweep.runs],
        "figures": figures,
    }
    (out / "sweep.json").write_text(json.dumps(record, indent=2))
    return record


def _labels(runs: list[SweepRun]) -> dict[str, str]:
    """Each run's label in a figure: its model and the fields that differ between the figure's runs."""
    varying = [k for k in FIELDS if k != "model" and len({getattr(r.config, k) for r in runs}) > 1]
    show: dict[str, Callable[[object], str]] = {
        "attention_only": lambda v: "attention only" if v else "full model", "seed": lambda v: f"seed {v}",
        "prompts": lambda v: f"{v} prompts", "prompt_len": lambda v: f"{v} tokens", "passes": lambda v: f"{v} passes",
        "weights": str, "block": lambda v: f"{v} block",
    }
    return {r.name: " · ".join([r.config.model, *(show[k](getattr(r.config, k)) for k in varying)]) for r in runs}
