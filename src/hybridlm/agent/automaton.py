"""The agentic hybrid automaton (SPEC.md §4, seed 000).

    modes      q_G (generate: prefill, decode, constrained phases) and q_E (external: a tool runs)
    flow set   C = {q_G, the generated turn has not completed a tool call}
    flow map   f: one token step, w_{t+1} ~ p_θ(· | s_t) (masked by the call grammar when a
               call is open), x_{t+1} = F(x_t, w_{t+1})
    jump set   D = {q_G, the turn has just completed <tool_call>{json}</tool_call>}
    jump map   g: run the tool for wall time (q_E), then s⁺ = Π_T(Φ(s, enc(y))), the
               observation entering the state through a prefill phase; k ← k + 1

The solution is a hybrid arc over the hybrid time domain {(t, k)}, with wall time
attached to every event and written to the trace as it happens. Controllers
(hybridlm.control) may act in the flow map: their residual inputs for the whole arc, their
kernel inputs on free text only (inside a tool call the grammar mask is the input); each
action is a `control` event of the trace. Limits bound the arc:
a token budget (flow horizon), a jump horizon, and at most `max_jumps_per_step` jumps
at one token step, so no Zeno loop of tool calls can occur; when jumps are no longer
allowed the tokens that would open a call are removed from the kernel.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridlm.agent.grammar import OPEN, CallGrammar, FreeCall
from hybridlm.agent.protocol import Protocol
from hybridlm.agent.tools import Observation, Tool, ToolRegistry
from hybridlm.agent.trace import NullTrace, TraceWriter
from hybridlm.errors import InputError
from hybridlm.engine.sampling import Kernel

TOOL_CHOICES = ("auto", "required", "none")


@dataclass(frozen=True)
class Limits:
    max_token_steps: int = 160  # flow horizon: token steps over the whole arc
    max_jumps: int = 3  # jump horizon
    max_jumps_per_step: int = 1  # jumps allowed at one token step (no Zeno behaviour)

    def __post_init__(self) -> None:
        for name in ("max_token_steps", "max_jumps", "max_jumps_per_step"):
            if getattr(self, name) < 0:
                raise InputError(f"{name}={getattr(self, name)}: expected ≥ 0")


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
    """The outcome of a run: the answer and a summary of the hybrid arc."""

    task: str
    answer: str
    stop_reason: str  # answer | token_budget
    token_steps: int
    jumps: list[Jump] = field(default_factory=list)
    wall_generate_s: float = 0.0
    wall_external_s: float = 0.0
    generated_ids: list[int] = field(default_factory=list)
    trace: str | None = None
    control: list[dict] = field(default_factory=list)  # what the controllers did, per token step

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"{self.token_steps} token steps, {len(self.jumps)} jump{'' if len(self.jumps) == 1 else 's'}, "
            f"q_G {self.wall_generate_s:.2f} s, q_E {self.wall_external_s:.3f} s, stop: {self.stop_reason}"
        )


class HybridAgent:
    """H = (C, f, D, g) around a model and a tool registry."""

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
    ) -> None:
        if tool_choice not in TOOL_CHOICES:
            raise InputError(f"tool choice {tool_choice!r}: expected one of {TOOL_CHOICES}")
        if model.tokenizer is None:
            raise InputError("the agent needs a model with a tokenizer and a chat template")
        self.model, self.tools, self.kernel, self.limits = model, tools, kernel, limits
        self.tool_choice = tool_choice if tools.tools else "none"
        self.seed = seed
        self.constrain = constrain
        self.record_states = record_states and hasattr(model, "hooks")
        self.tokenizer = model.tokenizer
        self.protocol = Protocol(self.tokenizer, tools, example=example)
        self.table = self.tokenizer.table
        self.stop_ids = self.tokenizer.stop_ids()
        self.replay: list[dict] | None = None  # recorded observations, for replay
        self._prefix: tuple[list[int], object] | None = None  # (ids, state) of the fixed prompt prefix
        self._control = self._control_loop(controllers)

    # ------------------------------------------------------------------ the arc
    def run(self, task: str, *, trace: str | Path | None = None) -> Arc:
        if not isinstance(task, str) or not task.strip():
            raise InputError("empty task: give the agent something to do")
        self._trace = TraceWriter(trace) if trace else NullTrace()
        try:
            with self._control.attached() if self._control else contextlib.nullcontext():
                return self._run(task)
        finally:
            self._trace.close()

    def _control_loop(self, controllers):
        if not controllers:
            return None
        from hybridlm.control.loop import ControlLoop

        loop = ControlLoop(self.model, controllers, kernel=self.kernel, stop_ids=self.stop_ids)
        if loop.prefix is not None:
            raise InputError("the agent takes no soft prefix (its prompt state is shared across tasks)")
        return loop

    def _run(self, task: str) -> Arc:
        self.t, self.k, self.q = 0, 0, "q_G"
        self._start = time.perf_counter()
        self._jumps_at: dict[int, int] = {}
        self._states: list[torch.Tensor] = []
        self.arc = Arc(task=task, answer="", stop_reason="token_budget", token_steps=0,
                       trace=str(self._trace.path) if self._trace.path else None)
        self._trace.write("start", t=0, k=0, wall_s=0.0, task=task, model=getattr(self.model, "source", "?"),
                          kernel=asdict(self.kernel), limits=asdict(self.limits), tool_choice=self.tool_choice,
                          constrain=self.constrain,
                          tools=[t.schema() for t in self.tools], seed=self.seed,
                          control=[c.describe() for c in self._control.controllers] if self._control else [])
        self.messages = self.protocol.messages(task)
        prompt = self.protocol.prompt_ids(self.messages)
        self._phase("prefill", tokens=len(prompt))
        self.x = self._prefill(prompt)
        self.generator = torch.Generator(device=self._device()).manual_seed(self.seed)
        self.grammar = self._open_call() if self.tool_choice == "required" else None
        self.turn: list[int] = []
        self._phase("constrained" if self.grammar else "decode")
        self.answered = False
        g_start = time.perf_counter()
        with self._state_recorder():
            while True:  # the arc goes on while it is in C ∪ D
                if self.in_jump_set():
                    self.arc.wall_generate_s += time.perf_counter() - g_start
                    self.jump()
                    g_start = time.perf_counter()
                elif self.in_flow_set():
                    self.flow()
                else:
                    break
        self.arc.wall_generate_s += time.perf_counter() - g_start
        self.arc.stop_reason = "answer" if self.answered else "token_budget"
        self.arc.answer = self.tokenizer.decode([i for i in self.turn if i not in self.stop_ids]).strip()
        self.arc.token_steps = self.t
        self._trace.write("end", t=self.t, k=self.k, wall_s=self._wall(), answer=self.arc.answer,
                          stop_reason=self.arc.stop_reason, token_steps=self.t, jumps=self.k,
                          wall_generate_s=self.arc.wall_generate_s, wall_external_s=self.arc.wall_external_s)
        self._save_states()
        return self.arc

    def _prefill(self, prompt: list[int]):
        """x_0 from the prompt, reusing the state of the fixed prefix (system prompt, example).

        The prefix is the same for every task, so its state is computed once and cloned:
        by causal prefix invariance F(x_prefix, rest) equals a prefill of the whole prompt.
        """
        if self._prefix is None:
            fixed = self.tokenizer.render_chat(self.messages[:-1], add_generation_prompt=False)
            ids = self.tokenizer.encode(fixed)
            self._prefix = (ids, self.model.init_state(ids).clone()) if 0 < len(ids) < len(prompt) else ([], None)
        ids, state = self._prefix
        if state is None or prompt[: len(ids)] != ids or len(prompt) == len(ids):
            return self.model.init_state(prompt)
        x = state.clone()
        return self.model.F(x, prompt[len(ids):])

    # ------------------------------------------------------------------ C and f
    def in_flow_set(self) -> bool:
        """C: generating, the answer not finished, token budget left, and not in D."""
        return (self.q == "q_G" and not self.answered and self.t < self.limits.max_token_steps
                and not self.in_jump_set())

    def flow(self) -> None:
        """f: one token step; a stop token outside a call finishes the answer."""
        z = self.model.G(self.x)
        allowed = self.grammar.allowed() if self.grammar else self._free_allowed()
        if allowed is not None:
            z = z.masked_fill(~allowed.to(z.device), float("-inf"))
        if self._control is not None and self.grammar is None:  # free text: the controllers act
            z = self._controlled(z)
        w = self.kernel.sample(z, self.generator)
        self.model.F(self.x, w)
        self.t += 1
        token = int(w[0])
        text = self.table.texts[token] if token < len(self.table.texts) else ""
        self.arc.generated_ids.append(token)
        self._trace.write("token", t=self.t, k=self.k, wall_s=self._wall(), token=token,
                          text=self.tokenizer.token_str(token), phase=self._current_phase)
        if self.grammar is not None:
            if token in self.stop_ids:  # only an unconstrained call can be cut short so
                self.grammar.ended = True
            else:
                self.grammar.feed(text)
            return
        self.turn.append(token)
        if token in self.stop_ids:
            self.answered = True
            return
        if self._may_jump():
            turn_text = self.tokenizer.decode(self.turn)
            if OPEN in turn_text:  # the model opened a call by itself: constrain what follows
                self.grammar = CallGrammar(self.tools, self.table, opened=True) if self.constrain else FreeCall()
                self.grammar.text = OPEN
                rest = turn_text[turn_text.index(OPEN) + len(OPEN):]
                self._phase("constrained" if self.constrain else "decode")
                try:
                    self.grammar.feed(rest)
                except ValueError:
                    self.grammar.segments.clear()  # malformed: D is reached, g reports the error

    def _controlled(self, z: torch.Tensor) -> torch.Tensor:
        """(v_t, M_t) from the controllers, seeing the text of the current turn; each action traced."""
        texts = self.table.texts
        self._control.texts = ["".join(texts[i] if i < len(texts) else "" for i in self.turn)]
        z, records = self._control.step(self.t + 1, z, self.x)
        for rec in records:
            row = rec.row(0)
            self.arc.control.append({"t": self.t + 1, "k": self.k, **row})
            self._trace.write("control", t=self.t + 1, k=self.k, wall_s=self._wall(), **row)
        return z

    def _open_call(self):
        """A call segment forced open at the start of the turn (tool choice "required")."""
        if self.constrain:
            return CallGrammar(self.tools, self.table, opened=False)
        self.model.F(self.x, self.tokenizer.encode(OPEN))  # the opening enters as a prefill
        return FreeCall()

    def _may_jump(self) -> bool:
        return (
            self.tool_choice != "none"
            and self.k < self.limits.max_jumps
            and self._jumps_at.get(self.t, 0) < self.limits.max_jumps_per_step
        )

    def _free_allowed(self) -> torch.Tensor | None:
        """When no jump is allowed, remove the tokens that would complete an opening <tool_call>."""
        if self._may_jump():
            return None
        turn_text = self.tokenizer.decode(self.turn)
        banned = self.table.containing(OPEN)
        for n in range(1, len(OPEN)):
            if turn_text.endswith(OPEN[:n]):
                banned = banned + self.table.starting_with(OPEN[n:])
        if not banned:
            return None
        allowed = torch.ones(self.table.size, dtype=torch.bool)
        allowed[torch.tensor(banned)] = False
        return allowed

    # ------------------------------------------------------------------ D and g
    def in_jump_set(self) -> bool:
        return self.q == "q_G" and self.grammar is not None and self.grammar.done

    def jump(self) -> None:
        """g: run the tool in q_E, then inject enc(y) through a prefill phase; k ← k + 1."""
        grammar, self.grammar = self.grammar, None
        self.q = "q_E"
        self._phase("external")
        try:
            name, arguments = grammar.parsed()
            obs = self._call(name, arguments)
        except (ValueError, KeyError, TypeError) as exc:
            name, arguments = grammar.name or "?", grammar.call_json
            obs = Observation(f"error: malformed tool call ({exc})", "malformed_call")
        self.k += 1
        self._jumps_at[self.t] = self._jumps_at.get(self.t, 0) + 1
        self.arc.wall_external_s += obs.duration_s
        jump = Jump(self.k, self.t, name, arguments, obs.text, obs.error, obs.duration_s)
        self.arc.jumps.append(jump)
        self._trace.write("jump", t=self.t, k=self.k, wall_s=self._wall(), tool=name, arguments=arguments,
                          observation=obs.text, error=obs.error, duration_s=obs.duration_s)
        self.q = "q_G"
        self.messages.append({"role": "assistant", "content": grammar.text})
        enc = self.protocol.observation_ids(self.messages, obs.text, turn_closed=getattr(grammar, "ended", False))
        self.messages.append({"role": "tool", "content": obs.text})
        self._phase("prefill", tokens=len(enc))
        self.model.F(self.x, enc)  # s⁺ = Π_T(Φ(s, enc(y)))
        self.turn = []
        self._phase("decode")

    def _call(self, name: str, arguments: dict) -> Observation:
        if self.replay is not None:
            recorded = self.replay[self.k] if self.k < len(self.replay) else None
            if recorded is None:
                return Observation("error: the replayed trace has no observation for this jump", "replay")
            return Observation(recorded["observation"], recorded.get("error"), recorded.get("duration_s", 0.0))
        return self.tools.call(name, arguments)

    # ------------------------------------------------------------------ bookkeeping
    _current_phase = "prefill"

    def _phase(self, phase: str, **extra) -> None:
        self._current_phase = phase
        self._trace.write("phase", t=self.t, k=self.k, wall_s=self._wall(), phase=phase, mode=self.q, **extra)

    def _wall(self) -> float:
        return round(time.perf_counter() - self._start, 6)

    def _device(self):
        x = self.x
        return x.device if hasattr(x, "device") else "cpu"

    def _state_recorder(self):
        import contextlib

        if not self.record_states:
            return contextlib.nullcontext()
        last = f"blocks.{self.model.config.n_layer - 1}.hook_resid_post"

        def keep(h, hook):
            if h.shape[1] == 1:  # a decode step: the final-layer state of the new token
                self._states.append(h[0, -1].detach().float().cpu())

        return self.model.hooks({last: keep})

    def _save_states(self) -> None:
        if not self._states or self._trace.path is None:
            return
        from safetensors.torch import save_file

        path = Path(self._trace.path).with_suffix(".safetensors")
        save_file({"resid_final": torch.stack(self._states)}, str(path),
                  metadata={"hook": f"blocks.{self.model.config.n_layer - 1}.hook_resid_post", "rows": "token_step"})


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
                        tool_choice=start["tool_choice"], seed=start["seed"], constrain=start.get("constrain", True))
    agent.replay = [e for e in events if e["event"] == "jump"]
    arc = agent.run(start["task"])
    ours = arc.generated_ids
    first = next((i + 1 for i, (a, b) in enumerate(zip(ours, recorded)) if a != b), None)
    if first is None and len(ours) != len(recorded):
        first = min(len(ours), len(recorded)) + 1
    return arc, first is None, first


def _not_called(**_):
    raise RuntimeError("a replayed tool is never called")
