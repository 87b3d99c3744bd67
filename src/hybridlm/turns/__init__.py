"""The tool-calling turn: the conversation, the call formats, the turn's constraint and the hybrid
system of a conversation with tools, below the agent and the server, which compose it.

- `codecs`: one `CallCodec` per call format (render, parse, partial parse, grammar); `codec_for`.
- `protocol`: the conversation rendered with the model's chat template; enc(y) of the jump map.
- `constraint`: the constraint of one turn (`tool_call_constraint`, `FreeTurn`); `offerable`.
- `system`: `Conversation`, H = (C, f, D, g), and its `Offer`; the jump map runs here or elsewhere.
- `view`: what the turns of an arc show a reader (content, calls), final or streamed.
"""

from typing import TYPE_CHECKING

from hybridlm._lazy import exports

# Imported on first use (hybridlm._lazy): the CLI's options read the codecs' names without PyTorch.
_HOMES = {
    "hybridlm.turns.codecs": ("CODECS", "TAGGED_JSON", "CallCodec", "PartialCall", "TaggedJSON", "ToolCall",
                              "codec_for"),
    "hybridlm.turns.constraint": ("FreeTurn", "ToolCallConstraint", "ToolNotOffered", "offerable",
                                  "tool_call_constraint", "without_grammar"),
    "hybridlm.turns.protocol": ("Protocol",),
    "hybridlm.turns.system": ("Conversation", "Elsewhere", "Offer"),
    "hybridlm.turns.view": ("CallView", "View", "render", "turns_of"),
}
__all__ = [
    "CODECS", "TAGGED_JSON", "CallCodec", "CallView", "Conversation", "Elsewhere", "FreeTurn", "Offer", "PartialCall",
    "Protocol", "TaggedJSON", "ToolCall", "ToolCallConstraint", "ToolNotOffered", "View", "codec_for", "offerable",
    "render", "tool_call_constraint", "turns_of", "without_grammar",
]
__getattr__, __dir__ = exports(__name__, _HOMES, __all__)

if TYPE_CHECKING:
    from hybridlm.turns.codecs import CODECS, TAGGED_JSON, CallCodec, PartialCall, TaggedJSON, ToolCall, codec_for
    from hybridlm.turns.constraint import (
        FreeTurn, ToolCallConstraint, ToolNotOffered, offerable, tool_call_constraint, without_grammar,
    )
    from hybridlm.turns.protocol import Protocol
    from hybridlm.turns.system import Conversation, Elsewhere, Offer
    from hybridlm.turns.view import CallView, View, render, turns_of
