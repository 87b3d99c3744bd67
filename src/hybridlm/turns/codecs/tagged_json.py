"""The tagged-JSON call format: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, in two codecs.

- `tagged_json`, the project's default format, for a model whose chat template takes no tools
  (a base model, SmolLM2): a system prompt of the project's own teaches it, and results are
  wrapped in `<tool_response>` tags by the codec.
- `hermes`, the format of the models trained on it (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3): their
  template lists the tools, writes each call on lines of its own between the tags and wraps the
  results; the grammar writes calls as the template does. A small model of the family often opens
  its turn with the call's object and no tags, bare or in a ```json block, often pretty-printed
  (Qwen2.5-Coder-0.5B does): read leniently, as llama.cpp's Hermes parser reads it, that turn is the
  same calls (`tagged`), and the grammar of a turn that calls lets it be such calls (`untagged_rules`),
  so free text in "auto" may not begin with `{` or ```json.

A call is a JSON object with the tool's name and its arguments between the tags; several
calls in one turn follow each other (a newline between them allowed) and end the turn. A
tool's result comes back as `<tool_response>y</tool_response>` in a turn of role `tool`.
The system prompt shows the format and lists each tool's JSON schema on a line of its own.

`parse_calls` reads what a model wrote without any mask (the "free" baseline) into calls, or
one line that says what is wrong; it never raises, whatever the text. The grammar of a
constrained turn is llguidance's Lark with each call's JSON an inline `%json` schema: the
name is one of the offered tools and the arguments follow that tool's schema; "auto" is
lazy (free text until the model writes `<tool_call>`, constrained from there).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence

from hybridlm.constraints import library
from hybridlm.constraints.calls import argument_schemas
from hybridlm.turns.codecs.base import CallCodec, PartialCall, ToolCall, token_literal
from hybridlm.turns.codecs.json_text import as_json, closing_tag, scan_object

_decoder = json.JSONDecoder()

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MAX_CALL_CHARS = 1_000_000  # a call longer than this is not parsed (bounds the parser's time)
# A turn that opens with a call's object without the tags, bare or in a ```json block (what lenient
# parsers such as llama.cpp's Hermes parser also accept): the Hermes codec reads it as calls.
FENCE = "```json"
BARE = re.compile(r'[ \t\r\n]*(?:```(?:json)?[ \t]*\r?\n[ \t\r\n]*)?(?=\{[ \t\r\n]*"name")')
FENCES = re.compile(r"(?:[ \t\r\n]*```(?:json)?(?=[ \t]*\r?\n))*[ \t\r\n]*")  # between bare objects: fences, blanks
NOT_BARE = r"~/[ \t\r\n]*(```json[ \t\r\n]*)?\{(?s:.*)/"  # (Lark: text that does not open so)

INSTRUCTIONS = (
    "You are a helpful assistant that can call tools. To call a tool, reply with exactly\n"
    f'{OPEN}{{"name": TOOL_NAME, "arguments": {{...}}}}{CLOSE}\n'
    f"and wait: the result comes back as {RESPONSE_OPEN}...{RESPONSE_CLOSE}. "
    "Then answer the user in one short sentence that states the result.\n"
    "If the result is an error, read it, fix the arguments and call again.\n"
)
TOOLS_HEADER = "Tools (JSON schemas):\n"


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
        if error is not None or call is None:
            return calls, f"call {len(calls) + 1}: {error}"
        calls.append(call)
    return calls, None


def call_end(text: str, start: int, *, partial: bool = False) -> int:
    """Where the call whose body starts at `start` is closed: the </tool_call> right after its JSON
    object, else the first </tool_call> outside a JSON string (a string argument may hold the tag
    itself); −1 when the call is not closed. For finished text (`partial` false) whose JSON is
    broken, the first </tool_call> at all."""
    return closing_tag(text, start, CLOSE, partial=partial)


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
    return read_call(body, names)


def read_call(body: str, names: set[str] | None, *, keys: tuple[str, ...] = ("arguments",),
              exact: bool = True) -> tuple[ToolCall | None, str | None]:
    """One call's JSON object: its "name" (one of `names`, when given) and its arguments under the first of
    `keys` it has (an object, or a JSON string of one); `exact`: no other key. Never raises."""
    try:
        obj = json.loads(body)
    except RecursionError:
        return None, "JSON nested too deeply"
    except ValueError as exc:
        return None, f"not JSON ({str(exc).splitlines()[0][:120]})"
    if not isinstance(obj, dict):
        return None, f'expected {{"name": ..., "{keys[0]}": {{...}}}}, got a JSON {type(obj).__name__}'
    key = next((k for k in keys if k in obj), keys[0])
    name, arguments = obj.get("name"), obj.get(key, {})
    if not isinstance(name, str):
        return None, f'"name" must be a string, got {_short(name)}'
    if names is not None and name not in names:
        return None, f"unknown tool {name[:80]!r}; tools: {sorted(names)[:8]}"
    if isinstance(arguments, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None, f'"{key}" is a string that is not a JSON object'
    if not isinstance(arguments, dict):
        return None, f'"{key}" must be an object, got {_short(arguments)}'
    extra = set(obj) - {"name", *keys}
    if exact and extra:
        return None, f"unexpected keys {sorted(extra)[:4]} beside name and {key}"
    return ToolCall(name, arguments), None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def call_text(name: str, arguments: dict) -> str:
    """One call as the model writes it (and the prompt and the constraint spell it)."""
    return f"{OPEN}{as_json({'name': name, 'arguments': arguments})}{CLOSE}"


# ---------------------------------------------------------------------- the grammar
def _call_schema(name: str, arguments: dict, name_key: str = "name", arguments_key: str = "arguments",
                 extra: dict | None = None) -> dict:
    properties = {name_key: {"const": name}, arguments_key: arguments, **(extra or {})}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def call_body(tools: dict[str, dict], max_string: int | None, *, name_key: str = "name",
              arguments_key: str = "arguments", extra: dict | None = None, pretty: bool = False) -> str:
    """An inline %json schema of one call's object: the name one of `tools`, the arguments its schema
    (`pretty`: written compact or pretty-printed, library.JSON_PRETTY; else compact, as templates write it)."""
    arguments, defs = argument_schemas(tools, max_string)
    layout = library.JSON_PRETTY if pretty else library.JSON_FORMAT
    body: dict = {"anyOf": [_call_schema(n, arguments[n], name_key, arguments_key, extra) for n in tools],
                  "x-guidance": {**layout, "lenient": True}}
    if defs:
        body["$defs"] = defs
    return f"%json {json.dumps(body)}"


def repeat(parallel: bool, max_calls: int | None, separator: str = '"\\n"?', item: str = "call", *,
           trail: str = "") -> str:
    """The Lark suffix of the calls after the first: none, at most max_calls − 1, or any number. `trail`: what may
    follow a call where another could still follow it, and end the turn there (never after the last call allowed)."""
    if not parallel or max_calls == 1:
        return ""
    if not max_calls:
        return f" ({separator} {item})*" + (f" {trail}?" if trail else "")
    if not trail:
        return f" ({separator} {item}){{0,{max_calls - 1}}}"
    before_last = f" ({separator} {item}){{0,{max_calls - 2}}}" if max_calls > 2 else ""
    return f"{before_last} ({separator} {item} | {trail})?"


def no_call(opening: str, *, bare: bool = False) -> str:
    """The Lark rule of a turn's text that never writes `opening` (`bare`: nor opens with a bare call)."""
    rule = f"/(?s:.*)/ & ~/(?s:.*){_regex(opening)}(?s:.*)/" + (f" & {NOT_BARE}" if bare else "")
    return f"start: NO_CALL\nNO_CALL: {rule}\n"


