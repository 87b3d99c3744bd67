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
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hybridlm.engine.arc import Event, RateFold, format_rates, token_logprobs
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
    "rewrite": set(),
    "plant": {"plant", "name", "plant_t", "plant_time", "time", "state", "x", "u", "kind", "commanded", "applied",
              "h", "direction", "barrier"},
}
PLANT_TIME = ("plant_t", "plant_time", "time")
EXAMPLES = 3  # raw lines shown per unknown event kind
# What the page draws of a long trace (a browser cannot show millions of points anyway): up to MAX_POINTS token
# steps and wall-clock points, MAX_ROWS rows of each table; beyond, a uniform sample that the page names.
MAX_POINTS = 20_000
MAX_ROWS = 2_000
TOKEN_COLUMNS = ("t", "k", "wall", "phase", "text", "id", "p", "kernel_p", "entropy", "extra")


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


def arc_view(events: Iterable[dict], states=None) -> dict:
    """The data of an arc report: see the module docstring. `events` may be a stream (`iter_trace`): it is read
    once, and what is kept of it is bounded by what the page draws (`Thinned`), not by the trace's length.
    `states` is an array [token steps, d]."""
    if isinstance(events, (str, bytes, dict)) or not isinstance(events, Iterable):
        raise InputError("an arc report needs a list of trace events (dicts with an 'event' field)")
    fold = _ArcFold()
    for e in events:
        if not isinstance(e, dict) or "event" not in e:
            raise InputError("an arc report needs a list of trace events (dicts with an 'event' field)")
        fold.add(e)
    return _clean(fold.view(states))


