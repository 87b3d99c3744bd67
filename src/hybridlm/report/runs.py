"""What the report draws of the analysis runs: `consensus` folders and `survey` folders.

Both become chart specifications for the page's one generic chart (series of (x, y)
points, optional bands, vertical and horizontal marks, linear or log axes), built from
the files the runs write: `consensus.csv` and `summary.json` (hybridlm.analysis.runner),
and the `<stem>.json` summaries of hybridlm.optimal.runs. A survey JSON of a kind this
module does not know still gets a chart of every list of numbers it holds.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from hybridlm.analysis.folder import COLUMNS, THRESHOLD
from hybridlm.errors import InputError

SURVEY_STEMS = ("adjoint", "euler", "memorise", "neural_ode")


# ---------------------------------------------------------------------- detection
def detect(path: str | os.PathLike) -> str:
    """'arc' (a trace file), 'consensus' or 'survey' (a run folder, or a folder of such runs)."""
    p = Path(path)
    if p.is_file():
        return "arc"
    if p.exists() and not p.is_dir():
        raise InputError(f"{p}: not a regular file (a device, FIFO or socket); expected a trace file or a run folder")
    if not p.is_dir():
        raise InputError(f"{p}: no such file or folder")
    if consensus_cases(p):
        return "consensus"
    if survey_files(p):
        return "survey"
    raise InputError(f"{p}: expected an agent trace (JSONL), a consensus run folder (consensus.csv) "
                     f"or a survey run folder ({', '.join(s + '.json' for s in SURVEY_STEMS)})")


def consensus_cases(folder: Path) -> list[Path]:
    """The consensus runs in a folder: itself, or each subfolder holding a consensus.csv."""
    if (folder / "consensus.csv").is_file():
        return [folder]
    return sorted(d for d in folder.iterdir() if d.is_dir() and (d / "consensus.csv").is_file())


def survey_files(folder: Path) -> list[Path]:
    """The survey summaries in a folder or its subfolders (one level down)."""
    found = [f for s in SURVEY_STEMS for f in [folder / f"{s}.json"] if f.is_file()]
    if found:
        return found
    return sorted(f for d in folder.iterdir() if d.is_dir() for s in SURVEY_STEMS for f in [d / f"{s}.json"] if f.is_file())


# ---------------------------------------------------------------------- consensus
@dataclass
class _Case:
    """One consensus run as read back: its name, its table's columns and its summary."""

    name: str
    rows: dict[str, list[float]]  # consensus.csv, column by column
    summary: dict  # summary.json ({} where the run has none)


def consensus_view(folder: str | os.PathLike) -> dict:
    """E(k) of every case against the layer-step, ± one standard deviation, pass boundaries marked."""
    folder = Path(folder)
    cases: list[_Case] = []
    for d in consensus_cases(folder):
        rows = _read_csv(d / "consensus.csv")
        summary = _read_json(d / "summary.json") if (d / "summary.json").is_file() else {}
        name = d.name if d != folder else (summary.get("config", {}).get("model") or d.name)
        cases.append(_Case(name, rows, summary))
    if not cases:
        raise InputError(f"{folder}: no consensus.csv here or in its subfolders")
    series, vlines = [], []
    for case in cases:
        r = case.rows
        series.append({"name": case.name, "x": r["layer_step"], "y": r["E_mean"],
                       "lo": [m - s for m, s in zip(r["E_mean"], r["E_std"])],
                       "hi": [m + s for m, s in zip(r["E_mean"], r["E_std"])],
                       "labels": [f"pass {p}, layer {layer}; E std {s:.4g}, min {lo:.4g}, max {hi:.4g}"
                                  for p, layer, s, lo, hi in zip(r["pass"], r["layer"], r["E_std"], r["E_min"], r["E_max"])],
                       "marks": len(r["layer_step"]) <= 400})
        for k, p, p_next in zip(r["layer_step"], r["pass"], r["pass"][1:]):
            if p_next != p and p > 0:
                vlines.append({"x": k, "label": f"pass {int(p)}", "case": case.name})
    # one boundary line per layer-step, even where several cases share it
    vlines = list({v["x"]: v for v in vlines}.values())
    chart = {"id": "consensus-chart", "title": "consensus E(k) against layer-step k (mean over prompts, band ± 1 std)",
             "xlabel": "layer-step k", "ylabel": "E(k)", "ymin0": True, "logToggle": True, "series": series,
             "vlines": vlines, "hlines": [{"y": THRESHOLD, "label": f"E = {THRESHOLD}"}]}
    table = [{"case": c.name, **_case_row(c.summary)} for c in cases]
    return {"kind": "consensus", "title": f"consensus · {folder.name}", "charts": [chart], "tables": [
        {"title": "cases", "rows": table}]}


def _case_row(summary: dict) -> dict:
    cfg = summary.get("config", {})
    keys = ("weights", "attention_only", "prompts", "prompt_len", "passes", "seed")
    return {"model": summary.get("model_source", cfg.get("model")), **{k: cfg.get(k) for k in keys},
            "L": summary.get("shape", {}).get("L"), "E initial": summary.get("E_initial"),
            "E after pass 1": summary.get("E_after_first_pass"), "E final": summary.get("E_final"),
            "first k with E < 0.05": summary.get("first_layer_step_below_0.05")}