def _regex(text: str) -> str:
    return "".join(c if c.isalnum() or c in "_<>" else "\\" + c for c in text)


def lark(tools: dict[str, dict], choice: str, parallel: bool, max_calls: int | None, max_string: int | None,
         *, pad: str = "", tokenizer=None, bare: bool = False) -> str:
    """The turn's grammar in llguidance's Lark format, each call's JSON an inline %json schema
    between the tags (`pad`: the text between a tag and the JSON, as the template writes it; a tag
    that is a control token of the vocabulary, as Qwen's are, written as that token). `bare`: a turn
    that calls may also be calls written without the tags, as the model writes them when left free
    (`untagged`), which free text in "auto" may then not begin like; "none" forbids both."""
    if choice == "none":  # (a control token is never allowed where the grammar does not name it)
        return no_call(OPEN, bare=bare)
    p = json.dumps(pad)
    opening, closing = token_literal(tokenizer, OPEN), token_literal(tokenizer, CLOSE)
    lines = [
        f"body: {call_body(tools, max_string)}",
        f"call: {opening} {p} body {p} {closing}",
    ]
    # A newline after a call is whitespace, not yet the next call: the turn may still end after it. (Where
    # only another call could follow it, the mask made the newline the model writes after its call a
    # call the model never chose.)
    newline = '"\\n"'
    more = repeat(parallel, max_calls, trail=newline)
    text = "TEXT: /(?s:.*)/" + (f" & {NOT_BARE}" if bare else "")
    untagged = ""
    if bare:
        untagged = " | bare"
        lines += untagged_rules(tools, parallel, max_calls, max_string)
    if choice == "auto" and opening.startswith("<["):  # free text cannot hold a token: it ends where the call opens
        # (a call may also open the turn, with no text before it)
        lines += ["start: TEXT | TEXT call" + more + " | call" + more + untagged, text]
    elif choice == "auto":
        lines += [
            f"start: TEXT | head {p} body rest" + untagged,
            text,
            f"head[lazy]: TEXT {opening}",
            f"rest: {p} {closing}{more}",
        ]
    else:
        lines += [f"start: call{more}{untagged}"]
    return "\n".join(lines) + "\n"


