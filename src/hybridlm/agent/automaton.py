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

import concurrent.futures
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridlm.agent.protocol import Protocol
from hybridlm.agent.tools import Observation, Tool, ToolRegistry
from hybridlm.constraints import CLOSE, OPEN, call_is_open, parse_calls, tool_call_constraint
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


class FreeTurn:
    """An unconstrained turn (a baseline): nothing is masked; the calls the model writes are parsed
    when it closes one (or the turn ends), and a malformed call comes back as an error observation."""

    def __init__(self, tokenizer, *, text: str = "") -> None:
        self.tokenizer, self.stop_ids = tokenizer, tokenizer.stop_ids()
        self.tokens: list[int] = []
        self.prefix, self.ended = text, False  # (a call forced open enters the prompt as text)

    def mask(self) -> None:
        return None

    def advance(self, token: int) -> None:
        if token in self.stop_ids:
            self.ended = True
        else:
            self.tokens.append(int(token))

    @property
    def text(self) -> str:
        return self.prefix + self.tokenizer.decode(self.tokens)

    @property
    def in_call(self) -> bool:
        return call_is_open(self.text)

    @property
    def finished(self) -> bool:
        text = self.text
        return self.ended or (CLOSE in text and not call_is_open(text))

    def parsed(self) -> tuple[list, str | None]:
        return parse_calls(self.text)

    def calls(self) -> list:
        return self.parsed()[0]

    def describe(self) -> dict:
        return {"kind": "free_turn"}


class AgentSystem(HybridSystem):
    """H = (C, f, D, g) of the agent for one model, tool registry and tool choice. Each turn of the
    assistant has one constraint (hybridlm.constraints.tool_call_constraint): free text, or a call
    of an offered tool with arguments of its schema, opened lazily in "auto"."""

    def __init__(self, agent: "HybridAgent") -> None:
        self.agent = agent
        self.tokenizer = agent.tokenizer

    def turn(self, s, *, first: bool):
        """The constraint of the turn that starts now (the first turn follows the tool choice)."""
        agent, lim = self.agent, s.limits
        left = min(lim.max_jumps - s.k, lim.max_jumps_per_step)
        if not agent.constrain:
            return FreeTurn(self.tokenizer, text=OPEN if first and agent.tool_choice == "required" else "")
        choice = agent.tool_choice if first else "auto"
        if left <= 0 or agent.tool_choice == "none":
            choice = "none"
        return tool_call_constraint(self.tokenizer, agent.tools, choice, parallel=agent.parallel and left > 1,
                                    max_calls=left if agent.parallel and left > 1 else None,
                                    budget=max(1, lim.max_token_steps - s.t), vocab_size=agent.vocab_size)

    # ------------------------------------------------------------------ C and f
    def flow_set(self, s) -> bool:
        return s.finished is False

    def controlled(self, s) -> bool:
        return not s.constraint.in_call  # free text: the controllers act; inside a call the constraint does

    def phase_of(self, s) -> str:
        return "constrained" if s.constraint.in_call and self.agent.constrain else "decode"

    def flow_mask(self, s) -> torch.Tensor | None:
        """Unconstrained, when no jump is allowed: remove the tokens that would complete an opening <tool_call>."""
        if self.agent.constrain or s.constraint.in_call or self._may_jump(s):
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
        """A stop token outside a call finishes the answer."""
        if token in s.stop_ids and not self.jump_set(s):
            s.finished = Termination.STOP_TOKEN

    def _may_jump(self, s) -> bool:
        return self.agent.tool_choice != "none" and s.jumps_allowed

    # ------------------------------------------------------------------ D and g
    def jump_set(self, s) -> bool:
        """The turn's constraint is finished and holds calls (or, unconstrained, a call that did not parse)."""
        c = s.constraint
        if not c.finished:
            return False
        if isinstance(c, FreeTurn):
            return OPEN in c.text
        return bool(c.calls())

    def jump(self, s):
        c = s.constraint
        s.call = c
        if isinstance(c, FreeTurn):
            calls, error = c.parsed()
            if error is not None:  # the first bad call, after the good ones, reports what is wrong
                bad = Observation(f"error: malformed tool call ({error})", "malformed_call")
                calls = [*calls, ("?", c.text.rsplit(OPEN, 1)[-1].split(CLOSE)[0], bad)]
        else:
            calls = c.calls()
        calls = [call if isinstance(call, tuple) else (call.name, call.arguments, None) for call in calls]
        agent = self.agent
        replayed = [agent._replayed(s, s.k + i) for i in range(len(calls))]

        def work():
            """The calls of the turn, run side by side in wall time; their observations in order."""
            def one(i):
                name, arguments, given = calls[i]
                return given or replayed[i] or agent.tools.call(name, arguments)

            if len(calls) == 1:
                return [(calls[0][0], calls[0][1], one(0))]
            with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
                return [(c[0], c[1], obs) for c, obs in zip(calls, pool.map(one, range(len(calls))))]

        return work

    def landed(self, s, results) -> list[int]:
        for name, arguments, obs in results:
            s.count_jump()
            s.emit("jump", id=f"call-{s.name}-{s.k}", tool=name, arguments=arguments, observation=obs.text,
                   error=obs.error, duration_s=obs.duration_s, server=self._server(name))
        c = s.call
        closed = bool(s.turn) and s.turn[-1] in s.stop_ids  # the model closed its turn itself
        s.messages.append({"role": "assistant", "content": c.text})
        observations = [obs.text for _, _, obs in results]
        enc = self.agent.protocol.observation_ids(s.messages, observations, turn_closed=closed)
        s.messages += [{"role": "tool", "content": text} for text in observations]
        s.constraint = self.turn(s, first=False)
        return enc

    def _server(self, name: str) -> str | None:
        tool = self.agent.tools.tools.get(name)
        return None if tool is None else tool.server

    # ------------------------------------------------------------------ the end
    def summary(self, s) -> dict:
        return {"answer": self._answer(s)}

    def _answer(self, s) -> str:
        text = self.tokenizer.decode([i for i in s.turn if i not in s.stop_ids])
        if call_is_open(text):  # a call the token budget cut is not part of the answer
            text = text[: text.rfind(OPEN)]
        return text.strip()

    def ended(self, s) -> None:
        arc = s.arc
        jumps = [Jump(e.k, e.t, e["tool"], e["arguments"], e["observation"], e["error"], e["duration_s"])
                 for e in arc.of("jump")]
        s.result = Arc(
            task=s.task, answer=self._answer(s), stop_reason=arc.termination.value, token_steps=s.t, jumps=jumps,
            wall_generate_s=arc.wall_in("q_G"), wall_external_s=arc.wall_in("q_E"), generated_ids=list(s.generated),
            trace=s.trace_path, control=[{"t": e.t, "k": e.k, **e.data} for e in arc.of("control")], hybrid=arc)

    def describe(self, s) -> dict:
        agent = self.agent
        return {"system": "agent", "task": s.task, "tool_choice": agent.tool_choice, "constrain": agent.constrain,
                "parallel_tool_calls": agent.parallel,
                "tools": [{**t.schema(), **({"server": t.server} if t.server else {})} for t in agent.tools]}


