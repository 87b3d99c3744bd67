"""A physical plant ẋ = f(t, x, u) that flows in its own time while the model thinks.

The plant is the environment of the external mode q_E: its flow never stops. Between two
actuator commands the input is held (zero-order hold; with a safety filter, u(t, x) is the
filter's feedback on the held command), so the state at any plant time τ is the solution
of an initial-value problem from the last command. The plant integrates lazily: whenever it
is read, commanded or sampled, `advance` solves the flow from the last instant to the
clock's τ with scipy's `solve_ivp` (dense output kept for the trajectory), with one event
function per barrier h_i so that every crossing of the safe set's boundary is located.
Integrating on demand gives the same trajectory as integrating continuously (the input is
constant in between), costs nothing while nobody looks, and cannot fall behind the clock.

The plant's tools (`tools()`): `read_sensors` and one `set_<actuator>(value)` per actuator,
each with a JSON schema; they are plain functions here (this layer knows nothing of agents),
and the agent wraps them as thread tools.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridlm.errors import InputError
from hybridlm.plant.cbf import CBF, Barrier, Filtered
from hybridlm.plant.clock import ManualClock, WallClock


@dataclass
class Actuator:
    name: str
    low: float
    high: float
    unit: str = ""
    description: str = ""


@dataclass
class Sensor:
    name: str
    read: Callable[[float, np.ndarray], float]  # (τ, x) → the measured value
    unit: str = ""
    description: str = ""


@dataclass
class PlantTool:
    """A plant's tool as data: the agent layer turns it into a `Tool`."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]


@dataclass
class Segment:
    """One solved interval of the flow, with its held command."""

    t0: float
    t1: float
    solution: Any  # scipy's OdeSolution (None for an empty interval)
    x0: np.ndarray
    commanded: np.ndarray


@dataclass
class Crossing:
    tau: float
    barrier: str
    direction: str  # "leave" (h goes below 0) or "enter"
    state: list[float]


