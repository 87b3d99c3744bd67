"""The agent: a task through the conversation's hybrid automaton, its tools run here (docs/theory.md §4).

The hybrid system is `hybridlm.turns.Conversation`: modes q_G (generate) and q_E (external),
flow set C (the answer not finished), jump set D (the turn has just completed its calls),
jump map g (run the calls for wall time, then s⁺ = Π_T(Φ(s, enc(y)))). `HybridAgent` composes
it with the agent's parts: a tool registry whose calls run here (or the recorded observations
of a replay), the offer (tool choice, parallel calls, the constrained or free baseline), the
prompt (system prompt, tools, a worked example) and the engine that solves the arcs. The
solution is a hybrid arc over {(t, k)} with wall time attached to every event
(`hybridlm.engine.arc`), written to the trace as it happens; `Arc` summarises it.
Controllers (hybridlm.control) may act in the flow map: their residual inputs for the whole
arc, their kernel inputs on free text only (inside a tool call the constraint is the input);
each action is a `control` event.

While a tool runs the sequence is out of the engine's batch: `HybridAgent.run_many` runs
several tasks on one engine, and the others keep generating meanwhile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridlm.constraints import TOOL_CHOICES
from hybridlm.engine.arc import HybridArc
from hybridlm.engine.engine import Engine
from hybridlm.engine.inputs import ControlLoop
from hybridlm.engine.prefill import ContextPolicy, PrefixCache
from hybridlm.engine.sampling import Kernel
from hybridlm.engine.sequence import ArcState, Limits
from hybridlm.engine.trace import StateRecorder, TraceWriter
from hybridlm.errors import InputError
from hybridlm.tools import Observation, Tool, ToolRegistry
from hybridlm.turns import CallCodec, Conversation, Offer, Protocol, codec_for, offerable

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


class HybridAgent:
    """The conversation's H = (C, f, D, g) around a model and a tool registry; runs tasks on the engine."""

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
        codec: CallCodec | None = None,
        system: str = "",
        admit_defaults: bool = False,
    ) -> None:
        if getattr(model, "tokenizer", None) is None:
            raise InputError("the agent needs a model with a tokenizer and a chat template")
        self.codec = codec if codec is not None else codec_for(model)
        if constrain:
            tools = offerable(tools, model.tokenizer, self.codec)
        if tool_choice not in TOOL_CHOICES and tool_choice not in tools:
            raise InputError(f"tool choice {tool_choice!r}: expected one of {TOOL_CHOICES} or an offered tool's name")
        self.model, self.tools, self.kernel, self.limits = model, tools, kernel, limits
        self.tool_choice = tool_choice if tools.tools else "none"
        self.seed = seed
        self.constrain = constrain
        self.parallel = parallel_tool_calls  # several calls in a turn (each a jump, observations in order)
        self.record_states = record_states and hasattr(model, "hooks")
        self.tokenizer = model.tokenizer
        self.protocol = Protocol(self.tokenizer, tools, example=example, codec=self.codec, system=system)
        self.stop_ids = frozenset(self.tokenizer.stop_ids())
        self.controllers = list(controllers or [])
        if self.controllers and ControlLoop(model, self.controllers, kernel=kernel).prefix is not None:
            raise InputError("the agent takes no soft prefix (its prompt state is shared across tasks)")
        self.context = ContextPolicy.parse(context) if isinstance(context, str) else context
        # the fixed part of every prompt (system prompt, tools, example) is prefilled once
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(128 * 2**20)
        offer = Offer(tools=tuple(t.offered() for t in tools),
                      choice=self.tool_choice, parallel=parallel_tool_calls, constrain=constrain,
                      defaults=admit_defaults)
        self.system = Conversation(self.tokenizer, self.protocol, offer, vocab_size=model.config.vocab_size,
                                   run=self._call, outcome=self.arc_of, kind="agent")
        self.replay: list[dict] | None = None  # recorded observations, for replay

    # ------------------------------------------------------------------ runs
    def run(self, task: str, *, trace: str | Path | None = None, observers: tuple = ()) -> Arc:
        """Run one task to the end of its arc; `observers` watch its events as they happen
        (hybridlm.agent.watch: the stream of its text and jumps, a progress line)."""
        (arc,) = self.run_many([task], traces=[trace], observers=observers)
        return arc

    def run_many(self, tasks: list[str], *, traces: list | None = None, max_batch: int = 64,
                 observers: tuple = ()) -> list[Arc]:
        """Run several tasks concurrently on one engine (each its own arc, seed and trace); while
        one task's tool runs, the others keep generating."""
        traces = list(traces) if traces is not None else [None] * len(tasks)
        if len(traces) != len(tasks):
            raise InputError(f"{len(traces)} traces for {len(tasks)} tasks: expected one per task (or none)")
        seqs = [self.sequence(task, trace=trace) for task, trace in zip(tasks, traces)]
        for s in seqs:
            s.observers.extend(observers)
        Engine(self.model, max_batch=max_batch, context=self.context, prefix_cache=self.prefix_cache).solve(seqs)
        return [s.result for s in seqs]

    def sequence(self, task: str, *, trace: str | Path | None = None, seed: int | None = None) -> ArcState:
        """The ArcState of a task, ready to join an engine."""
        if not isinstance(task, str):
            raise InputError(f"task of type {type(task).__name__}: expected text (str)")
        if not task.strip():
            raise InputError("empty task: give the agent something to do")
        messages = self.protocol.messages(task)
        prompt, marks = self.protocol.prompt_ids_and_marks(messages)  # (the last mark: where the shared part ends)
        if self.tool_choice == "required" and not self.constrain:  # the call forced open enters with the prefill
            prompt = prompt + self.tokenizer.encode_markup(self.codec.opening)
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
        observers: list = []
        if trace:
            observers.append(TraceWriter(trace))
            if self.record_states:
                observers.append(StateRecorder(self.model, Path(trace).with_suffix(".safetensors")))
        s = ArcState(self.system, prompt, kernel=self.kernel, seed=self.seed if seed is None else seed,
                     limits=self.limits, controls=controls, stop_ids=self.stop_ids, observers=observers,
                     messages=messages, marks=tuple(marks[-1:]), task=task, trace_path=str(trace) if trace else None)
        s.constraint = self.system.turn(s, first=True)
        return s

    def arc_of(self, s: ArcState) -> Arc:
        """The summary of a task's arc once it has ended."""
        arc = s.arc
        jumps = [Jump(e.k, e.t, e["tool"], e["arguments"], e["observation"], e["error"], e["duration_s"])
                 for e in arc.of("jump")]
        assert arc.termination is not None, "the arc has not ended"
        return Arc(task=s.task, answer=self.system.answer(s), stop_reason=arc.termination.value, token_steps=s.t,
                   jumps=jumps, wall_generate_s=arc.wall_in("q_G"), wall_external_s=arc.wall_in("q_E"),
                   generated_ids=list(s.generated), trace=s.trace_path,
                   control=[{"t": e.t, "k": e.k, **e.data} for e in arc.of("control")], hybrid=arc)

    def _call(self, k: int, name: str, arguments) -> Observation:
        """The jump map's external work for the call that makes k + 1 jumps: the tool runs, or, when
        replaying a trace, the recorded observation comes back."""
        if self.replay is None:
            return self.tools.call(name, arguments)
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
    Whatever the recorded limits say, a replay ends one token step or jump past the recording.
    """
    from hybridlm.engine.trace import cut_short, read_trace

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
    # The recording is the replay's horizon, one of its own: the limits stay the recording's (the turn's
    # constraint reads its budget, so a smaller one would change the tokens near its end), and the replay
    # is cancelled once it steps past the recording (a forged budget in the start event cannot make it run
    # on); a faithful replay never gets there. A cut recording stops at its last step: past it there is
    # nothing to compare with.
    jumps = [e for e in events if e["event"] == "jump"]
    agent = HybridAgent(model, tools, kernel=Kernel(**start["kernel"]), limits=Limits(**start["limits"]),
                        tool_choice=start["tool_choice"], seed=start["seed"], constrain=start.get("constrain", True),
                        parallel_tool_calls=start.get("parallel_tool_calls", False),
                        context=start.get("context") or ContextPolicy(),
                        admit_defaults=start.get("admit_defaults", False) is True)
    agent.replay = jumps
    cut = cut_short(events)
    s = agent.sequence(start["task"])
    engine = Engine(model, context=agent.context, prefix_cache=agent.prefix_cache)

    class Horizon:
        landed = 0

        def on_event(self, s, event) -> None:
            self.landed += event.kind == "jump"
            if cut:
                past = s.t >= len(recorded) and self.landed >= len(jumps)
            else:
                past = s.t > len(recorded) or self.landed > len(jumps)
            if past:
                engine.cancel(s)  # taken at the next engine step

    s.observers.append(Horizon())
    engine.solve([s])
    arc = s.result
    ours = arc.generated_ids[:len(recorded)] if cut else arc.generated_ids
    first = next((i + 1 for i, (a, b) in enumerate(zip(ours, recorded)) if a != b), None)
    if first is None and len(ours) != len(recorded):
        first = min(len(ours), len(recorded)) + 1
    return arc, first is None, first


def _not_called(**_):
    raise RuntimeError("a replayed tool is never called")
