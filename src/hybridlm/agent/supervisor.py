"""A language model in the loop of a physical plant: the supervisory hybrid system.

Two clocks run side by side: the plant's τ (wall time, or simulated time at a stated
ratio to it) and the model's token clock t. The plant flows all the time; the model is
asked for a decision

    at τ = 0, then at every period P of plant time, or as soon as the plant leaves its
    safe set (a barrier crossing located by the integrator's event functions),

and each decision is one `HybridAgent.run` whose task is the user's task and the latest
observation. Its tool calls (read the sensors, set an actuator) are jumps; while it
generates and while its tools run, τ keeps advancing, so the model acts on a plant that
has moved on since the observation it was given: its latency is part of the loop. A CBF
filter on the actuators (plant.cbf) may correct each command before it reaches the plant.

The arc of the whole run is one trace: the supervisor's `start` and `end`, each decision's
events (phase, token, control, jump, with t and k counted over the whole run, and `server`
on each jump) framed by `decision` events, and `plant` events (commands with the CBF
correction, crossings, samples) with the plant time τ and the state. A decision's events
are written when it ends, merged in wall-time order with the plant events it caused; while
it runs they are in a file beside the trace (kept if the run is killed).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hybridlm.agent.automaton import HybridAgent, Limits
from hybridlm.tools import Tool, ToolRegistry
from hybridlm.engine.trace import NullTrace, TraceWriter, read_trace
from hybridlm.engine.sampling import Kernel
from hybridlm.errors import InputError
from hybridlm.plant.system import Plant


@dataclass
class Call:
    """One tool call seen from the plant's side: when it ran in plant time and wall time."""

    tool: str
    server: str | None
    tau0: float
    tau1: float
    wall0: float
    wall1: float
    error: str | None


@dataclass
class Decision:
    index: int
    reason: str  # start | period | crossing
    task: str
    tau0: float  # plant time when the model was asked
    tau1: float  # plant time when it was done
    wall_s: float
    token_steps: int
    jumps: list[dict]  # tool, arguments, error of each jump (a call the registry refused included)
    answer: str
    stop_reason: str
    calls: list[Call] = field(default_factory=list)


@dataclass
class SupervisedArc:
    task: str
    plant: dict
    horizon_s: float
    period_s: float
    decisions: list[Decision]
    safe_time_s: float
    violations: int
    corrections: list[dict]
    crossings: list[dict]
    trace: str | None = None
    figure: str | None = None

    @property
    def safe_fraction(self) -> float:
        return self.safe_time_s / self.horizon_s if self.horizon_s > 0 else 0.0

    def latency(self) -> dict:
        """The model's decision latency: token steps and wall seconds per decision (median, p95)."""
        steps = [d.token_steps for d in self.decisions]
        walls = [d.wall_s for d in self.decisions]
        return {"decisions": len(self.decisions), "token_steps": spread(steps), "wall_s": spread(walls),
                "plant_s": spread([d.tau1 - d.tau0 for d in self.decisions])}

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["safe_fraction"] = self.safe_fraction
        out["latency"] = self.latency()
        return out

    def summary(self) -> str:
        lat = self.latency()
        return (f"in the safe set {self.safe_fraction:.1%} of {self.horizon_s:g} s, {self.violations} violation"
                f"{'' if self.violations == 1 else 's'}, {lat['decisions']} decisions (median "
                f"{lat['token_steps']['median']:g} token steps, {lat['wall_s']['median']:.2f} s), "
                f"{sum(1 for c in self.corrections if c['corrected'])} of {len(self.corrections)} commands corrected")


def spread(values: Sequence[float]) -> dict:
    if not values:
        return {"median": 0.0, "p95": 0.0, "max": 0.0}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"median": float(statistics.median(ordered)), "p95": float(p95), "max": float(ordered[-1])}


def plant_tools(plant: Plant, *, timeout_s: float = 5.0) -> list[Tool]:
    """The plant's sensors and actuators as thread tools (server = "plant:<name>")."""
    return [Tool(t.name, t.description, t.parameters, t.fn, timeout_s=timeout_s, runs_in="thread",
                 server=f"plant:{plant.name}") for t in plant.tools()]