def _read_csv(path: Path) -> dict[str, list[float]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path}: not a consensus table (missing columns {missing})")
        rows = list(reader)
    whole = ("layer_step", "pass", "layer")
    try:
        return {c: [int(r[c]) if c in whole else float(r[c]) for r in rows] for c in COLUMNS}
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: a value that is not a number ({exc})") from None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read it as JSON ({exc})") from None


# ---------------------------------------------------------------------- survey
def survey_view(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    files = survey_files(folder)
    if not files:
        raise InputError(f"{folder}: no survey summary ({', '.join(s + '.json' for s in SURVEY_STEMS)})")
    runs = []
    for f in files:
        summary = _read_json(f)
        name = f.stem if f.parent == folder else f"{f.parent.name}/{f.stem}"
        try:
            charts = SURVEY_CHARTS.get(f.stem, _generic_charts)(summary)
        except (KeyError, TypeError, IndexError, AttributeError):  # an older or newer layout: every list of numbers
            charts = _generic_charts(summary)
        for i, c in enumerate(charts):
            c["id"] = f"{name.replace('/', '-')}-{i}"
        runs.append({"name": name, "charts": charts, "scalars": _scalars(summary)})
    return {"kind": "survey", "title": f"survey · {folder.name}", "runs": runs}


def _lines(named: dict, x=None, *, start: int = 1) -> list[dict]:
    return [{"name": name, "x": list(x) if x is not None else list(range(start, start + len(ys))), "y": ys,
             "marks": True} for name, ys in named.items()]


def _adjoint(s: dict) -> list[dict]:
    costate = {rule: errs[:-1] for rule, errs in s["costate_error_per_layer"].items()}  # λ(ℓ) is shared by all rules
    return [
        {"title": "explicit adjoint vs autograd, per layer (0.31), (0.34)", "xlabel": "layer k (gradient of W(k))",
         "ylabel": "‖∂J/∂W(k) − autograd‖ / ‖autograd‖", "ylog": True, "series": _lines(s["gradient_error_per_layer"])},
        {"title": f"costate (0.37) vs discrete adjoint (0.33), ℓ = {s.get('costate_depth')}", "xlabel": "layer k",
         "ylabel": "‖λ_rule(k) − λ_adjoint(k)‖ / ‖λ_adjoint(k)‖", "ylog": True, "series": _lines(costate)},
    ]


def _euler(s: dict) -> list[dict]:
    series = _lines(s["errors"], s["depths"])
    for line in series:
        line["name"] += f" (slope {s['slopes'][line['name']]:+.2f})"
    return [{"title": "ResNets as discretisations of ż = w(t)Σ(W(t)z) (0.20)–(0.21): error at t = 1 against depth",
             "xlabel": "depth ℓ", "ylabel": "‖z(ℓ) − z_c(1)‖ (max over samples)", "xlog": True, "ylog": True,
             "series": series}]


def _memorise(s: dict) -> list[dict]:
    runs = s["runs"]
    depth = [r["depth"] for r in runs]
    return [
        {"title": f"memorisation error against depth, {s.get('steps')} steps", "xlabel": "depth ℓ",
         "ylabel": "error on the samples", "xlog": True, "ylog": True,
         "series": _lines({"max_i ‖h(z_i(ℓ)) − y_i‖": [r["max_error"] for r in runs],
                           "rms": [r["rms_error"] for r in runs]}, depth)},
        {"title": "training loss per depth", "xlabel": "training step", "ylabel": "loss", "ylog": True,
         "series": [{**line, "marks": False} for line in
                    _lines({f"ℓ = {r['depth']} (n = {r['width']})": r["history"] for r in runs}, start=0)]},
    ]


def _neural_ode(s: dict) -> list[dict]:
    return [{"title": f"Neural ODE training loss (adjoint vs autograd gradient: {s.get('adjoint_vs_autograd', 0):.1e})",
             "xlabel": "Adam step", "ylabel": "mean squared error", "ylog": True,
             "series": [{**line, "marks": False} for line in _lines({"loss": s["history"]}, start=0)]}]


def _generic_charts(summary) -> list[dict]:
    """One chart per list of numbers (or group of such lists under one key) anywhere in the JSON."""
    groups: dict[str, dict[str, list]] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            lists = {k: v for k, v in value.items() if _numbers(v)}
            if lists:
                groups[path or "values"] = lists
            for k, v in value.items():
                if k not in lists:
                    walk(v, f"{path}.{k}" if path else k)
        elif isinstance(value, list) and not _numbers(value):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(summary, "")
    return [{"title": path, "xlabel": "index", "ylabel": "value", "series": _lines(lists, start=0)}
            for path, lists in groups.items()]


def _numbers(v) -> bool:
    return (isinstance(v, list) and len(v) >= 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v))


def _scalars(summary, prefix: str = "") -> dict:
    """Every scalar of a summary by its dotted path (the numbers printed beside the charts)."""
    out = {}
    if isinstance(summary, dict):
        for k, v in summary.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (dict, list)):
                out.update(_scalars(v, path) if isinstance(v, dict) else {})
            elif v is None or isinstance(v, (str, int, float, bool)):
                out[path] = v if not (isinstance(v, float) and not math.isfinite(v)) else str(v)
    return out


SURVEY_CHARTS = {"adjoint": _adjoint, "euler": _euler, "memorise": _memorise, "neural_ode": _neural_ode}
