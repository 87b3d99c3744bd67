"""Tool calls: the text format, its free parser, and the tool-call constraint.

A call is `<tool_call>{"name": <tool>, "arguments": {...}}</tool_call>`; several calls in
one turn follow each other (a newline between them allowed) and end the turn.

`parse_calls` reads what a model wrote without any mask (the "free" baseline) into calls,
or one line that says what is wrong; it never raises, whatever the text.

`tool_call_constraint` is the mask for a turn that may or must call tools: the name is one
of the offered tools and the arguments follow that tool's JSON Schema, compiled by
llguidance. tool_choice "auto" is lazy: free text until the model writes `<tool_call>`,
constrained from there; "required" starts the turn with a call; "none" lets no call open;
a tool's name forces a call of that tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from hybridlm.constraints import library
from hybridlm.constraints.grammar import TAIL, GrammarConstraint, closing_witness
from hybridlm.errors import InputError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 1_000_000  # a call longer than this is not parsed (bounds the parser's time)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


# ---------------------------------------------------------------------- the free parser
def parse_calls(text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
    """The calls in `text` (what follows each <tool_call> up to its </tool_call>), and an error.

    The error is None when every call parsed; otherwise one line naming the first bad call
    (the calls before it are returned). `tools`, when given, are the names a call may use.
    """
    try:
        return _parse(text, None if tools is None else set(tools))
    except Exception as exc:  # noqa: BLE001 - hostile text gets an error line, never an exception
        return [], f"unparsable tool call ({type(exc).__name__})"


def _parse(text: str, names: set[str] | None) -> tuple[list[ToolCall], str | None]:
    if not isinstance(text, str):
        return [], f"expected text, got {type(text).__name__}"
    calls: list[ToolCall] = []
    if OPEN not in text:
        return [], f"no {OPEN} in the text"
    for start, end in call_spans(text):
        if end < 0:
            return calls, f"call {len(calls) + 1}: {OPEN} is never closed by {CLOSE}"
        call, error = _one_call(text[start:end], names)
        if error is not None:
            return calls, f"call {len(calls) + 1}: {error}"
        calls.append(call)
    return calls, None


_decoder = json.JSONDecoder()
# a JSON string (closed, or running to the end of a text still being written) or the closing tag
_STRING_OR_CLOSE = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|' + re.escape(CLOSE), re.S)


def call_end(text: str, start: int, *, partial: bool = False) -> int:
    """Where the call whose body starts at `start` is closed: the </tool_call> right after its JSON
    object, else the first </tool_call> outside a JSON string (a string argument may hold the tag
    itself); −1 when the call is not closed. For finished text (`partial` false) whose JSON is
    broken, the first </tool_call> at all."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    try:
        _, j = _decoder.raw_decode(text, i)
    except (ValueError, RecursionError):
        for m in _STRING_OR_CLOSE.finditer(text, start):
            if m.group() == CLOSE:
                return m.start()
        return -1 if partial else text.find(CLOSE, start)
    while j < len(text) and text[j] in " \t\r\n":
        j += 1
    return j if text.startswith(CLOSE, j) else text.find(CLOSE, j)


def call_spans(text: str, *, partial: bool = False) -> Iterator[tuple[int, int]]:
    """(start, end) of each call's body in the text, in order: from after <tool_call> to its
    </tool_call> (call_end); the last has end −1 when it is not closed."""
    at = text.find(OPEN)
    while at >= 0:
        start = at + len(OPEN)
        end = call_end(text, start, partial=partial)
        yield start, end
        at = text.find(OPEN, end + len(CLOSE)) if end >= 0 else -1


def call_is_open(text: str) -> bool:
    """The text's last <tool_call> has not been closed yet (the text is still being written)."""
    return any(end < 0 for _, end in call_spans(text, partial=True))


