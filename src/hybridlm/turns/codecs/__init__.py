"""Call formats: one codec per way a family of models writes tool calls (hybridlm.turns.codecs.base).

`codec_for` reads a model's chat template for the markers of its format, as llama.cpp's
common/chat.cpp recognises a template (and vLLM's `--tool-call-parser` overrides it):

- `[TOOL_CALLS]`: `mistral`, the second generation (`name[ARGS]{…}`) where the template writes
  `[ARGS]`, with ids where it writes `[CALL_ID]`; else the first (a JSON array of calls);
- `<tool_call>` with JSON inside (not the XML of Qwen3-Coder, GLM or MiniMax): `hermes` (Qwen2.5,
  Qwen3, Hermes 2/3, SmolLM3);
- Llama 3's header tokens with the `ipython` role or `<|python_tag|>`: `llama3_json`;
- a list of Python calls, `[func_name1(params_name1=…)]` as Llama 3.2's pythonic template teaches
  it, or between LFM2's `<|tool_call_start|>` and `<|tool_call_end|>` (a template that writes them or
  lists the tools as "List of tools: "): `pythonic`;
- anything else, or no template: `tagged_json`, the project's default format, which a system
  prompt of the project's own teaches (docs/agent.md). A template that names a format but takes
  no `tools` variable gets that format's own system prompt the same way.
"""

from __future__ import annotations

from hybridlm.errors import InputError
from hybridlm.turns.codecs.base import CallCodec, PartialCall, ToolCall
from hybridlm.turns.codecs.llama3_json import Llama3JSON
from hybridlm.turns.codecs.mistral import Mistral
from hybridlm.turns.codecs.pythonic import Pythonic
from hybridlm.turns.codecs.tagged_json import Hermes, TaggedJSON

TAGGED_JSON = TaggedJSON()
HERMES = Hermes()
LLAMA3_JSON = Llama3JSON()
DEFAULT = TAGGED_JSON.name
# markers of the formats that put XML, not JSON, inside <tool_call> (Qwen3-Coder, GLM, MiniMax): not Hermes
XML_CALLS = ("<function=", "<arg_key>", "<invoke name=")
LFM2_CALLS = ("<|tool_call_start|>", "<|tool_call_end|>")
CODECS: dict[str, CallCodec] = {c.name: c for c in (TAGGED_JSON, HERMES, LLAMA3_JSON, Mistral(), Pythonic())}


def template_of(model) -> str:
    """The chat template's source of a model or a tokenizer ("" when it has none)."""
    tokenizer = getattr(model, "tokenizer", model)
    return getattr(tokenizer, "chat_template", None) or ""


def detect(template: str) -> CallCodec:
    """The call format a chat template's source speaks (`tagged_json` when it names none)."""
    if "[TOOL_CALLS]" in template:
        if "[ARGS]" in template:
            return Mistral(2, call_ids="[CALL_ID]" in template)
        return Mistral(1)
    if LFM2_CALLS[0] in template or "List of tools: " in template:  # (as llama.cpp tells LFM2 and LFM2.5)
        return Pythonic(*LFM2_CALLS)
    if "[func_name1(" in template:
        return Pythonic()
    if "<tool_call>" in template and not any(m in template for m in XML_CALLS):
        return HERMES
    if "<|start_header_id|>" in template and ("ipython" in template or "<|python_tag|>" in template) \
            and "<function=" not in template:  # (Functionary's calls are XML-tagged)
        return LLAMA3_JSON
    return TAGGED_JSON


def codec_for(model=None, *, name: str | None = None) -> CallCodec:
    """The call format named `name` (one of CODECS), else the model's own: the one its
    `tool_call_parser` names (set by the CLI's --tool-call-parser), else the one its chat template
    speaks (`model`: a model or its tokenizer)."""
    template = template_of(model) if model is not None else ""
    if name is None:
        name = getattr(model, "tool_call_parser", None)
    if name is not None:
        if name not in CODECS:
            raise InputError(f"tool-call parser {name!r}: expected one of {', '.join(CODECS)}")
        if name in ("mistral", "pythonic"):  # the generation (the delimiters) are the template's
            found = detect(template)
            return found if isinstance(found, type(CODECS[name])) else CODECS[name]
        return CODECS[name]
    return detect(template)


__all__ = ["CODECS", "DEFAULT", "HERMES", "LLAMA3_JSON", "TAGGED_JSON", "CallCodec", "Hermes", "Llama3JSON", "Mistral",
           "PartialCall", "Pythonic", "TaggedJSON", "ToolCall", "codec_for", "detect", "template_of"]
