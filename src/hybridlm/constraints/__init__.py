"""Constraints: the hard mask M_t of the kernel input from a JSON Schema, a regular
expression, a grammar, or the tool calls of a turn (built on llguidance).

Each constraint speaks the engine's protocol (hybridlm.engine.constraint.Constraint):
mask() -> bool tensor [V] | None, advance(token), finished, describe().
"""

from hybridlm.constraints.calls import (
    CLOSE, OPEN, ToolCall, ToolCallConstraint, call_is_open, parse_calls, tool_call_constraint, tool_schema,
)
from hybridlm.constraints.grammar import (
    GrammarConstraint, closing_witness, grammar_constraint, json_schema_constraint, regex_constraint,
)
from hybridlm.constraints.library import library_tokenizer

__all__ = [
    "CLOSE", "OPEN", "GrammarConstraint", "ToolCall", "ToolCallConstraint", "call_is_open", "closing_witness",
    "grammar_constraint", "json_schema_constraint", "library_tokenizer", "parse_calls", "regex_constraint",
    "tool_call_constraint", "tool_schema",
]
