"""The agentic hybrid automaton (SPEC.md §4, seed 000), as a hybrid system of the engine.

    modes      q_G (generate: prefill, decode, constrained phases) and q_E (external: a tool runs)
    flow set   C = {q_G, the answer not finished}
    flow map   f: one token step, w_{t+1} ~ p_θ(· | s_t) (masked by the call's constraint when a
               call is open), x_{t+1} = F(x_t, w_{t+1})  (the engine's, shared by every system)
    jump set   D = {q_G, the turn has just completed <tool_call>{json}</tool_call>}
    jump map   g: run the tool for wall time (q_E), then s⁺ = Π_T(Φ(s, enc(y))), the
               observation entering the state through a prefill phase; k ← k + 1

C and D meet where a call has just completed; the engine's priority rule (jumps first, by
default) takes the jump there. The solution is a hybrid arc over {(t, k)} with wall time
attached to every event (`hybridlm.engine.arc`), written to the trace as it happens.
Controllers (hybridlm.control) may act in the flow map: their residual inputs for the whole
arc, their kernel inputs on free text only (inside a tool call the constraint is the input);
each action is a `control` event. The engine's horizons bound the arc: a token budget, a jump
horizon, and at most `max_jumps_per_step` jumps at one token step (no Zeno loop of calls);
when no jump is allowed the tokens that would open a call are removed from the kernel.

While a tool runs the sequence is out of the engine's batch: `HybridAgent.run_many` runs
several tasks on one engine, and the others keep generating meanwhile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridlm.agent.grammar import OPEN, CallGrammar, FreeCall
from hybridlm.agent.protocol import Protocol
from hybridlm.agent.tools import Observation, Tool, ToolRegistry
from hybridlm.engine.arc import HybridArc, Termination
from hybridlm.engine.engine import Engine
from hybridlm.engine.inputs import ControlLoop
from hybridlm.engine.prefill import ContextPolicy, PrefixCache
from hybridlm.engine.sampling import Kernel
from hybridlm.engine.sequence import ArcState, Limits
from hybridlm.engine.system import HybridSystem
from hybridlm.engine.trace import StateRecorder, TraceWriter
from hybridlm.errors import InputError

TOOL_CHOICES = ("auto", "required", "none")

__all__ = ["Arc", "HybridAgent", "Jump", "Limits", "replay"]


@dataclass
class Jump:
    k: int
    t: int
    tool: str
    arguments: dict | str
    observation: str
    error: str | None
    wall_s: float  # duration of the external mode


@dataclass
class Arc:
    """The outcome of a run: the answer and a summary of its hybrid arc (`hybrid`: every event)."""

    task: str
    answer: str
    stop_reason: str  # a hybridlm.engine.Termination value: stop_token | token_budget | ...
    token_steps: int
    jumps: list[Jump] = field(default_factory=list)
    wall_generate_s: float = 0.0
    wall_external_s: float = 0.0
    generated_ids: list[int] = field(default_factory=list)
    trace: str | None = None
    control: list[dict] = field(default_factory=list)  # what the controllers did, per token step
    hybrid: HybridArc | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("hybrid")
        return out

    def summary(self) -> str:
        return (
            f"{self.token_steps} token steps, {len(self.jumps)} jump{'' if len(self.jumps) == 1 else 's'}, "
            f"q_G {self.wall_generate_s:.2f} s, q_E {self.wall_external_s:.3f} s, stop: {self.stop_reason}"
        )


class CallConstraint:
    """A tool call's grammar as the engine's constraint: its mask M_t, fed the text of each token."""

    def __init__(self, grammar, tokenizer) -> None:
        self.grammar = grammar
        self.table = tokenizer.table
        self.stop_ids = tokenizer.stop_ids()

    def mask(self) -> torch.Tensor | None:
        return self.grammar.allowed()

    def advance(self, token: int) -> None:
        if token in self.stop_ids:  # only an unconstrained call can be cut short so
            self.grammar.ended = True
        else:
            texts = self.table.texts
            self.grammar.feed(texts[token] if token < len(texts) else "")

    @property
    def finished(self) -> bool:
        return self.grammar.done

    def describe(self) -> dict:
        return {"constraint": "tool_call", "grammar": type(self.grammar).__name__}


class AgentSystem(HybridSystem):
    """H = (C, f, D, g) of the agent for one model, tool registry and tool choice."""

    def __init__(self, agent: "HybridAgent") -> None:
        self.agent = agent
        self.tokenizer = agent.tokenizer

    # ------------------------------------------------------------------ C and f
    def flow_set(self, s) -> bool:
        return s.finished is False

    def controlled(self, s) -> bool:
        return s.constraint is None  # free text: the controllers act; inside a call the grammar does

    def phase_of(self, s) -> str:
        return "constrained" if s.constraint is not None and self.agent.constrain else "decode"

    def flow_mask(self, s) -> torch.Tensor | None:
        """When no jump is allowed, remove the tokens that would complete an opening <tool_call>."""
        if s.constraint is not None or self._may_jump(s):
            return None
        table = self.tokenizer.table
        turn_text = self.tokenizer.decode(s.turn)
        banned = table.containing(OPEN)
        for n in range(1, len(OPEN)):
            if turn_text.endswith(OPEN[:n]):
                banned = banned + table.starting_with(OPEN[n:])
        if not banned:
            return None
        allowed = torch.ones(table.size, dtype=torch.bool)
        allowed[torch.tensor(banned)] = False
        return allowed

    def flowed(self, s, token: int) -> None:
        """A stop token outside a call finishes the answer; an opened call gets its constraint."""
        if s.constraint is not None:
            return
        if token in s.stop_ids:
            s.finished = Termination.STOP_TOKEN
            return
        if self._may_jump(s):
            turn_text = self.tokenizer.decode(s.turn)
            if OPEN in turn_text:  # the model opened a call by itself: constrain what follows
                agent = self.agent
                grammar = CallGrammar(agent.tools, self.tokenizer.table, opened=True) if agent.constrain else FreeCall()
                grammar.text = OPEN
                try:
                    grammar.feed(turn_text[turn_text.index(OPEN) + len(OPEN):])
                except ValueError:
                    grammar.segments.clear()  # malformed: D is reached, g reports the error
                s.constraint = CallConstraint(grammar, self.tokenizer)

    def _may_jump(self, s) -> bool:
        return self.agent.tool_choice != "none" and s.jumps_allowed

    # ------------------------------------------------------------------ D and g
    def jump_set(self, s) -> bool:
        return s.constraint is not None and s.constraint.finished

    def jump(self, s):
        grammar = s.constraint.grammar
        s.constraint = None
        s.call = grammar
        try:
            name, arguments = grammar.parsed()
        except (ValueError, KeyError, TypeError) as exc:
            obs = Observation(f"error: malformed tool call ({exc})", "malformed_call")
            return lambda: (grammar.name or "?", grammar.call_json, obs)
        replayed = self.agent._replayed(s)
        if replayed is not None:
            return lambda: (name, arguments, replayed)
        tools = self.agent.tools
        return lambda: (name, arguments, tools.call(name, arguments))

    def landed(self, s, result) -> list[int]:
        name, arguments, obs = result
        s.count_jump()
        s.emit("jump", id=f"call-{s.name}-{s.k}", tool=name, arguments=arguments, observation=obs.text,
               error=obs.error, duration_s=obs.duration_s, server=self._server(name))
        grammar = s.call
        s.messages.append({"role": "assistant", "content": grammar.text})
        enc = self.agent.protocol.observation_ids(s.messages, obs.text, turn_closed=getattr(grammar, "ended", False))
        s.messages.append({"role": "tool", "content": obs.text})
        return enc

    def _server(self, name: str) -> str | None:
        tool = self.agent.tools.tools.get(name)
        return None if tool is None else tool.server

    # ------------------------------------------------------------------ the end
    def summary(self, s) -> dict:
        return {"answer": self._answer(s)}

    def _answer(self, s) -> str:
        return self.tokenizer.decode([i for i in s.turn if i not in s.stop_ids]).strip()

    def ended(self, s) -> None:
        arc = s.arc
        jumps = [Jump(e.k, e.t, e["tool"], e["arguments"], e["observation"], e["error"], e["duration_s"])
                 for e in arc.of("jump")]
        s.result = Arc(
            task=s.task, answer=self._answer(s),
            stop_reason=arc.termination.value, token_steps=s.t, jumps=jumps,
            wall_generate_s=arc.wall_in("q_G"), wall_external_s=arc.wall_in("q_E"), generated_ids=list(s.generated),
            trace=s.trace_path, control=[{"t": e.t, "k": e.k, **e.data} for e in arc.of("control")], hybrid=arc)

    def describe(self, s) -> dict:
        agent = self.agent
        return {"system": "agent", "task": s.task, "tool_choice": agent.tool_choice, "constrain": agent.constrain,
                "tools": [{**t.schema(), **({"server": t.server} if t.server else {})} for t in agent.tools]}


class HybridAgent:
    """H = (C, f, D, g) around a model and a tool registry; runs tasks on the engine."""

    def __init__(
        self,
        model,
        tools: ToolRegistry,
        *,
        kernel: Kernel = Kernel(greedy=True),
        limits: Limits = Limits(),
        tool_choice: str = "required",
        seed: int = 0,
        example: bool = True,
        record_states: bool = False,
        constrain: bool = True,
        controllers=None,
        context: ContextPolicy | str = ContextPolicy(),
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if tool_choice not in TOOL_CHOICES:
            raise InputError(f"tool choice {tool_choice!r}: expected one of {TOOL_CHOICES}")
        if getattr(model, "tokenizer", None) is None:
            raise InputError("the agent needs a model with a tokenizer and a chat template")
        self.model, self.tools, self.kernel, self.limits = model, tools, kernel, limits
        self.tool_choice = tool_choice if tools.tools else "none"
        self.seed = seed
        self.constrain = constrain
        self.record_states = record_states and hasattr(model, "hooks")
        self.tokenizer = model.tokenizer
        self.protocol = Protocol(self.tokenizer, tools, example=example)
        self.stop_ids = frozenset(self.tokenizer.stop_ids())
        self.controllers = list(controllers or [])
        if self.controllers and ControlLoop(model, self.controllers, kernel=kernel).prefix is not None:
            raise InputError("the agent takes no soft prefix (its prompt state is shared across tasks)")
        self.context = ContextPolicy.parse(context) if isinstance(context, str) else context
        # the fixed part of every prompt (system prompt, tools, example) is prefilled once
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(128 * 2**20)
        self.system = AgentSystem(self)
        self.replay: list[dict] | None = None  # recorded observations, for replay

    # ------------------------------------------------------------------ runs
    def run(self, task: str, *, trace: str | Path | None = None) -> Arc:
        """Run one task to the end of its arc."""
        (arc,) = self.run_many([task], traces=[trace])
        return arc

    def run_many(self, tasks: list[str], *, traces: list | None = None, max_batch: int = 64) -> list[Arc]:
        """Run several tasks concurrently on one engine (each its own arc, seed and trace); while
        one task's tool runs, the others keep generating."""
        traces = list(traces) if traces is not None else [None] * len(tasks)
        if len(traces) != len(tasks):
            raise InputError(f"{len(traces)} traces for {len(tasks)} tasks: expected one per task (or none)")
        seqs = [self.sequence(task, trace=trace) for task, trace in zip(tasks, traces)]
        engine = Engine(self.model, max_batch=max_batch, context=self.context, prefix_cache=self.prefix_cache)
        for s in seqs:
            engine.add(s)
        try:
            engine.run()
        finally:
            engine.close()
            for s in seqs:
                for obs in s.observers:
                    close = getattr(obs, "close", None)
                    if close is not None:
                        close()
        for s in seqs:
            if s.error is not None:
                raise s.error
        return [s.result for s in seqs]

    def sequence(self, task: str, *, trace: str | Path | None = None, seed: int | None = None) -> ArcState:
        """The ArcState of a task, ready to join an engine."""
        if not isinstance(task, str):
            raise InputError(f"task of type {type(task).__name__}: expected text (str)")
        if not task.strip():
            raise InputError("empty task: give the agent something to do")
        messages = self.protocol.messages(task)
        prompt, marks = self.protocol.prompt_ids_and_marks(messages)  # (the last mark: where the shared part ends)
        constraint = None
        if self.tool_choice == "required":  # a call segment forced open at the start of the turn
            if self.constrain:
                constraint = CallConstraint(CallGrammar(self.tools, self.tokenizer.table, opened=False), self.tokenizer)
            else:
                prompt = prompt + self.tokenizer.encode(OPEN)  # the opening enters as part of the prefill
                constraint = CallConstraint(FreeCall(), self.tokenizer)
        controls = None
        if self.controllers:
            controls = ControlLoop(self.model, self.controllers, kernel=self.kernel, stop_ids=self.stop_ids,
                                   reads="turn")
        observers = []
        if trace:
            observers.append(TraceWriter(trace))
            if self.record_states:
                observers.append(StateRecorder(self.model, Path(trace).with_suffix(".safetensors")))
        return ArcState(self.system, prompt, kernel=self.kernel, seed=self.seed if seed is None else seed,
                        limits=self.limits, constraint=constraint, controls=controls, stop_ids=self.stop_ids,
                        observers=observers, messages=messages, marks=tuple(marks[-1:]), task=task,
                        trace_path=str(trace) if trace else None)

    def _replayed(self, s) -> Observation | None:
        """The recorded observation of this jump, when replaying a trace."""
        if self.replay is None:
            return None
        recorded = self.replay[s.k] if s.k < len(self.replay) else None
        if recorded is None:
            return Observation("error: the replayed trace has no observation for this jump", "replay")
        return Observation(recorded["observation"], recorded.get("error"), recorded.get("duration_s", 0.0))