class Plant:
    """ẋ = f(t, x, u), its sensors, actuators and safe set, flowing on `clock`."""

    def __init__(self, name: str, f: Callable, x0: Sequence[float], *, states: Sequence[str],
                 actuators: Sequence[Actuator], sensors: Sequence[Sensor], barriers: Sequence[Barrier] = (),
                 u0: Sequence[float] | None = None, clock: WallClock | ManualClock | None = None,
                 cbf: bool = False, gamma: float = 0.5, rtol: float = 1e-9, atol: float = 1e-9,
                 max_step: float = math.inf, description: str = "", units: Sequence[str] | None = None) -> None:
        self.name, self.f, self.description = name, f, description
        self.states = list(states)
        self.x = np.asarray(x0, dtype=float)
        if self.x.shape != (len(self.states),):
            raise InputError(f"plant {name}: x0 has shape {self.x.shape}; expected ({len(self.states)},) for {states}")
        self.actuators, self.sensors, self.barriers = list(actuators), list(sensors), list(barriers)
        # each state's unit: given, or that of the sensor that reads it under its name
        by_sensor = {s.name: s.unit for s in self.sensors}
        self.units = list(units) if units is not None else [by_sensor.get(n, "") for n in self.states]
        if len(self.units) != len(self.states):
            raise InputError(f"plant {name}: {len(self.units)} units for {len(self.states)} states {self.states}")
        if not self.actuators:
            raise InputError(f"plant {name}: expected at least one actuator")
        self.low = np.array([a.low for a in self.actuators], dtype=float)
        self.high = np.array([a.high for a in self.actuators], dtype=float)
        self.u = np.clip(np.asarray(u0 if u0 is not None else self.low, dtype=float), self.low, self.high)
        self.clock = clock if clock is not None else WallClock()
        self.rtol, self.atol, self.max_step = rtol, atol, max_step
        self.filter = (CBF(f, self.barriers, self.low, self.high, gamma=gamma, sample=(0.0, self.x))
                       if cbf else None)
        self.t = self.clock.time()
        self.segments: list[Segment] = []
        self.crossings: list[Crossing] = []
        self.corrections: list[dict] = []  # every command: commanded, applied, h (the arc's record)
        self.listeners: list[Callable[[dict], None]] = []  # told of each command and crossing
        self._lock = threading.RLock()

    def start(self) -> None:
        """Start the plant's clock now; only before the plant has flowed."""
        with self._lock:
            if self.segments:
                raise InputError(f"plant {self.name} has already flowed to τ = {self.t:.3f} s; it starts once")
            self.clock.restart()
            self.t = self.clock.time()

    # ------------------------------------------------------------------ the flow
    def input(self, t: float, x: np.ndarray, commanded: np.ndarray | None = None) -> np.ndarray:
        """u(t, x): the held command, through the safety filter when there is one."""
        u = self.u if commanded is None else commanded
        return self.filter(t, x, u).applied if self.filter is not None else u

    def _rhs(self, commanded: np.ndarray):
        def rhs(t, x):
            return np.asarray(self.f(t, x, self.input(t, x, commanded)), dtype=float)

        return rhs

    def _events(self):
        events = []
        for barrier in self.barriers:
            def event(t, x, b=barrier):
                return float(b.h(x))

            events.append(event)
        return events

    def solve(self, t0: float, t1: float, x0: np.ndarray, commanded: np.ndarray):
        """The flow from (t0, x0) to t1 under a held command: scipy's solution object."""
        from scipy.integrate import solve_ivp

        return solve_ivp(self._rhs(commanded), (t0, t1), x0, method="RK45", dense_output=True,
                         events=self._events() or None, rtol=self.rtol, atol=self.atol, max_step=self.max_step)

    def advance(self, tau: float | None = None) -> np.ndarray:
        """Flow to plant time τ (default: the clock's now); record the segment and any crossing."""
        with self._lock:
            tau = self.clock.time() if tau is None else float(tau)
            if tau <= self.t:
                return self.x.copy()
            sol = self.solve(self.t, tau, self.x, self.u)
            if not sol.success:
                raise RuntimeError(f"plant {self.name}: integration failed at τ={self.t:.3f} ({sol.message})")
            self.segments.append(Segment(self.t, tau, sol.sol, self.x.copy(), self.u.copy()))
            for barrier, times, states in zip(self.barriers, sol.t_events or [], sol.y_events or []):
                for te, xe in zip(times, states):
                    self._crossed(barrier, float(te), xe)
            self.t, self.x = tau, sol.y[:, -1].copy()
            return self.x.copy()

    def _crossed(self, barrier: Barrier, tau: float, x: np.ndarray) -> None:
        slope = barrier.gradient(x) @ np.asarray(self.f(tau, x, self.input(tau, x)), dtype=float)
        crossing = Crossing(tau, barrier.name, "leave" if slope < 0 else "enter", x.tolist())
        self.crossings.append(crossing)
        self._tell({"kind": "crossing", "plant_time": tau, "barrier": barrier.name,
                    "direction": crossing.direction, "state": self.named(x)})

    def predict_crossing(self, until: float) -> float | None:
        """The first plant time in (now, until] at which the state leaves the safe set, if the
        held command stays as it is (the supervisor sleeps until then at most)."""
        with self._lock:
            if until <= self.t or not self.barriers:
                return None
            sol = self.solve(self.t, until, self.x, self.u)
            leaving = []
            for barrier, times, states in zip(self.barriers, sol.t_events or [], sol.y_events or []):
                for te, xe in zip(times, states):
                    slope = barrier.gradient(xe) @ np.asarray(self.f(te, xe, self.input(te, xe)), dtype=float)
                    if slope < 0 and te > self.t:
                        leaving.append(float(te))
            return min(leaving) if leaving else None

    # ------------------------------------------------------------------ sensors and actuators
    def named(self, x: np.ndarray | None = None) -> dict[str, float]:
        x = self.x if x is None else x
        return {name: round(float(v), 6) for name, v in zip(self.states, x)}

    def read(self) -> dict:
        """The sensors at the clock's now (the plant flows to it first)."""
        with self._lock:
            x = self.advance()
            out = {"time_s": round(self.t, 3)}
            for s in self.sensors:
                out[s.name] = round(float(s.read(self.t, x)), 4)
            for a, value in zip(self.actuators, self.input(self.t, x)):
                out[a.name] = round(float(value), 4)
            return out

    def command(self, actuator: str, value: float) -> dict:
        """Set one actuator from now on; returns what was commanded and what the plant applies."""
        index = next((i for i, a in enumerate(self.actuators) if a.name == actuator), None)
        if index is None:
            raise InputError(f"plant {self.name}: no actuator {actuator!r}; actuators: "
                             f"{[a.name for a in self.actuators]}")
        if not math.isfinite(value):
            raise InputError(f"actuator {actuator}: value {value!r} is not a finite number")
        with self._lock:
            x = self.advance()
            u = self.u.copy()
            u[index] = value
            self.u = np.clip(u, self.low, self.high)
            record = self._filtered(self.t, x)
            row = {"kind": "command", "plant_time": self.t, "actuator": actuator, "value": float(value),
                   "state": self.named(x), **record.row()}
            self.corrections.append(row)
            self._tell(row)
            return {"time_s": round(self.t, 3), "commanded": round(float(value), 4),
                    "applied": round(float(record.applied[index]), 4),
                    **({"saturated": True} if self.u[index] != value else {}),
                    **({"safety_filter": "corrected"} if record.corrected else {})}

    def _filtered(self, t: float, x: np.ndarray) -> Filtered:
        if self.filter is not None:
            return self.filter(t, x, self.u)
        h = {b.name: float(b.h(x)) for b in self.barriers}
        return Filtered(self.u.copy(), self.u.copy(), h, True)

    def _tell(self, event: dict) -> None:
        for listener in self.listeners:
            listener(event)

    # ------------------------------------------------------------------ tools
    def tools(self) -> list[PlantTool]:
        sensors = ", ".join(f"{s.name}" + (f" ({s.unit})" if s.unit else "") for s in self.sensors)
        out = [PlantTool("read_sensors", f"Read the {self.name} sensors now: {sensors}.",
                         {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
                         lambda: self.read())]
        for a in self.actuators:
            what = a.description or a.name
            # no minimum/maximum in the schema: an actuator saturates, and the reply says what it applied
            out.append(PlantTool(
                f"set_{a.name}", f"Set the {what}: a number from {a.low:g} to {a.high:g}"
                f"{' ' + a.unit if a.unit else ''} (values beyond saturate).",
                {"type": "object", "properties": {"value": {"type": "number"}},
                 "required": ["value"], "additionalProperties": False},
                lambda value, name=a.name: self.command(name, float(value))))
        return out

    # ------------------------------------------------------------------ the record
    def trajectory(self, points_per_segment: int = 50) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(τ, x(τ), u(τ)) sampled along every segment solved so far."""
        ts, xs, us = [], [], []
        for seg in self.segments:
            grid = np.linspace(seg.t0, seg.t1, points_per_segment)
            states = seg.solution(grid).T
            ts.append(grid)
            xs.append(states)
            us.append(np.array([self.input(t, x, seg.commanded) for t, x in zip(grid, states)]))
        if not ts:
            return np.array([self.t]), self.x[None, :], self.u[None, :]
        return np.concatenate(ts), np.concatenate(xs), np.concatenate(us)

    def safe_time(self, t0: float, t1: float) -> float:
        """Plant seconds in [t0, t1] spent inside the safe set (from the located crossings)."""
        edges = sorted(c.tau for c in self.crossings if t0 < c.tau < t1)
        total, start = 0.0, t0
        for edge in [*edges, t1]:
            mid = self._state_at((start + edge) / 2)
            inside = all(b.h(mid) >= 0 for b in self.barriers)
            if inside:
                total += edge - start
            start = edge
        return total

    def violations(self, t0: float = -math.inf, t1: float = math.inf) -> int:
        """How many times the state left the safe set in [t0, t1]."""
        return sum(1 for c in self.crossings if c.direction == "leave" and t0 <= c.tau <= t1)

    def _state_at(self, tau: float) -> np.ndarray:
        for seg in self.segments:
            if seg.t0 <= tau <= seg.t1:
                return seg.solution(tau)
        return self.segments[0].x0 if self.segments and tau < self.segments[0].t0 else self.x

    def bounds(self) -> dict[str, list[float | None]]:
        """The safe set as bounds on single states, {state: [low, high]} (None where unbounded), from the
        barriers that are affine in one state (h = ±(x_i − edge), as the built-ins' bands are); barriers of
        another shape bound no single state and are left out."""
        out: dict[str, list[float | None]] = {}
        x = self.x.astype(float)
        for b in self.barriers:
            g = b.gradient(x)
            axes = np.flatnonzero(np.abs(g) > 1e-12)
            if len(axes) != 1:
                continue
            i = int(axes[0])
            edge = float(x[i] - b.h(x) / g[i])
            probe = x.copy()
            probe[i] = edge + 1.0
            if not math.isclose(b.h(probe), g[i], rel_tol=1e-6, abs_tol=1e-9):  # not affine along x_i
                continue
            low, high = out.setdefault(self.states[i], [None, None])
            out[self.states[i]] = [edge if g[i] > 0 else low, edge if g[i] < 0 else high]
        return out

    def describe(self) -> dict:
        return {"plant": self.name, "states": self.states, "units": dict(zip(self.states, self.units)),
                "bands": self.bounds(),
                "actuators": [a.name for a in self.actuators],
                "inputs": {a.name: {"low": a.low, "high": a.high, "unit": a.unit} for a in self.actuators},
                "commanded": self.u.tolist(),  # the command held now (before the first: the initial input)
                "sensors": [s.name for s in self.sensors], "barriers": [b.name for b in self.barriers],
                "cbf": None if self.filter is None else {"gamma": self.filter.gamma},
                **self.clock.describe()}
