"""A hybrid system in the HyEQ sense, as functions of a sequence's state (docs/theory.md §4).

    H = (C, f, D, g):   ẋ ∈ f(x) while x ∈ C,   x⁺ ∈ g(x) when x ∈ D

For a language model the flow map f is one token step, w_{t+1} ~ p_θ,u(· | s_t),
x_{t+1} = F(x_t, w_{t+1}); it is the same for every kind of sequence and is the engine's. A
`HybridSystem` says the rest: when the sequence may flow (C), when it must jump (D), what the
jump map does (g: the external work that runs in q_E, then the tokens it injects), which
inputs of its own shape the kernel (a mask), and what an emitted token means to its discrete
part (a finished answer, an opened call). The engine's solver applies the horizons and the
priority rule for states in C ∩ D.

`Generation` is plain generation: C = not finished, D = ∅.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from hybridlm.engine.arc import Termination


class Priority(str, enum.Enum):
    """What the solver does with a state in C ∩ D (HyEQ's `rule`: 1 jumps first, 2 flows first)."""

    JUMPS = "jumps"
    FLOWS = "flows"


class HybridSystem:
    """The dynamics of one kind of sequence; subclasses override what differs."""

    # ------------------------------------------------------------------ C and f
    def flow_set(self, s) -> bool:
        """x ∈ C: the sequence may take a token step (the solver adds the token budget)."""
        return s.finished is False

    def flow_mask(self, s) -> torch.Tensor | None:
        """An allowed set [V] of this system's own for the next token (beside the constraint's)."""
        return None

    def controlled(self, s) -> bool:
        """Whether the sequence's controllers act at this step (their kernel inputs)."""
        return True

    def flowed(self, s, token: int) -> None:
        """After x_{t+1} = F(x_t, w): what the token means (a stop token ends the flow)."""
        if token in s.stop_ids:
            s.finished = Termination.STOP_TOKEN
        elif s.constraint is not None and s.constraint.finished:
            s.finished = Termination.CONSTRAINT

    def phase_of(self, s) -> str:
        """The phase of the flow: constrained while a constraint restricts the tokens."""
        return "constrained" if s.constraint is not None and not s.constraint.finished else "decode"

    # ------------------------------------------------------------------ D and g
    def jump_set(self, s) -> bool:
        """x ∈ D: the sequence must jump (the solver checks the jump horizon)."""
        return False

    def jumps_elsewhere(self, s) -> bool:
        """x ∈ D whose jump map runs outside this engine (a client runs the tool): the arc ends in
        D with termination cause `jump_set`, and a later sequence continues from its state."""
        return False

    def jump(self, s) -> Callable[[], Any]:
        """g, first part: the external work of the jump, run in q_E on a worker thread."""
        raise NotImplementedError

    def landed(self, s, result: Any) -> list[int]:
        """g, second part: the work's result arrived; count the jump(s) (`s.count_jump()`), record
        them, and return enc(y), the tokens to inject through a prefill."""
        raise NotImplementedError

    def cancel_jump(self, s) -> None:
        """The sequence left the engine while its external work ran."""

    # ------------------------------------------------------------------ the end
    def summary(self, s) -> dict:
        """What the end event of sequence s records beyond the totals (e.g. the agent's answer)."""
        return {}

    def ended(self, s) -> None:
        """The arc ended (s.arc.termination is set): make `s.result` from it."""

    def describe(self, s) -> dict:
        """What the start event of sequence s records about the system."""
        return {"system": type(self).__name__}


class Generation(HybridSystem):
    """Plain generation: the token-clock recursion until a stop token, the constraint's end, a
    stop string or the token budget."""

    def __init__(self, stop_strings: tuple[str, ...] = (), tokenizer=None) -> None:
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokenizer = tokenizer

    def flowed(self, s, token: int) -> None:
        super().flowed(s, token)
        if s.finished is False and self.stop_strings and self.tokenizer is not None:
            tail = self.tokenizer.decode(s.generated[-(max(map(len, self.stop_strings)) + 2):])
            if any(stop in tail for stop in self.stop_strings):
                s.finished = Termination.STOP_SEQUENCE

    def describe(self, s) -> dict:
        out = {"system": "generation", "prompt_tokens": len(s.prompt)}
        if self.stop_strings:
            out["stop"] = list(self.stop_strings)
        return out
