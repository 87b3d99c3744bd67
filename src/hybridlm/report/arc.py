"""What the report draws of one hybrid arc, computed from its trace events (and states).

`arc_view(events, states)` reads the events of `hybridlm.engine.trace` in file order and
returns plain, JSON-able data: the phases as intervals over both clocks (token step t and
wall time), the tokens, the jumps, the control actions, the engine's `batch` and `context`
events, a plant's trajectory (`plant` events), and, when the final-layer states were
saved, their norm per token step and a 2-D projection. Events and fields it does not know
are kept and listed, never dropped and never an error: traces written by later versions
(or by other engines) still give a report.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np

from hybridlm.engine.arc import HybridArc, format_rates, token_logprobs
from hybridlm.errors import InputError

# The fields each known event is drawn from; any other field is listed as unknown.
COMMON = {"event", "t", "k", "wall_s"}
KNOWN_FIELDS = {
    "start": {"task", "model", "kernel", "limits", "tool_choice", "constrain", "tools", "seed", "control", "layers",
              "plant", "horizon_s"},
    "phase": {"phase", "mode", "tokens"},
    "token": {"token", "text", "phase", "p", "prob", "logprob", "kernel_logprob", "model_logprob", "entropy"},
    "control": {"controller", "removed_mass", "removed_tokens", "shift", "no_safe_token", "action"},
    "jump": {"tool", "arguments", "observation", "error", "duration_s"},
    "end": {"answer", "stop_reason", "token_steps", "jumps", "wall_generate_s", "wall_external_s"},
    "batch": set(),  # drawn as marks; every field is shown with them
    "context": set(),
    "plant": {"plant", "name", "plant_t", "plant_time", "time", "state", "x", "u", "kind", "commanded", "applied",
              "h", "direction", "barrier"},
}
PLANT_TIME = ("plant_t", "plant_time", "time")
EXAMPLES = 3  # raw lines shown per unknown event kind


def _finite(value) -> float | None:
    """A finite float from a field that may be missing or of another type (None where it is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _num(value, default: float = 0.0) -> float:
    """A finite float from a field that may be missing or of another type (`default` where it is not one)."""
    number = _finite(value)
    return default if number is None else number


def _clean(value):
    """JSON-able with no NaN or infinity (the page's JSON must parse in a browser)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def arc_view(events: list[dict], states=None) -> dict:
    """The data of an arc report: see the module docstring. `states` is an array [token steps, d]."""
    if not isinstance(events, list) or not all(isinstance(e, dict) and "event" in e for e in events):
        raise InputError("an arc report needs a list of trace events (dicts with an 'event' field)")
    start = next((e for e in events if e["event"] == "start"), None)
    end = next((e for e in reversed(events) if e["event"] == "end"), None)
    problems = []
    if start is None:
        problems.append("the trace has no start event: task, model and limits are unknown")
    if end is None:
        problems.append("the trace has no end event: the run did not finish (stopped or killed)")
    view = {
        "kind": "arc",
        "start": start,
        "end": end,
        "phases": _phases(events),
        "tokens": _tokens(events),
        "jumps": [_jump(e) for e in events if e["event"] == "jump"],
        "controls": [{**_strip(e), "t": _num(e.get("t")), "k": _num(e.get("k"))} for e in events if e["event"] == "control"],
        "controllers": (start or {}).get("control") or [],
        "wall_curve": _wall_curve(events),
        "marks": [{"event": e["event"], "t": _num(e.get("t")), "k": _num(e.get("k")), "wall_s": _num(e.get("wall_s")),
                   "fields": _strip(e)} for e in events if e["event"] in ("batch", "context")],
        "plant": _plant(events, start),
        "rates": _rates(events),
        "states": _states(states, sum(e["event"] == "token" for e in events)),
        "unknown": _unknown(events),
        "extra_fields": _extra_fields(events),
        "problems": problems,
    }
    return _clean(view)


def _rates(events: list[dict]) -> str | None:
    """The arc's rates table as text (`HybridArc.rates`), or None where the events' clocks are not numbers."""
    try:
        return format_rates(HybridArc.from_events(events).rates())
    except (TypeError, ValueError, OverflowError):
        return None


def _strip(e: dict) -> dict:
    return {k: v for k, v in e.items() if k != "event"}


def _phases(events: list[dict]) -> list[dict]:
    """Each phase event opens an interval that the next phase event (or the last event) closes."""
    out: list[dict] = []
    for e in events:
        if e["event"] == "phase":
            if out:
                out[-1].update(t1=_num(e.get("t")), wall1=_num(e.get("wall_s")))
            out.append({"phase": str(e.get("phase", "?")), "mode": e.get("mode"), "k": _num(e.get("k")),
                        "t0": _num(e.get("t")), "wall0": _num(e.get("wall_s")), "tokens": e.get("tokens"), "steps": 0})
        elif e["event"] == "token" and out:
            out[-1]["steps"] += 1
    if out:
        last = events[-1]
        out[-1].update(t1=max(_num(last.get("t")), out[-1]["t0"]), wall1=max(_num(last.get("wall_s")), out[-1]["wall0"]))
    return out


def _tokens(events: list[dict]) -> dict[str, list | None]:
    """The token steps as columns; the probability of the sampled token under the model at τ = 1 (`p`) and under
    the kernel that drew it (`kernel_p`), and the entropy, when recorded."""
    cols: dict[str, list] = {"t": [], "k": [], "wall": [], "phase": [], "text": [], "id": [], "p": [], "kernel_p": [],
                             "entropy": [], "extra": []}
    phase = "decode"
    for e in events:
        if e["event"] == "phase":
            phase = str(e.get("phase", phase))
        if e["event"] != "token":
            continue
        cols["t"].append(_num(e.get("t")))
        cols["k"].append(_num(e.get("k")))
        cols["wall"].append(_num(e.get("wall_s")))
        cols["phase"].append(str(e.get("phase") or phase))
        text = e.get("text")
        cols["text"].append(text if isinstance(text, str) else "" if text is None else json.dumps(text, default=str))
        cols["id"].append(e.get("token"))
        model, kernel = (_exp(v) for v in token_logprobs(e))
        cols["p"].append(next((e[f] for f in ("p", "prob") if isinstance(e.get(f), (int, float))), model))
        cols["kernel_p"].append(kernel)
        cols["entropy"].append(e.get("entropy") if isinstance(e.get("entropy"), (int, float)) else None)
        extra = {k: v for k, v in e.items() if k not in COMMON | KNOWN_FIELDS["token"]}
        cols["extra"].append(extra or None)
    optional = ("p", "kernel_p", "entropy", "extra")  # None where no token step recorded them
    return {name: None if name in optional and all(v is None for v in col) else col for name, col in cols.items()}


def _exp(logp) -> float | None:
    """p from a recorded log p (None where it is missing or not a finite number)."""
    if isinstance(logp, bool) or not isinstance(logp, (int, float)) or not math.isfinite(logp):
        return None
    return math.exp(min(logp, 0.0))


def _jump(e: dict) -> dict:
    out = {k: e.get(k) for k in ("tool", "arguments", "observation", "error")}
    out.update({k: _num(e.get(k)) for k in ("t", "k", "wall_s", "duration_s")})
    out["extra"] = {k: v for k, v in e.items() if k not in COMMON | KNOWN_FIELDS["jump"]} or None
    return out


def _wall_curve(events: list[dict]) -> list[list]:
    """(t, wall_s, phase in effect after the event) for every event that carries both clocks."""
    out, phase = [], None
    for e in events:
        if e["event"] == "phase":
            phase = str(e.get("phase", "?"))
        if isinstance(e.get("t"), (int, float)) and isinstance(e.get("wall_s"), (int, float)):
            out.append([_num(e["t"]), _num(e["wall_s"]), phase])
    return out


def _plant(events: list[dict], start: dict | None) -> dict | None:
    """A plant's trajectory: state components against plant time, the input as held steps, the jump times, and,
    when the safe set is known, its band on each state and the time in it.

    A `plant` event carries the plant time (`plant_t` or `plant_time`; wall time when absent), the state
    `state` (a list, a {name: value} object, or a number) and what it knows of the input: a command (`kind`
    "command", `commanded` the command held from then on, `applied` what reached the plant through a safety
    filter) or a sample's `u`. Several plants are told apart by `plant` (or `name`). The start event's `plant`
    description (`Plant.describe()`) gives the units, the bands, the actuators' names and the command held
    before the first one. A jump's plant time is its own `plant_t` when it has one, else its wall time
    mapped through the plant events' (wall_s, plant time) pairs.
    """
    rows = [e for e in events if e["event"] == "plant"]
    if not rows:
        return None
    described = (start or {}).get("plant")
    described = described if isinstance(described, dict) else {}
    by_name: dict[str, list[dict]] = {}
    for e in rows:
        by_name.setdefault(str(e.get("plant") or e.get("name") or "plant"), []).append(e)
    jumps = [e for e in events if e["event"] == "jump"]
    horizon = (start or {}).get("horizon_s")
    plants = []
    for name, rs in by_name.items():
        time = [_num(next((e[f] for f in PLANT_TIME if isinstance(e.get(f), (int, float))), e.get("wall_s")))
                for e in rs]
        wall = [_num(e.get("wall_s")) for e in rs]
        state = [_components(e.get("state", e.get("x")), "x") for e in rs]
        end = max(time + ([_num(horizon)] if isinstance(horizon, (int, float)) else []))
        plants.append({
            "name": name, "time": time, "state": _series(state),
            "units": _mapping(described.get("units")), "bands": _mapping(described.get("bands")),
            **_inputs(rs, time, described, end),
            "safe": _safe_time(rs, time, end),
            "jumps": [{"k": e.get("k"), "tool": e.get("tool"),
                       "time": _num(e["plant_t"]) if isinstance(e.get("plant_t"), (int, float))
                       else float(np.interp(_num(e.get("wall_s")), wall, time))} for e in jumps],
        })
    return {"plants": plants}


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _inputs(rows: list[dict], time: list[float], described: dict, end: float) -> dict:
    """The input u as held steps (zero-order hold: each value holds until the next, the last until `end`):
    the commands when the trace records commands, each event's `u` otherwise; and, where a safety filter
    changed a command, what it applied."""
    names = described.get("actuators")
    names = names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None

    def parts(value) -> dict:  # a vector's components by the actuators' names when the description has them
        if names and isinstance(value, (list, tuple)) and len(value) == len(names):
            value = dict(zip(names, value))
        return _components(value, "u")

    commands = [(t, e) for t, e in zip(time, rows) if e.get("kind") == "command" and e.get("commanded") is not None]
    if commands:
        first = [(min(time), parts(described["commanded"]))] if described.get("commanded") is not None else []
        held = first + [(t, parts(e["commanded"])) for t, e in commands]
        corrected = [(t, parts(e.get("applied"))) for t, e in commands
                     if e.get("corrected", e.get("applied") != e["commanded"])]
    else:
        held = [(t, parts(e["u"])) for t, e in zip(time, rows) if e.get("u") is not None]
        corrected = []
    held = [(t, v) for t, v in held if v]
    return {"held": {"time": [t for t, _ in held], "u": _series([v for _, v in held]), "until": end},
            "applied": {"time": [t for t, _ in corrected], "u": _series([v for _, v in corrected])}}


def _safe_time(rows: list[dict], time: list[float], end: float) -> dict | None:
    """Time inside the safe set and the violations, from the located crossings of its boundary (`kind`
    "crossing", `direction` leave/enter) and the barrier values `h` of the first event that has them: a
    violation runs from a leave to the enter that brings every barrier back to h ≥ 0 (or to `end`)."""
    first = next(((t, e["h"]) for t, e in zip(time, rows) if isinstance(e.get("h"), dict)), None)
    crossings = sorted((t, e["direction"]) for t, e in zip(time, rows)
                       if e.get("kind") == "crossing" and e.get("direction") in ("leave", "enter"))
    if first is None and not crossings:
        return None
    t0 = first[0] if first is not None else min(time)
    outside = sum(1 for h in first[1].values() if isinstance(h, (int, float)) and h < 0) if first else 0
    violations: list[dict] = []  # each: start, end, and whether a crossing began it (not the initial state)
    if outside:
        violations.append({"start": t0, "end": None, "left": False})
    for t, direction in crossings:
        if not t0 <= t <= end:
            continue
        was = outside
        outside = outside + 1 if direction == "leave" else max(outside - 1, 0)
        if outside and not was:
            violations.append({"start": t, "end": None, "left": True})
        elif was and not outside:
            violations[-1]["end"] = t
    for v in violations:
        v["end"] = end if v["end"] is None else v["end"]
        v["duration_s"] = v["end"] - v["start"]
    span = max(end - t0, 0.0)
    in_band = span - sum(v["duration_s"] for v in violations)
    return {"from": t0, "to": end, "in_band_s": in_band, "fraction": in_band / span if span else None,
            "violations": violations, "left": sum(v["left"] for v in violations)}


def _series(rows: list[dict]) -> dict[str, list]:
    """Per-event {component: value} rows as one column per component (None where an event lacks it)."""
    names = list(dict.fromkeys(c for r in rows for c in r))
    return {c: [r.get(c) for r in rows] for c in names}


def _components(value, base: str) -> dict[str, float | None]:
    """A vector's components by name: an object's keys, or base[i] for a list, base for a number."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {f"{base}[{i}]": _finite(v) for i, v in enumerate(value)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {base: _finite(value)}
    return {}


def _unknown(events: list[dict]) -> list[dict]:
    counts = Counter(e["event"] for e in events if e["event"] not in KNOWN_FIELDS)
    return [{"event": name, "count": n,
             "examples": [json.dumps(e, ensure_ascii=False, default=str) for e in events if e["event"] == name][:EXAMPLES]}
            for name, n in counts.items()]


def _extra_fields(events: list[dict]) -> list[dict]:
    """Fields of known events that the report does not draw (shown in tooltips and listed)."""
    counts = Counter((e["event"], f) for e in events if e["event"] in KNOWN_FIELDS and KNOWN_FIELDS[e["event"]]
                     for f in e if f not in COMMON | KNOWN_FIELDS[e["event"]])
    return [{"event": ev, "field": f, "count": n} for (ev, f), n in counts.items()]


# ---------------------------------------------------------------------- states
def load_states(path: str | os.PathLike) -> tuple[np.ndarray, dict]:
    """The final-layer states [token steps, d] saved beside a trace, and the file's metadata."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
            if not keys:
                raise InputError(f"{path}: a states file with no tensor")
            key = "resid_final" if "resid_final" in keys else keys[0]
            states, meta = f.get_tensor(key), dict(f.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc})") from None
    if states.ndim != 2:
        raise InputError(f"{path}: states of shape {tuple(states.shape)}, expected [token steps, d]")
    meta["tensor"] = key
    return states, meta


def states_beside(trace: str | os.PathLike) -> Path | None:
    """The states file the agent writes beside a trace (`--states`), when there is one."""
    path = Path(trace).with_suffix(".safetensors")
    return path if path.is_file() else None


def pca_2d(states: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Coordinates on the two leading principal axes, and the share of variance of each.

    The sign of each axis is fixed so that its largest loading is positive, which makes
    the picture the same from run to run.
    """
    X = np.asarray(states, dtype=np.float64)
    X = X - X.mean(axis=0)
    if X.shape[0] < 2:
        return np.zeros((X.shape[0], 2)), [0.0, 0.0]
    _, s, vt = np.linalg.svd(X, full_matrices=False)
    axes = vt[:2]
    axes = axes * np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(axis=1)])[:, None]
    coords = X @ axes.T
    total = float((s**2).sum())
    share = [float(v) / total if total > 0 else 0.0 for v in (s[:2] ** 2)]
    if coords.shape[1] < 2:  # d = 1
        coords = np.hstack([coords, np.zeros((coords.shape[0], 1))])
        share.append(0.0)
    return coords, share


def _states(states, token_steps: int) -> dict | None:
    if states is None:
        return None
    X = np.asarray(states, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] == 0:
        return None
    coords, share = pca_2d(X)
    note = None
    if X.shape[0] != token_steps:
        note = (f"{X.shape[0]} state rows for {token_steps} token steps: rows are matched to token steps in order, "
                f"the first {min(X.shape[0], token_steps)} drawn")
    n = min(X.shape[0], token_steps) if token_steps else X.shape[0]
    return {"rows": int(X.shape[0]), "dim": int(X.shape[1]), "norm": _short(np.linalg.norm(X, axis=1)[:n]),
            "pca": [_short(row) for row in coords[:n]], "explained": share, "note": note}


def _short(values) -> list[float]:
    """Six significant digits: what a plot and its tooltip show, at a third of the characters."""
    return [float(f"{v:.6g}") for v in values]