class ToolNotOffered(UserWarning):
    """A tool server's tool left out: the call constraint cannot compile its schema."""


def without_grammar(tools: ToolRegistry, tokenizer) -> dict[str, str]:
    """The tools whose argument schemas the call constraint cannot compile, and why (one line each)."""
    missing = {}
    for t in tools:
        try:
            tool_call_constraint(tokenizer, [t], "required")
        except InputError as exc:
            missing[t.name] = str(exc)
    return missing


def offerable(tools: ToolRegistry, tokenizer) -> ToolRegistry:
    """The registry without the MCP servers' tools whose schemas the call constraint cannot
    compile, each named in a warning: a server's schema is not the user's to fix, and one such
    tool must not stop every run. A tool of the user's own that does not compile is an error."""
    try:
        tool_call_constraint(tokenizer, list(tools), "required")
        return tools
    except InputError:
        pass
    missing = without_grammar(tools, tokenizer)
    own = [name for name in missing if tools.tools[name].server is None]
    if own:
        raise InputError(missing[own[0]])
    for name, reason in missing.items():
        warnings.warn(f"tool {name} of {tools.tools[name].server} is not offered: {reason}", ToolNotOffered,
                      stacklevel=3)
    return ToolRegistry({n: t for n, t in tools.tools.items() if n not in missing}, tools.max_output_chars)


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
        parallel_tool_calls: bool = False,
        controllers=None,
        context: ContextPolicy | str = ContextPolicy(),
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if getattr(model, "tokenizer", None) is None:
            raise InputError("the agent needs a model with a tokenizer and a chat template")
        if constrain:
            tools = offerable(tools, model.tokenizer)
        if tool_choice not in TOOL_CHOICES and tool_choice not in tools:
            raise InputError(f"tool choice {tool_choice!r}: expected one of {TOOL_CHOICES} or an offered tool's name")
        self.model, self.tools, self.kernel, self.limits = model, tools, kernel, limits
        self.tool_choice = tool_choice if tools.tools else "none"
        self.seed = seed
        self.constrain = constrain
        self.parallel = parallel_tool_calls  # several calls in a turn (each a jump, observations in order)
        self.vocab_size = model.config.vocab_size
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
        if self.tool_choice == "required" and not self.constrain:
            prompt = prompt + self.tokenizer.encode_markup(OPEN)  # the call forced open enters as part of the prefill
        T = self.model.config.n_ctx
        if len(prompt) >= T:  # Π_T would cut the system prompt and the tools' schemas away before the first step
            shared = marks[-1] if marks else 0
            raise InputError(f"the agent's prompt takes {len(prompt)} tokens ({shared} for the system prompt with "
                             f"{len(self.tools.tools)} tools, {len(prompt) - shared} for the task); the model's "
                             f"context holds {T}: offer fewer tools or give a shorter task")
        controls = None
        if self.controllers:
            controls = ControlLoop(self.model, self.controllers, kernel=self.kernel, stop_ids=self.stop_ids,
                                   reads="turn")
        observers = []
        if trace:
            observers.append(TraceWriter(trace))
            if self.record_states:
                observers.append(StateRecorder(self.model, Path(trace).with_suffix(".safetensors")))
        s = ArcState(self.system, prompt, kernel=self.kernel, seed=self.seed if seed is None else seed,
                     limits=self.limits, controls=controls, stop_ids=self.stop_ids, observers=observers,
                     messages=messages, marks=tuple(marks[-1:]), task=task, trace_path=str(trace) if trace else None)
        s.constraint = self.system.turn(s, first=True)
        return s

    def _replayed(self, s, k: int) -> Observation | None:
        """The recorded observation of the jump that makes k + 1 jumps, when replaying a trace."""
        if self.replay is None:
            return None
        recorded = self.replay[k] if k < len(self.replay) else None
        if recorded is None:
            return Observation("error: the replayed trace has no observation for this jump", "replay")
        return Observation(recorded["observation"], recorded.get("error"), recorded.get("duration_s", 0.0))