def replay(trace_path: str | Path, model) -> tuple[Arc, bool, int | None]:
    """Re-run a recorded arc with its seed and configuration, taking observations from the trace.

    The tools are rebuilt from the schemas in the trace and never called: the external
    mode's outputs are the recorded ones, so the replay is deterministic.
    Returns the new arc, whether its tokens equal the recorded ones, and the first token
    step where they differ (None when identical).
    """
    from hybridlm.agent.trace import read_trace

    events = read_trace(trace_path)
    start = next((e for e in events if e["event"] == "start"), None)
    if start is None:
        raise InputError(f"{trace_path}: no start event, cannot replay")
    if start.get("control"):
        raise InputError(f"{trace_path}: recorded with control inputs {start['control']}; replay does not rebuild "
                         "controllers")
    recorded = [e["token"] for e in events if e["event"] == "token"]
    tools = ToolRegistry()
    for schema in start["tools"]:
        tools.register(Tool(schema["name"], schema["description"], schema["parameters"], _not_called))
    agent = HybridAgent(model, tools, kernel=Kernel(**start["kernel"]), limits=Limits(**start["limits"]),
                        tool_choice=start["tool_choice"], seed=start["seed"], constrain=start.get("constrain", True),
                        context=start.get("context") or ContextPolicy())
    agent.replay = [e for e in events if e["event"] == "jump"]
    arc = agent.run(start["task"])
    ours = arc.generated_ids
    first = next((i + 1 for i, (a, b) in enumerate(zip(ours, recorded)) if a != b), None)
    if first is None and len(ours) != len(recorded):
        first = min(len(ours), len(recorded)) + 1
    return arc, first is None, first


def _not_called(**_):
    raise RuntimeError("a replayed tool is never called")
