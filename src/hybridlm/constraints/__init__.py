"""Constraints: the hard mask M_t of the kernel input from a JSON Schema, a regular
expression or a grammar (built on llguidance), and the tool schemas a turn with calls is
constrained by (the call formats and the turn's constraint are hybridlm.turns').

Each constraint speaks the engine's protocol (hybridlm.engine.constraint.Constraint):
mask() -> bool tensor [V] | None, advance(token), finished, describe().
"""

from typing import TYPE_CHECKING

from hybridlm._lazy import exports

# Imported on first use (hybridlm._lazy): the call formats read the tool schemas without PyTorch.
_HOMES = {
    "hybridlm.constraints.calls": ("TOOL_CHOICES", "argument_schemas", "tool_choice_name", "tool_schema",
                                   "tool_specs"),
    "hybridlm.constraints.grammar": ("GrammarConstraint", "closing_witness", "grammar_constraint",
                                     "json_schema_constraint", "regex_constraint"),
    "hybridlm.constraints.library": ("library_tokenizer",),
}
__all__ = [
    "TOOL_CHOICES", "GrammarConstraint", "argument_schemas", "closing_witness", "grammar_constraint",
    "json_schema_constraint", "library_tokenizer", "regex_constraint", "tool_choice_name", "tool_schema", "tool_specs",
]
__getattr__, __dir__ = exports(__name__, _HOMES, __all__)

if TYPE_CHECKING:
    from hybridlm.constraints.calls import TOOL_CHOICES, argument_schemas, tool_choice_name, tool_schema, tool_specs
    from hybridlm.constraints.grammar import (
        GrammarConstraint, closing_witness, grammar_constraint, json_schema_constraint, regex_constraint,
    )
    from hybridlm.constraints.library import library_tokenizer