class Supervisor:
    """Re-prompts a `HybridAgent` with the plant's latest observation, periodically or on a crossing."""

    def __init__(self, model, plant: Plant, *, horizon_s: float = 120.0, period_s: float = 10.0,
                 limits: Limits = Limits(max_token_steps=40, max_jumps=2), kernel: Kernel = Kernel(greedy=True),
                 tool_choice: str = "required", seed: int = 0, tools: ToolRegistry | None = None) -> None:
        for name, value in (("horizon", horizon_s), ("period", period_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InputError(f"{name} {value!r}: expected a finite number of plant seconds > 0")
        self.plant, self.horizon_s, self.period_s = plant, float(horizon_s), float(period_s)
        self.registry = ToolRegistry()
        for t in [*plant_tools(plant), *(tools or ())]:
            if t.name in self.registry:
                raise InputError(f"tool {t.name!r} is offered twice (by the plant and by {t.server or 'the built-ins'})")
            self.registry.register(self._timed(t))
        self.agent = HybridAgent(model, self.registry, kernel=kernel, limits=limits, tool_choice=tool_choice,
                                 seed=seed)
        self.seed = seed
        self.stop = threading.Event()
        self._calls: list[Call] = []
        self._pending: list[dict] = []  # plant events during a decision, merged when it ends
        self._lock = threading.Lock()

    def _timed(self, t: Tool) -> Tool:
        """The same tool, its calls timed in plant time for the figure and the arc."""
        clock = self.plant.clock

        def fn(**arguments):
            tau0, wall0 = clock.time(), time.perf_counter()
            out = t.fn(**arguments)
            error = getattr(out, "error", None)
            with self._lock:
                self._calls.append(Call(t.name, t.server, tau0, clock.time(), wall0, time.perf_counter(), error))
            return out

        return dataclasses.replace(t, fn=fn)

    # ------------------------------------------------------------------ the loop
    def run(self, task: str, *, trace: str | Path | None = None, figure: str | Path | None = None) -> SupervisedArc:
        if not isinstance(task, str) or not task.strip():
            raise InputError("empty task: say what the plant should do")
        plant = self.plant
        self._wall0 = time.perf_counter()
        self._t = self._k = 0
        self._trace = TraceWriter(trace) if trace else NullTrace()
        self._in_decision = False
        if not plant.segments:
            plant.start()  # τ = 0 at the start of the run
        plant.listeners.append(self._plant_event)
        decisions: list[Decision] = []
        try:
            self._write("start", task=task, model=getattr(self.agent.model, "source", "?"), plant=plant.describe(),
                        horizon_s=self.horizon_s, period_s=self.period_s, kernel=dataclasses.asdict(self.agent.kernel),
                        limits=dataclasses.asdict(self.agent.limits), tool_choice=self.agent.tool_choice,
                        seed=self.seed, tools=[{**t.schema(), "server": t.server} for t in self.registry])
            self._sample("start")
            reason = "start"
            while not self.stop.is_set():
                plant.advance()
                if plant.t >= self.horizon_s:
                    break
                decisions.append(self._decide(len(decisions), reason, task, trace))
                left = [c for c in plant.crossings if c.direction == "leave" and c.tau >= decisions[-1].tau0]
                if left:  # the plant left its safe set while the model was deciding: ask again now
                    reason = "crossing"
                    continue
                reason = self._wait()
            plant.advance(max(self.horizon_s, plant.t))
            self._sample("end")
            arc = SupervisedArc(
                task=task, plant=plant.describe(), horizon_s=self.horizon_s, period_s=self.period_s,
                decisions=decisions, safe_time_s=plant.safe_time(0.0, self.horizon_s),
                violations=plant.violations(0.0, self.horizon_s), corrections=list(plant.corrections),
                crossings=[dataclasses.asdict(c) for c in plant.crossings],
                trace=str(trace) if trace else None)
            self._write("end", safe_time_s=arc.safe_time_s, safe_fraction=arc.safe_fraction,
                        violations=arc.violations, decisions=len(decisions), latency=arc.latency(),
                        commands=len(arc.corrections),
                        corrected=sum(1 for c in arc.corrections if c["corrected"]))
        finally:
            plant.listeners.remove(self._plant_event)
            self._trace.close()
        if figure:
            from hybridlm.agent.plant_figure import plant_figure

            arc.figure = str(plant_figure(arc, plant, figure))
        return arc

    def _wait(self) -> str:
        """Sleep until the next period or the predicted exit from the safe set, whichever is first."""
        plant = self.plant
        tick = (math.floor(plant.t / self.period_s + 1e-9) + 1) * self.period_s
        until = min(tick, self.horizon_s)
        # on or beyond the boundary now: the model was told; the next prompt is the period's
        leaving = plant.predict_crossing(until) if not self._at_boundary() else None
        wake = leaving if leaving is not None else until
        plant.clock.sleep_until(wake, self.stop)
        plant.advance(max(wake, plant.clock.time()))
        return "crossing" if leaving is not None else "period"

    def _decide(self, index: int, reason: str, task: str, trace: str | Path | None) -> Decision:
        plant = self.plant
        reading = plant.read()
        prompt = self._prompt(task, reading, reason)
        tau0, wall0 = plant.t, time.perf_counter()
        path = None
        if trace:
            path = Path(trace).with_name(f".{Path(trace).name}.decision-{index:03d}.jsonl")
        with self._lock:
            self._calls, self._pending, self._in_decision = [], [], True
        self.agent.seed = self.seed + index
        try:
            arc = self.agent.run(prompt, trace=path)
            plant.advance()  # to the decision's end: a crossing during it belongs to it
        finally:
            with self._lock:
                self._in_decision = False
                pending, calls = self._pending, self._calls
        jumps = [{"tool": j.tool, "arguments": j.arguments, "error": j.error} for j in arc.jumps]
        decision = Decision(index, reason, prompt, tau0, plant.t, time.perf_counter() - wall0, arc.token_steps,
                            jumps, arc.answer, arc.stop_reason, calls)
        self._merge(decision, path, wall0 - self._wall0, pending)
        return decision

    def _prompt(self, task: str, reading: dict, reason: str) -> str:
        values = ", ".join(f"{k} = {v:.3g}" for k, v in reading.items() if k != "time_s")
        why = ""
        if self._at_boundary():
            why = f" Warning: the plant is leaving its safe set ({', '.join(self._at_boundary())})."
        return (f"{task}\nThe plant: {self.plant.description}.\nPlant time {reading['time_s']:.1f} s of "
                f"{self.horizon_s:g} s. Now: {values}.{why} Act with one tool call.")

    def _at_boundary(self) -> list[str]:
        """The barriers that are at or below zero now."""
        return [b.name for b in self.plant.barriers if b.h(self.plant.x) <= 1e-6]

    # ------------------------------------------------------------------ the arc on disk
    def _wall(self) -> float:
        return round(time.perf_counter() - self._wall0, 6)

    def _write(self, event: str, **fields) -> None:
        self._trace.write(event, t=self._t, k=self._k, wall_s=fields.pop("wall_s", self._wall()), **fields)

    def _plant_event(self, row: dict) -> None:
        event = {"wall_s": self._wall(), **row}
        with self._lock:
            if self._in_decision:
                self._pending.append(event)
                return
        self._write("plant", **event)

    def _sample(self, kind: str) -> None:
        x = self.plant.x
        self._write("plant", kind=kind, plant_time=self.plant.t, state=self.plant.named(x),
                    u=self.plant.input(self.plant.t, x).tolist(),
                    h={b.name: float(b.h(x)) for b in self.plant.barriers})

    def _merge(self, decision: Decision, path: Path | None, offset: float, pending: list[dict]) -> None:
        """Write the decision's agent events (t and k counted over the run) and its plant events, in wall order."""
        if isinstance(self._trace, NullTrace):
            self._t += decision.token_steps
            self._k += len(decision.jumps)
            return
        servers = {t.name: t.server for t in self.registry}
        t0, k0 = self._t, self._k
        agent_events = []
        for e in read_trace(path) if path is not None and path.exists() else []:
            e = {**e, "t": e.get("t", 0) + t0, "k": e.get("k", 0) + k0, "wall_s": round(offset + e.get("wall_s", 0.0), 6),
                 "decision": decision.index}
            if e["event"] == "start":
                e = {"event": "decision", "stage": "start", "t": e["t"], "k": e["k"], "wall_s": e["wall_s"],
                     "decision": decision.index, "reason": decision.reason, "task": e.get("task"),
                     "plant_time": decision.tau0}
            elif e["event"] == "end":
                e = {"event": "decision", "stage": "end", "t": e["t"], "k": e["k"], "wall_s": e["wall_s"],
                     "decision": decision.index, "answer": e.get("answer"), "stop_reason": e.get("stop_reason"),
                     "token_steps": e.get("token_steps"), "jumps": e.get("jumps"), "plant_time": decision.tau1,
                     "latency_s": decision.wall_s}
            elif e["event"] == "jump":
                e["server"] = servers.get(e.get("tool"))
            agent_events.append(e)
        merged = []
        for p in pending:  # a plant event takes the hybrid time (t, k) of the agent event before it
            before = [e for e in agent_events if e["wall_s"] <= p["wall_s"]]
            last = before[-1] if before else {"t": t0, "k": k0}
            merged.append({"event": "plant", "t": last["t"], "k": last["k"], **p, "decision": decision.index})
        for e in sorted(agent_events + merged, key=lambda e: e["wall_s"]):
            self._trace.write(e.pop("event"), **e)
        self._t, self._k = t0 + decision.token_steps, k0 + len(decision.jumps)
        if path is not None:
            path.unlink(missing_ok=True)