def untagged_rules(tools: dict[str, dict], parallel: bool, max_calls: int | None, max_string: int | None) -> list[str]:
    """The Lark rules of a turn of calls written without the tags, as a small model of the Hermes family writes
    them when left free: bare objects one per line, or in a ```json block, pretty-printed or compact. Several
    calls in a block are separated by a newline, or each is in a block of its own. What `tagged` reads."""
    newline = '"\\n"'
    return [
        f"pretty: {call_body(tools, max_string, pretty=True)}",
        'between: "\\n" | "\\n```json\\n" | "\\n```\\n```json\\n" | "\\n```\\n\\n```json\\n"',
        f'bare: pretty{repeat(parallel, max_calls, newline, "pretty", trail=newline)}'
        f' | "```json\\n" pretty{repeat(parallel, max_calls, "between", "pretty")} "\\n```" {newline}?',
    ]


# ---------------------------------------------------------------------- the codec
class TaggedJSON(CallCodec):
    """`<tool_call>{"name": …, "arguments": {…}}</tool_call>`, results in `<tool_response>` tags."""

    name = "tagged_json"
    opening = OPEN
    templated = False
    pad = ""  # the text between a tag and the call's JSON

    def tools_prompt(self, schemas: Sequence[dict], *, rules: str = "") -> str:
        return INSTRUCTIONS + rules + TOOLS_HEADER + "\n".join(as_json(s) for s in schemas)

    def render_calls(self, text: str, calls: Sequence[tuple[str, str]]) -> str:
        p = self.pad
        return text + "\n".join(f'{OPEN}{p}{{"name": {as_json(name)}, "arguments": {arguments}}}{p}{CLOSE}'
                                for name, arguments in calls)

    def render_result(self, result: str) -> str:
        return f"{RESPONSE_OPEN}{result}{RESPONSE_CLOSE}"

    def parse(self, text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
        return parse_calls(text, tools)

    def complete_calls(self, text: str, tools: Iterable[str] | None = None) -> list[ToolCall]:
        if OPEN not in text or CLOSE not in text:
            return []
        return parse_calls(text[: text.rfind(CLOSE) + len(CLOSE)], tools)[0]

    def scan(self, text: str, *, final: bool) -> list[PartialCall]:
        out = []
        for start, end in call_spans(text, partial=not final):  # (a string argument may hold </tool_call>)
            closed = end >= 0
            name, arguments, complete = scan_object(text[start:end] if closed else text[start:])
            out.append(PartialCall(name, arguments, complete and closed or (final and complete)))
        return out

    def is_open(self, text: str) -> bool:
        return call_is_open(text)

    def raw_call(self, text: str) -> str:
        return text.rsplit(OPEN, 1)[-1].split(CLOSE)[0]

    def grammar(self, tools: dict[str, dict], choice: str, *, parallel: bool, max_calls: int | None,
                max_string: int | None, tokenizer=None) -> str:
        return lark(tools, choice, parallel, max_calls, max_string, pad=self.pad, tokenizer=tokenizer)


class Hermes(TaggedJSON):
    """The Hermes format as Qwen2.5/Qwen3, Hermes 2/3 and SmolLM3 are trained on it: the template lists
    the tools and wraps the results; a call is `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`."""

    name = "hermes"
    templated = True
    pad = "\n"
    bare_openings = ("{", " {", "\n{", "```json")

    def render_result(self, result: str) -> str:
        return f"{RESPONSE_OPEN}\n{result}\n{RESPONSE_CLOSE}"

    # A turn that opens with bare calls is read as the same calls between the tags (`tagged`).
    def parse(self, text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
        return super().parse(tagged(text), tools)

    def complete_calls(self, text: str, tools: Iterable[str] | None = None) -> list[ToolCall]:
        return super().complete_calls(tagged(text), tools)

    def scan(self, text: str, *, final: bool) -> list[PartialCall]:
        return super().scan(tagged(text), final=final)

    def is_open(self, text: str) -> bool:
        return super().is_open(tagged(text))

    def began(self, text: str) -> bool:
        return super().began(tagged(text))

    def free_text(self, text: str) -> str:
        return super().free_text(tagged(text))

    def without_open_call(self, text: str) -> str:
        return super().without_open_call(tagged(text))

    def raw_call(self, text: str) -> str:
        return super().raw_call(tagged(text))

    def opening_tail(self, text: str) -> int:
        return len(text) if may_open_bare(text) else super().opening_tail(text)

    def grammar(self, tools: dict[str, dict], choice: str, *, parallel: bool, max_calls: int | None,
                max_string: int | None, tokenizer=None) -> str:
        return lark(tools, choice, parallel, max_calls, max_string, pad=self.pad, tokenizer=tokenizer, bare=True)


def tagged(text: str) -> str:
    """A turn that opens with calls written without the tags (bare JSON objects one after another, or
    in a ```json block), written with them: the objects as far as written, each between the tags
    (the last left open while its JSON is), what follows them dropped. Any other text is itself."""
    m = BARE.match(text) if isinstance(text, str) else None
    if m is None:
        return text
    out, i = [], m.end()
    while i < len(text) and text[i] == "{":
        try:
            _, j = _decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            out.append(f"{OPEN}\n{text[i:]}")
            break
        out.append(f"{OPEN}\n{text[i:j]}\n{CLOSE}")
        fences = FENCES.match(text, j)  # (the next object may be in a block of its own)
        i = fences.end() if fences else j
    return "\n".join(out)


def may_open_bare(text: str) -> bool:
    """Free text that a later token may still make the opening of a bare call (a stream holds it back)."""
    rest = text.lstrip(" \t\r\n")
    if not rest:
        return False
    if rest.startswith("```"):
        head, newline, rest = rest.partition("\n")
        if not newline:
            return FENCE.startswith(head.rstrip()) or head.rstrip() == "```"
        if head.rstrip() not in ("```", FENCE):
            return False
        rest = rest.lstrip(" \t\r\n")
        if not rest:
            return True
    compact = re.sub(r"\s+", "", rest)
    return '{"name"'.startswith(compact)
