"""Constraints: the hard mask M_t of the kernel input, held by a sequence for a stretch of its arc.

A constraint restricts which tokens a sequence may emit next (a JSON schema, a regular
expression, a grammar, a tool call). At token step t the engine asks it for the allowed set,
applies it as the mask of the kernel input, p_u(v | s_t) ∝ M_t(v) · exp(z_t(v)/τ), and tells it
which token was drawn. It is an input of the system like a controller's mask, recorded in the
arc, and it is per sequence: every row of a batch has its own.

The engine speaks only this protocol; `hybridlm.constraints` builds constraints on a
grammar library.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Constraint(Protocol):
    def mask(self) -> torch.Tensor | None:
        """M_t: a bool tensor [V] of the tokens allowed at the next step, or None where the
        constraint does not restrict this step (e.g. a lazy constraint not yet triggered)."""

    def advance(self, token: int) -> None:
        """Record that `token` was emitted (a token the last mask allowed)."""

    @property
    def finished(self) -> bool:
        """Nothing more may be emitted: the constrained text is complete."""

    def describe(self) -> dict:
        """What the arc records about the constraint (its kind and source)."""