def _one_call(body: str, names: set[str] | None) -> tuple[ToolCall | None, str | None]:
    if len(body) > MAX_CALL_CHARS:
        return None, f"{len(body)} characters, more than {MAX_CALL_CHARS}"
    try:
        obj = json.loads(body)
    except RecursionError:
        return None, "JSON nested too deeply"
    except ValueError as exc:
        return None, f"not JSON ({str(exc).splitlines()[0][:120]})"
    if not isinstance(obj, dict):
        return None, f'expected {{"name": ..., "arguments": {{...}}}}, got a JSON {type(obj).__name__}'
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str):
        return None, f'"name" must be a string, got {_short(name)}'
    if names is not None and name not in names:
        return None, f"unknown tool {name[:80]!r}; tools: {sorted(names)[:8]}"
    if isinstance(arguments, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None, '"arguments" is a string that is not a JSON object'
    if not isinstance(arguments, dict):
        return None, f'"arguments" must be an object, got {_short(arguments)}'
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return None, f"unexpected keys {sorted(extra)[:4]} beside name and arguments"
    return ToolCall(name, arguments), None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------- the constraint
TOOL_CHOICES = ("auto", "required", "none")


class ToolCallConstraint(GrammarConstraint):
    """The mask of a turn with tools; `calls()` gives the parsed calls once `finished`."""

    def __init__(self, tokenizer, grammar: str, *, tools: list[str], tool_choice: str, parallel: bool,
                 budget: int | None, vocab_size: int | None) -> None:
        super().__init__(tokenizer, grammar, kind="tool_call",
                         source={"tools": tools, "tool_choice": tool_choice, "parallel": parallel},
                         budget=budget, vocab_size=vocab_size)
        self.tools, self.tool_choice, self.parallel = tools, tool_choice, parallel

    @property
    def in_call(self) -> bool:
        """A call is open: the model wrote <tool_call> and has not closed it yet."""
        return call_is_open(self.text)

    def _closing_token(self) -> int | None:
        """The budget closes an open call in time; after a complete call, no further call opens in
        the last TAIL tokens (it could not close); free text ends at the solver's token budget instead."""
        if self.in_call:
            return super()._closing_token()
        left = self.remaining
        if left is not None and left <= TAIL and self.parallel and CLOSE in self.text and not self.finished:
            witness = closing_witness(self.matcher, self.lib, limit=left) if left else None
            return witness[0] if witness else None
        return None

    def calls(self) -> list[ToolCall]:
        """The calls written so far (complete ones only), in order."""
        text = self.text
        if OPEN not in text:
            return []
        calls, _ = parse_calls(text[: text.rfind(CLOSE) + len(CLOSE)] if CLOSE in text else "", self.tools)
        return calls

    def answer(self) -> str:
        """The free text of the turn (before any call)."""
        text = self.text
        return text.split(OPEN, 1)[0]


def tool_call_constraint(tokenizer, tools, tool_choice="auto", *, parallel: bool = False,
                         max_calls: int | None = None, budget: int | None = None, max_string: int | None = None,
                         vocab_size: int | None = None) -> ToolCallConstraint:
    """The tool-call constraint of one turn.

    tools: the offered tools (objects with .name and .parameters, e.g. a ToolRegistry, or
    dicts {"name", "parameters"}). tool_choice: "auto", "required", "none", a tool's name,
    or OpenAI's {"type": "function", "function": {"name": ...}}. parallel: several calls
    in the turn (at most max_calls), else exactly one. budget: tokens the constraint may
    take in all (the call is closed in time); max_string: the longest string argument
    (characters) where the schema sets no shorter maxLength.
    """
    specs = _specs(tools)
    choice = _choice(tool_choice, specs)
    if max_calls is not None and max_calls < 1:
        raise InputError(f"max_calls={max_calls}: expected ≥ 1")
    if max_string is not None and max_string < 0:
        raise InputError(f"max_string={max_string}: expected ≥ 0")
    offered = specs if choice in ("auto", "required", "none") else {choice: specs[choice]}
    if not offered and choice != "none":
        raise InputError("tool_call_constraint: no tools offered; use tool_choice='none'")
    names = list(offered)
    lib = library.library_tokenizer(tokenizer)
    for name, params in offered.items():  # each schema on its own first: the error names the tool
        library.matcher(lib, library.json_grammar(tool_schema(params, max_string), lenient=True), f"tool {name}")
    grammar = library.lark_grammar(_lark(offered, choice, parallel, max_calls, max_string))
    return ToolCallConstraint(tokenizer, grammar, tools=names, tool_choice=choice if isinstance(choice, str) else "",
                              parallel=parallel, budget=budget, vocab_size=vocab_size)


def _specs(tools) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for t in tools if tools is not None else []:
        name = t["name"] if isinstance(t, dict) else getattr(t, "name", None)
        params = t.get("parameters", {}) if isinstance(t, dict) else getattr(t, "parameters", {})
        if not isinstance(name, str) or not name:
            raise InputError(f"tool {_short(t)}: expected a name (a non-empty string)")
        if not isinstance(params, dict):
            raise InputError(f"tool {name}: parameters must be a JSON Schema object, got {_short(params)}")
        kind = params.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise InputError(f"tool {name}: parameters must be a schema of type object (a call's arguments are "
                             f"named), got type {_short(kind)}")
        out[name] = params or {"type": "object"}
    return out


def _choice(tool_choice, specs: dict) -> str:
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    if tool_choice in TOOL_CHOICES:
        return tool_choice
    if isinstance(tool_choice, str) and tool_choice in specs:
        return tool_choice
    raise InputError(f"tool choice {tool_choice!r}: expected auto, required, none or one of the tools "
                     f"{sorted(specs)[:8]}")


def tool_schema(schema, max_string: int | None = None):
    """A tool's argument schema as the constraint enforces it.

    Objects that list their properties take no others (a function rejects unknown keyword
    arguments; JSON Schema's default would let a model invent keys), unless the schema says
    so with additionalProperties or patternProperties (a required key missing from the
    properties is added to them, with any value); with max_string, every free string
    (no enum, const or format) is at most max_string characters.
    """
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {k: tool_schema(v, max_string) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not", "contains") and isinstance(value, dict):
            out[key] = tool_schema(value, max_string)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            out[key] = [tool_schema(v, max_string) for v in value]
        else:
            out[key] = value
    kinds = out.get("type")
    is_string = kinds == "string" or (isinstance(kinds, list) and "string" in kinds)
    if max_string is not None and is_string and not {"enum", "const", "format"} & set(out):
        out["maxLength"] = min(out.get("maxLength", max_string), max_string)
    if "properties" in out and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
        # a required key the properties do not describe stays writable, with any value
        missing = [k for k in out.get("required") or [] if isinstance(k, str) and k not in out["properties"]]
        if missing and isinstance(out["properties"], dict):
            out["properties"] = {**out["properties"], **{k: {} for k in missing}}
    return out


def _call_schema(name: str, arguments: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rebase_refs(schema, base: str):
    """The schema with every `$ref` into itself ("#/…") pointing at the same place under `base`."""
    if isinstance(schema, dict):
        out = {k: _rebase_refs(v, base) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def _arguments(specs: dict, max_string: int | None) -> tuple[dict, dict]:
    """Each tool's argument schema as the call's "arguments", and the root's $defs: a schema that
    refers into itself (its own $defs, "#") is moved under the root's $defs and its pointers
    rebased, since inside the turn's schema "#" is the root (an MCP server's nested models)."""
    arguments, defs = {}, {}
    for i, (name, params) in enumerate(specs.items()):
        schema, key = tool_schema(params, max_string), f"tool{i}"
        rebased = _rebase_refs(schema, f"#/$defs/{key}")
        if rebased != schema:  # it refers into itself
            defs[key] = rebased
            arguments[name] = {"$ref": f"#/$defs/{key}"}
        else:
            arguments[name] = schema
    return arguments, defs


def _lark(specs: dict, choice: str, parallel: bool, max_calls: int | None, max_string: int | None) -> str:
    """The turn's grammar in llguidance's Lark format, each call's JSON an inline %json schema."""
    free = "TEXT: /(?s:.*)/"
    if choice == "none":
        return "start: NO_CALL\nNO_CALL: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
    arguments, defs = _arguments(specs, max_string)
    body = {"anyOf": [_call_schema(n, arguments[n]) for n in specs], "x-guidance": {**library.JSON_FORMAT,
                                                                                  "lenient": True}}
    if defs:
        body["$defs"] = defs
    more = "" if not parallel else (f' ("\\n"? call){{0,{max_calls - 1}}}' if max_calls else ' ("\\n"? call)*')
    lines = [
        f"body: %json {json.dumps(body)}",
        f'call: "{OPEN}" body "{CLOSE}"',
    ]
    if choice == "auto":
        lines += [
            "start: TEXT | head body rest",
            free,
            f'head[lazy]: TEXT "{OPEN}"',
            f'rest: "{CLOSE}"{more}',
        ]
    else:
        lines += [f"start: call{more}"]
    return "\n".join(lines) + "\n"