class Thinned:
    """A uniform sample of a stream of unknown length in memory bounded by `cap`: item i is kept while i is a
    multiple of the stride, and the stride doubles (every other kept item dropped) whenever more than `cap`
    are kept. The last item is always added at the end, so a curve reaches its true end."""

    def __init__(self, cap: int) -> None:
        self.cap, self.stride, self.seen = cap, 1, 0
        self.items: list = []
        self.last = None

    def add(self, item) -> None:
        if self.seen % self.stride == 0:
            self.items.append(item)
            if len(self.items) > self.cap:
                del self.items[1::2]
                self.stride *= 2
        self.seen += 1
        self.last = item

    def indices(self) -> list[int]:
        """The stream positions of `result()`'s items."""
        kept = list(range(0, self.seen, self.stride))
        return kept if not self.seen or kept[-1] == self.seen - 1 else [*kept, self.seen - 1]

    def result(self) -> list:
        whole = not self.seen or (self.seen - 1) % self.stride == 0
        return self.items if whole else [*self.items, self.last]

    def note(self, what: str) -> str | None:
        """What the page says when it shows a sample (None when it shows every item)."""
        if self.stride == 1:
            return None
        return (f"{self.seen:,} {what}: the page draws every {_ordinal(self.stride)} ({len(self.result()):,}, "
                f"the last included); the counts, phases and rates count every one")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class _ArcFold:
    """The arc report's data, taken from the events one at a time."""

    def __init__(self) -> None:
        self.start: dict | None = None
        self.end: dict | None = None
        self.last: dict | None = None
        self.phases: list[dict] = []
        self.phase = "decode"  # the phase in effect, for token events that do not name theirs
        self.wall_phase: str | None = None  # the same, as the wall curve labels it (None before any phase)
        self.tokens = Thinned(MAX_POINTS)  # one tuple of COLUMNS per kept token step
        self.wall_curve = Thinned(MAX_POINTS)
        self.jumps = Thinned(MAX_ROWS)
        self.controls = Thinned(MAX_ROWS)
        self.marks = Thinned(MAX_ROWS)
        # plant events: the commands, the crossings and the first with barrier values kept exactly (the held
        # input and the time in band are drawn from them), the other samples thinned; each with its position
        self.plant_kept: list[tuple[int, dict]] = []
        self.plant_samples = Thinned(MAX_POINTS)
        self.plant_h = False
        self.unknown: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.extra: Counter = Counter()
        self.rates: RateFold | None = RateFold()

    def add(self, e: dict) -> None:
        kind = e["event"]
        self.last = e
        if self.rates is not None:
            try:
                self.rates.add(Event.from_dict(e))
            except (TypeError, ValueError, OverflowError):  # a clock that is not a number: no rates table
                self.rates = None
        if kind == "start" and self.start is None:
            self.start = e
        elif kind == "end":
            self.end = e
        elif kind == "phase":
            self._phase(e)
        elif kind == "token":
            if self.phases:
                self.phases[-1]["steps"] += 1
            self.tokens.add(self._token(e))
        elif kind == "jump":
            self.jumps.add(e)
        elif kind == "control":
            self.controls.add({**_strip(e), "t": _num(e.get("t")), "k": _num(e.get("k"))})
        elif kind in ("batch", "context", "rewrite"):
            self.marks.add({"event": kind, "t": _num(e.get("t")), "k": _num(e.get("k")), "wall_s": _num(e.get("wall_s")),
                            "fields": _strip(e)})
        elif kind == "plant":
            self._plant(e)
        if isinstance(e.get("t"), (int, float)) and isinstance(e.get("wall_s"), (int, float)):
            self.wall_curve.add([_num(e["t"]), _num(e["wall_s"]), self.wall_phase])
        if kind not in KNOWN_FIELDS:
            self._unknown(e)
        elif KNOWN_FIELDS[kind]:
            for f in e:
                if f not in COMMON and f not in KNOWN_FIELDS[kind] and (len(self.extra) < MAX_ROWS or (kind, f) in self.extra):
                    self.extra[(kind, f)] += 1

    def _phase(self, e: dict) -> None:
        """Each phase event opens an interval that the next phase event (or the last event) closes."""
        if self.phases:
            self.phases[-1].update(t1=_num(e.get("t")), wall1=_num(e.get("wall_s")))
        self.phases.append({"phase": str(e.get("phase", "?")), "mode": e.get("mode"), "k": _num(e.get("k")),
                            "t0": _num(e.get("t")), "wall0": _num(e.get("wall_s")), "tokens": e.get("tokens"),
                            "steps": 0})
        self.phase = str(e.get("phase", self.phase))
        self.wall_phase = str(e.get("phase", "?"))

    def _token(self, e: dict) -> tuple:
        """One token step as a row of TOKEN_COLUMNS; the probability of the sampled token under the model at
        τ = 1 (`p`) and under the kernel that drew it (`kernel_p`), and the entropy, when recorded."""
        text = e.get("text")
        model, kernel = (_exp(v) for v in token_logprobs(e))
        extra = {k: v for k, v in e.items() if k not in COMMON | KNOWN_FIELDS["token"]}
        return (_num(e.get("t")), _num(e.get("k")), _num(e.get("wall_s")), str(e.get("phase") or self.phase),
                text if isinstance(text, str) else "" if text is None else json.dumps(text, default=str),
                e.get("token"), next((e[f] for f in ("p", "prob") if isinstance(e.get(f), (int, float))), model),
                kernel, e.get("entropy") if isinstance(e.get("entropy"), (int, float)) else None, extra or None)

    def _plant(self, e: dict) -> None:
        at = len(self.plant_kept) + self.plant_samples.seen
        first_h = not self.plant_h and isinstance(e.get("h"), dict)
        if first_h or e.get("kind") in ("command", "crossing"):
            self.plant_h = self.plant_h or first_h
            self.plant_kept.append((at, e))
        else:
            self.plant_samples.add((at, e))

    def _unknown(self, e: dict) -> None:
        name = e["event"]
        if name not in self.unknown and len(self.unknown) >= MAX_ROWS:
            name = "(other kinds)"
        self.unknown[name] += 1
        examples = self.examples.setdefault(name, [])
        if len(examples) < EXAMPLES:
            examples.append(json.dumps(e, ensure_ascii=False, default=str))

    def view(self, states) -> dict:
        problems = []
        if self.start is None:
            problems.append("the trace has no start event: task, model and limits are unknown")
        if self.end is None:
            problems.append("the trace has no end event: the run did not finish (stopped or killed)")
        if self.phases and self.last is not None:
            last = self.phases[-1]
            last.update(t1=max(_num(self.last.get("t")), last["t0"]), wall1=max(_num(self.last.get("wall_s")), last["wall0"]))
        rows = self.tokens.result()
        cols = {name: [row[i] for row in rows] for i, name in enumerate(TOKEN_COLUMNS)}
        optional = ("p", "kernel_p", "entropy", "extra")  # None where no kept token step recorded them
        tokens = {name: None if name in optional and all(v is None for v in col) else col for name, col in cols.items()}
        jumps = self.jumps.result()
        plant = [e for _, e in sorted(self.plant_kept + self.plant_samples.result(), key=lambda row: row[0])]
        sampled = [self.tokens.note("token steps"), self.wall_curve.note("points of the wall clock"),
                   self.jumps.note("jumps"), self.controls.note("control actions"), self.marks.note("engine events"),
                   self.plant_samples.note("plant samples (the commands and boundary crossings are all drawn)")]
        return {
            "kind": "arc",
            "start": self.start,
            "end": self.end,
            "phases": self.phases,
            "tokens": tokens,
            "jumps": [_jump(e) for e in jumps],
            "controls": self.controls.result(),
            "controllers": (self.start or {}).get("control") or [],
            "wall_curve": self.wall_curve.result(),
            "marks": self.marks.result(),
            "plant": _plant(plant, jumps, self.start),
            "rates": format_rates(self.rates.result()) if self.rates is not None else None,
            "states": _states(states, self.tokens.seen, self.tokens.indices()),
            "unknown": [{"event": name, "count": n, "examples": self.examples[name]} for name, n in self.unknown.items()],
            "extra_fields": [{"event": ev, "field": f, "count": n} for (ev, f), n in self.extra.items()],
            "problems": problems,
            "totals": {"token_steps": self.tokens.seen, "jumps": self.jumps.seen, "controls": self.controls.seen,
                       "marks": self.marks.seen},
            "sampled": [s for s in sampled if s],
        }


def _strip(e: dict) -> dict:
    return {k: v for k, v in e.items() if k != "event"}


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


def _plant(rows: list[dict], jumps: list[dict], start: dict | None) -> dict | None:
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
    if not rows:
        return None
    described = (start or {}).get("plant")
    described = described if isinstance(described, dict) else {}
    by_name: dict[str, list[dict]] = {}
    for e in rows:
        by_name.setdefault(str(e.get("plant") or e.get("name") or "plant"), []).append(e)
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


def _states(states, token_steps: int, kept: list[int]) -> dict | None:
    """The states' norms and 2-D projection at the token steps the page draws (`kept`, in order; every row
    when the trace has no token step)."""
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
    rows = [i for i in kept if i < X.shape[0]] if token_steps else list(range(X.shape[0]))
    return {"rows": int(X.shape[0]), "dim": int(X.shape[1]), "norm": _short(np.linalg.norm(X[rows], axis=1)),
            "pca": [_short(row) for row in coords[rows]], "explained": share, "note": note}


def _short(values) -> list[float]:
    """Six significant digits: what a plot and its tooltip show, at a third of the characters."""
    return [float(f"{v:.6g}") for v in values]
