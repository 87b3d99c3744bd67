"""The hybrid arc as data: what one sequence did, over the hybrid time domain {(t, k)} with wall
time attached (docs/theory.md §4, §7).

In the HyEQ Toolbox's words a solution is a hybrid arc φ(t, j) on a hybrid time domain,
together with the cause that ended it. Here the flow "time" is the token clock t (one step per
token), the jump counter is k (one step per external event), and every event also carries the
wall time `wall_s` since the sequence joined the engine: the two clocks are separate, and how
many token steps a second buys depends on the batch around the sequence.

An arc is a list of `Event`s in the order they happened. The kinds:

- `start`: the sequence's configuration (system, kernel, limits, seed, ...);
- `phase`: a phase change (prefill, decode, constrained, external) and the mode q_G / q_E;
- `token`: one token step of the flow: the token, its text, the model's log p_θ at τ = 1 and the
  kernel's log p beside it (`token_logprobs` reads both, from traces of any version);
- `control`: what a controller did before a token step (removed mass, shift, ...);
- `jump`: one jump: the tool, its arguments, the observation, error and wall duration;
- `batch`: the sequence left or joined the engine's batch (q_E: its tool runs while the
  others keep generating);
- `context`: a jump of the context horizon (the block policy truncated the string);
- `end`: the termination cause and totals.

The trace file is this list written as JSONL as it happens (`hybridlm.engine.trace`);
`HybridArc.read` reads one back.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class Mode(str, enum.Enum):
    """The discrete mode q of the automaton."""

    GENERATE = "q_G"  # the token clock runs: prefill and decode phases
    EXTERNAL = "q_E"  # a tool runs in wall time; no token step happens

    def __str__(self) -> str:
        return self.value


class Termination(str, enum.Enum):
    """Why an arc ended: HyEQ's termination cause, in this system's terms. One enumeration for
    plain generation, the agent and the server."""

    STOP_TOKEN = "stop_token"  # the flow emitted a stop token: the state left C ∪ D
    TOKEN_BUDGET = "token_budget"  # t reached the flow horizon (the token budget)
    JUMP_HORIZON = "jump_horizon"  # the state is in D but k reached the jump horizon
    JUMP_SET = "jump_set"  # stopped in D on purpose: the jump map runs elsewhere (a client-side tool)
    STOP_SEQUENCE = "stop_sequence"  # the text reached one of the caller's stop strings
    CONSTRAINT = "constraint"  # the constrained text is complete (nothing more may follow)
    CANCELLED = "cancelled"  # the caller withdrew the sequence (e.g. a client disconnected)
    ERROR = "error"  # the sequence raised; the error is in the end event

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Event:
    """One event of an arc at hybrid time (t, k) and wall time wall_s."""

    kind: str
    t: int
    k: int
    wall_s: float
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"event": self.kind, "t": self.t, "k": self.k, "wall_s": self.wall_s, **self.data}

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        data = {key: value for key, value in d.items() if key not in ("event", "t", "k", "wall_s")}
        return cls(d["event"], int(d.get("t", 0)), int(d.get("k", 0)), float(d.get("wall_s", 0.0)), data)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


class RateFold:
    """`HybridArc.rates` as a fold over the events in order, so that a reader of a long trace need not hold them:

    - the wall seconds of q_G: its phases (prefill, decode, constrained), each from its phase event to the
      next phase event or to the end of its run (an `end` event, or any event with stage "end", as a
      supervisor's decision has), so the time a supervised model waits between decisions is in no mode;
    - token steps t per second of q_G, and layer steps L · t per second of q_G (L layers from `layers` or
      the start event's `layers`);
    - q_G split into prefill (its prefill phases, with the tokens they took in) and decode (the rest,
      where the token steps are taken): decode steps/s = t / decode seconds;
    - jumps k per token step, and wall seconds per visit of q_E (the jumps' durations, as `wall_in`).

    A value whose denominator is zero is None."""

    def __init__(self, layers: int | None = None) -> None:
        self.layers = layers
        self.start: Event | None = None
        self.last: Event | None = None
        self.steps = self.jumps = self.prefill_tokens = 0
        self.q_G = self.q_E = self.prefill_s = 0.0
        self.opened: Event | None = None  # the phase event of the interval in progress

    def add(self, e: Event) -> None:
        if self.start is None and e.kind == "start":
            self.start = e
        self.steps += e.kind == "token"
        if e.kind == "jump":
            self.jumps += 1
            self.q_E += float(e.get("duration_s", 0.0))
        if self.opened is not None and (e.kind in ("phase", "end") or e.get("stage") == "end"):
            self.q_G, self.prefill_s, self.prefill_tokens = self._closed(self.opened, e.wall_s)
            self.opened = None
        if e.kind == "phase":
            self.opened = e
        self.last = e

    def _closed(self, opened: Event, wall_s: float) -> tuple[float, float, int]:
        """(q_G seconds, prefill seconds, prefill tokens) with the interval `opened` closed at `wall_s`."""
        q_G, prefill_s, prefill_tokens = self.q_G, self.prefill_s, self.prefill_tokens
        seconds = max(wall_s - opened.wall_s, 0.0)
        if opened.get("mode") != Mode.EXTERNAL.value and opened.get("phase") != "external":
            q_G += seconds
        if opened.get("phase") == "prefill":
            prefill_s += seconds
            tokens = opened.get("tokens")
            prefill_tokens += tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
        return q_G, prefill_s, prefill_tokens

    def result(self) -> dict:
        """The table of the events so far (an interval in progress ends at the last event)."""
        def ratio(a, b):
            return a / b if b else None

        q_G, prefill_s, prefill_tokens = self.q_G, self.prefill_s, self.prefill_tokens
        if self.opened is not None and self.last is not None:
            q_G, prefill_s, prefill_tokens = self._closed(self.opened, self.last.wall_s)
        steps, jumps, q_E = self.steps, self.jumps, self.q_E
        L = self.layers if self.layers is not None else (self.start.get("layers") if self.start is not None else None)
        L = L if isinstance(L, int) and not isinstance(L, bool) and L > 0 else None
        decode_s = max(q_G - prefill_s, 0.0)
        return {"token_steps": steps, "jumps": jumps, "layers": L, "wall_q_G_s": q_G, "wall_q_E_s": q_E,
                "token_steps_per_s": ratio(steps, q_G), "layer_steps_per_s": ratio(L * steps, q_G) if L else None,
                "prefill_s": prefill_s, "prefill_tokens": prefill_tokens,
                "prefill_tokens_per_s": ratio(prefill_tokens, prefill_s), "decode_s": decode_s,
                "decode_steps_per_s": ratio(steps, decode_s), "jumps_per_token_step": ratio(jumps, steps),
                "wall_s_per_q_E_visit": ratio(q_E, jumps)}


def format_rates(r: dict) -> str:
    """The rates table (`HybridArc.rates`) as one line of text."""
    def num(v, unit="", places=2):
        return "—" if v is None else f"{v:.{places}f}{unit}"

    layers = f", {num(r['layer_steps_per_s'], '', 1)} layer steps/s (L = {r['layers']})" if r["layers"] else ""
    return (f"{r['token_steps']} token steps in {num(r['wall_q_G_s'], ' s')} of q_G: "
            f"{num(r['token_steps_per_s'])} token steps/s{layers}; prefill {num(r['prefill_s'], ' s')} "
            f"({r['prefill_tokens']} tokens, {num(r['prefill_tokens_per_s'], '', 1)} tokens/s), decode "
            f"{num(r['decode_s'], ' s')} ({num(r['decode_steps_per_s'])} steps/s); {r['jumps']} jumps: "
            f"{num(r['jumps_per_token_step'], '', 3)} per token step, {num(r['wall_s_per_q_E_visit'], ' s', 3)} "
            f"per q_E visit")


def token_logprobs(event) -> tuple[float | None, float | None]:
    """(log p_θ(w | s_t) of the model at τ = 1, log p(w | s_t) under the kernel that drew w) of a token event
    (an Event or its dict); None where the trace did not record it. Traces written before `kernel_logprob`
    was recorded hold the kernel's under `logprob` (0 under greedy decoding) and the model's, when it was
    asked for, under `model_logprob`."""
    if event.get("kernel_logprob") is not None:
        return event.get("logprob"), event.get("kernel_logprob")
    return event.get("model_logprob"), event.get("logprob")


@dataclass
class HybridArc:
    """The events of one sequence, and the cause that ended it (None while it runs)."""

    events: list[Event] = field(default_factory=list)
    termination: Termination | None = None

    # ------------------------------------------------------------------ views
    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    @property
    def tokens(self) -> list[int]:
        """The emitted tokens w_1, w_2, … in order."""
        return [e["token"] for e in self.events if e.kind == "token"]

    @property
    def t(self) -> int:
        """Token steps so far (the flow time reached)."""
        return max((e.t for e in self.events), default=0)

    @property
    def k(self) -> int:
        """Jumps so far."""
        return max((e.k for e in self.events), default=0)

    def jump_times(self) -> list[tuple[int, int, float]]:
        """(t_j, k_j, wall_s) of every jump: the token step it happened at, the jump count after it,
        and the wall time it ended."""
        return [(e.t, e.k, e.wall_s) for e in self.events if e.kind == "jump"]

    def flow_intervals(self) -> list[tuple[int, int, int]]:
        """The hybrid time domain as HyEQ draws it: (k, t_start, t_end) for each interval of flow
        I^k = [t_k, t_{k+1}] between jumps (the last ends at the final t)."""
        bounds = [0] + [t for t, _, _ in self.jump_times()] + [self.t]
        return [(k, bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]

    def restrict(self, *, t: tuple[int, int] | None = None, k: tuple[int, int] | None = None) -> "HybridArc":
        """The arc restricted to t ∈ [t0, t1] and/or k ∈ [k0, k1] (inclusive)."""
        def inside(e: Event) -> bool:
            return ((t is None or t[0] <= e.t <= t[1]) and (k is None or k[0] <= e.k <= k[1]))

        return HybridArc([e for e in self.events if inside(e)],
                         self.termination if (t is None or t[1] >= self.t) and (k is None or k[1] >= self.k) else None)

    def wall_in(self, mode: Mode | str) -> float:
        """Wall seconds spent in a mode: q_E as the sum of the jumps' durations, q_G as the rest."""
        external = sum(float(e.get("duration_s", 0.0)) for e in self.events if e.kind == "jump")
        if str(mode) == Mode.EXTERNAL.value:
            return external
        end = self.events[-1].wall_s if self.events else 0.0
        return max(0.0, end - external)

    def rates(self, layers: int | None = None) -> dict:
        """The arc's clocks against each other (the multi-rate table): see `RateFold`."""
        fold = RateFold(layers)
        for e in self.events:
            fold.add(e)
        return fold.result()

    # ------------------------------------------------------------------ files
    def lines(self) -> Iterator[str]:
        for e in self.events:
            yield json.dumps(e.to_dict(), ensure_ascii=False, default=str)

    def write(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            for line in self.lines():
                fh.write(line + "\n")

    @classmethod
    def from_events(cls, events: Iterable[dict]) -> "HybridArc":
        arc = cls([Event.from_dict(e) for e in events])
        end = next((e for e in reversed(arc.events) if e.kind == "end"), None)
        cause = end.get("stop_reason") if end is not None else None
        arc.termination = Termination(cause) if cause in Termination._value2member_map_ else None
        return arc

    def __len__(self) -> int:
        return len(self.events)