def replay(trace_path: str | Path, model) -> tuple[Arc, bool, int | None]:
    """Re-run a recorded arc with its seed and configuration, taking observations from the trace.

    The tools are rebuilt from the schemas in the trace and never called: the external
    mode's outputs are the recorded ones, so the replay is deterministic.
    Returns the new arc, whether its tokens equal the recorded ones, and the first token
    step where they differ (None when identical). A recording without an end event (the run
    was killed) is compared as far as it goes: the replay stops once it has made every recorded
    token step and jump (its arc ends `cancelled`), and is identical when it made the same tokens.
    """
    from hybridlm.agent.trace import cut_short, read_trace

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
                        parallel_tool_calls=start.get("parallel_tool_calls", False),
                        context=start.get("context") or ContextPolicy())
    agent.replay = [e for e in events if e["event"] == "jump"]
    cut = cut_short(events)
    if not cut:
        arc = agent.run(start["task"])
    else:  # past the recording's last step there is nothing to compare with: stop there, not at the run's end
        s = agent.sequence(start["task"])
        engine = Engine(model, context=agent.context, prefix_cache=agent.prefix_cache)

        class StopAtTheCut:
            landed = 0

            def on_event(self, s, event) -> None:
                self.landed += event.kind == "jump"
                if s.t >= len(recorded) and self.landed >= len(agent.replay):
                    engine.cancel(s)  # taken at the next engine step

        s.observers.append(StopAtTheCut())
        engine.add(s)
        try:
            engine.run()
        finally:
            engine.close()
        if s.error is not None:
            raise s.error
        arc = s.result
    ours = arc.generated_ids[:len(recorded)] if cut else arc.generated_ids
    first = next((i + 1 for i, (a, b) in enumerate(zip(ours, recorded)) if a != b), None)
    if first is None and len(ours) != len(recorded):
        first = min(len(ours), len(recorded)) + 1
    return arc, first is None, first


def _not_called(**_):
    raise RuntimeError("a replayed tool is never called")
