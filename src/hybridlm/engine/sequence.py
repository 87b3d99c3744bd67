"""One hybrid automaton of the engine's population: its state and its horizons (docs/theory.md §7).

Everything a sequence's arc depends on lives in its `ArcState`: the mode q, the token step t
and jump count k, its own rows of the model's state x, its sampling kernel and its own
generator (so its tokens do not depend on its neighbours in a batch), its constraint and
controllers, the current turn, its messages and its limits. The engine advances many of them
by one token step at a time; a sequence in q_E (its tool running) is not in the step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridlm.engine.arc import Event, HybridArc, Mode, Termination
from hybridlm.engine.sampling import Kernel
from hybridlm.errors import InputError

_ids = itertools.count(1)


@dataclass(frozen=True)
class Limits:
    """The solver's horizons: HyEQ's TSPAN and JSPAN, and the bound on jumps at one instant."""

    max_token_steps: int = 160  # flow horizon: token steps over the whole arc
    max_jumps: int = 3  # jump horizon
    max_jumps_per_step: int = 1  # jumps allowed at one token step (no Zeno behaviour)

    def __post_init__(self) -> None:
        for name in ("max_token_steps", "max_jumps", "max_jumps_per_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{name}={value!r}: expected an integer ≥ 0")


@dataclass(eq=False)
class ArcState:
    """The state of one sequence. `system` gives its flow set C, jump set D and jump map g."""

    system: Any  # a hybridlm.engine.system.HybridSystem
    prompt: list[int]
    kernel: Kernel = Kernel()
    seed: int = 0
    limits: Limits = Limits()
    constraint: Any = None  # a hybridlm.engine.constraint.Constraint, or None
    controls: Any = None  # the sequence's controllers (hybridlm.control.ControlLoop), or None
    stop_ids: frozenset = frozenset()
    observers: list = field(default_factory=list)
    name: str = ""

    # the automaton's variables, set by the engine
    q: Mode = Mode.GENERATE
    t: int = 0  # token steps taken
    k: int = 0  # jumps taken
    x: Any = None  # this sequence's rows of the model's state (KVState or SSMState, batch 1)
    generator: torch.Generator | None = None
    turn: list[int] = field(default_factory=list)  # tokens emitted since the last jump (or the start)
    generated: list[int] = field(default_factory=list)  # every emitted token
    counts: dict[int, int] = field(default_factory=dict)  # c_t(v): how often each token was emitted
    recent: deque = field(default_factory=deque)  # the repeat penalty's window: the context's last n tokens
    messages: list[dict] = field(default_factory=list)
    phase: str = "prefill"
    finished: Termination | bool = False  # False while the flow may go on, else the cause it ended with
    jumps_at: dict[int, int] = field(default_factory=dict)
    arc: HybridArc = field(default_factory=HybridArc)
    pending: Any = None  # the external work of a jump in progress (a Future)
    started: float = 0.0  # perf_counter when the sequence joined
    rebuilds: int = 0  # context-horizon rebuilds of the state
    result: Any = None  # what the system makes of the finished arc (e.g. the agent's answer)
    error: BaseException | None = None  # what ended it, when it ended in an error
    marks: tuple = ()  # positions in the prompt where canonical prefill segments end (message ends)
    task: Any = None  # what the sequence was asked (the agent's task), for its arc
    call: Any = None  # the call whose jump is in progress
    trace_path: str | None = None  # where its trace is written, if anywhere
    continues: Any = None  # a state to continue from, copied into x at admission (it is not changed)
    resume: list[int] = field(default_factory=list)  # tokens to inject into a handed-over state x at admission
    logprobs: int | None = None  # record each token's k most likely alternatives and their log p_θ (None: off)
    cached_tokens: int = 0  # prompt tokens a cached state spared the prefill

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise InputError(f"seed {self.seed!r}: expected an integer 0 ≤ seed ≤ 2^64 − 1")
        if not self.name:
            self.name = f"seq-{next(_ids)}"

    # ------------------------------------------------------------------ derived
    @property
    def done(self) -> bool:
        return self.arc.termination is not None

    @property
    def jumps_allowed(self) -> bool:
        """k below the jump horizon and no more jumps at this token step than allowed."""
        lim = self.limits
        return self.k < lim.max_jumps and self.jumps_at.get(self.t, 0) < lim.max_jumps_per_step

    @property
    def budget_left(self) -> int:
        return self.limits.max_token_steps - self.t

    def hook_pairs(self, model) -> list:
        """The (hook point, fn) pairs that act on this sequence's rows: its controllers' residual
        inputs and its observers' probes (a state recorder)."""
        pairs = list(self.controls.hooks(model)) if self.controls is not None else []
        for obs in self.observers:
            hooks = getattr(obs, "hooks", None)
            if hooks is not None:
                pairs += hooks(model)
        return pairs

    def entered(self, tokens) -> None:
        """Tokens joined the context (the prompt, an observation, an emitted token): the repeat window
        moves on (at admission it is sized by the kernel's `repeat_window`)."""
        self.recent.extend(tokens)

    def count_jump(self) -> None:
        """k ← k + 1 for a jump at this token step."""
        self.k += 1
        self.jumps_at[self.t] = self.jumps_at.get(self.t, 0) + 1

    def wall(self) -> float:
        return round(time.perf_counter() - self.started, 6)

    # ------------------------------------------------------------------ the arc
    def emit(self, kind: str, **data) -> Event:
        """Append an event at the current (t, k, wall) and hand it to the observers."""
        event = Event(kind, self.t, self.k, self.wall(), data)
        self.arc.events.append(event)
        for obs in self.observers:
            obs.on_event(self, event)
        return event

    def enter_phase(self, phase: str, **data) -> None:
        self.phase = phase
        self.emit("phase", phase=phase, mode=str(self.q), **data)

    def terminate(self, cause: Termination, **data) -> None:
        if self.done:
            return
        self.arc.termination = cause
        self.emit("end", stop_reason=cause.value, token_steps=self.t, jumps=self.k,
                  wall_generate_s=round(self.arc.wall_in(Mode.GENERATE), 6),
                  wall_external_s=round(self.arc.wall_in(Mode.EXTERNAL), 6), **data)
        for obs in self.observers:
            end = getattr(obs, "on_end", None)
            if end is not None:
                end(self)
