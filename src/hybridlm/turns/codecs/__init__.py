"""Call formats: one codec per way a family of models writes tool calls (hybridlm.turns.codecs.base).

`codec_for` picks a model's format; today every model writes the tagged-JSON format
(`<tool_call>{"name": …, "arguments": {…}}</tool_call>`). A new format is a `CallCodec`
subclass registered in `CODECS`; nothing above this package changes.
"""

from __future__ import annotations

from hybridlm.errors import InputError
from hybridlm.turns.codecs.base import CallCodec, PartialCall, ToolCall
from hybridlm.turns.codecs.tagged_json import TaggedJSON

TAGGED_JSON = TaggedJSON()
CODECS: dict[str, CallCodec] = {TAGGED_JSON.name: TAGGED_JSON}


def codec_for(model=None, *, name: str | None = None) -> CallCodec:
    """The call format named `name`, else the one `model`'s family writes (the tagged-JSON
    format for every family so far)."""
    if name is not None:
        if name not in CODECS:
            raise InputError(f"call format {name!r}: expected one of {', '.join(CODECS)}")
        return CODECS[name]
    return TAGGED_JSON


__all__ = ["CODECS", "TAGGED_JSON", "CallCodec", "PartialCall", "TaggedJSON", "ToolCall", "codec_for"]
