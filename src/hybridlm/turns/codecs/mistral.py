"""Mistral's call formats, both generations, after the control token `[TOOL_CALLS]`.

- The first (Mistral 7B v0.3, Nemo, Small up to 3.1): a JSON array of call objects,
  `[TOOL_CALLS][{"name": …, "arguments": {…}, "id": "a1b2c3d4e"}]`.
- The second (Devstral, Small 3.2 and later): each call `[TOOL_CALLS]name[ARGS]{…}`, with
  `[CALL_ID]id` before `[ARGS]` where the template writes ids (Small 3.2).

Every call id is 9 letters or digits (the templates refuse any other); a client's id of
another form is mapped to one. Results come back as `[TOOL_RESULTS]…[/TOOL_RESULTS]`, which
the template writes. `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are control tokens of Mistral's
vocabularies: the grammar writes them as those tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Iterable, Sequence

from hybridlm.constraints import library
from hybridlm.constraints.calls import argument_schemas
from hybridlm.turns.codecs.base import CallCodec, PartialCall, ToolCall, token_literal
from hybridlm.turns.codecs.json_text import as_json, scan_object
from hybridlm.turns.codecs.tagged_json import call_body

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
ID = re.compile(r"[A-Za-z0-9]{9}")
_NAME = re.compile(r"\s*([^\[\]\s{]+)")
_decoder = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits
Item = tuple[str | None, str, bool, str | None]  # (name, arguments' text so far, closed, id)
INSTRUCTIONS = (
    "You are a helpful assistant that can call tools. To call tools, reply with exactly\n"
    f'{TOOL_CALLS}[{{"name": TOOL_NAME, "arguments": {{...}}, "id": NINE_LETTERS_OR_DIGITS}}]\n'
    "and wait for the results. Then answer the user in one short sentence that states the result.\n"
)


def nine(text: str) -> str:
    """A call id of the form Mistral's templates accept: `text` itself when it is one, else 9 letters
    and digits derived from it."""
    if ID.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


class Mistral(CallCodec):
    """`[TOOL_CALLS]` calls: a JSON array (`generation` 1) or `name[ARGS]{…}` (`generation` 2, with
    `[CALL_ID]` where `call_ids`)."""

    name = "mistral"
    opening = TOOL_CALLS

    def __init__(self, generation: int = 1, *, call_ids: bool = False) -> None:
        self.generation, self.call_ids = generation, call_ids

    def __repr__(self) -> str:
        return f"Mistral(generation={self.generation}, call_ids={self.call_ids})"

    def tools_prompt(self, schemas: Sequence[dict], *, rules: str = "") -> str:
        return INSTRUCTIONS + rules + "Tools (JSON schemas):\n" + "\n".join(as_json(s) for s in schemas)

    def call_id(self, index: int, seed: str = "") -> str:
        return nine(f"{seed}/{index}")

    def template_id(self, call_id: str) -> str:
        return nine(call_id)

    def render_calls(self, text: str, calls: Sequence[tuple[str, str]]) -> str:
        if not calls:
            return text
        if self.generation == 1:
            items = [f'{{"name": {as_json(n)}, "arguments": {a}, "id": "{self.call_id(i)}"}}'
                     for i, (n, a) in enumerate(calls)]
            return f"{text}{TOOL_CALLS}[{', '.join(items)}]"
        ids = [f"{CALL_ID}{self.call_id(i)}" if self.call_ids else "" for i in range(len(calls))]
        return text + "".join(f"{TOOL_CALLS}{n}{cid}{ARGS}{a}" for (n, a), cid in zip(calls, ids))

    def render_result(self, result: str) -> str:
        return result

    # ------------------------------------------------------------------ reading
    def _read(self, text: str, *, partial: bool) -> tuple[list[Item], bool, str | None]:
        """Every call after the first [TOOL_CALLS] as far as written, whether the calls' text is closed
        (the array, or the last call's arguments), and an error for finished text that is not the format."""
        at = text.find(TOOL_CALLS)
        if at < 0:
            return [], False, f"no {TOOL_CALLS} in the text"
        i = _skip(text, at + len(TOOL_CALLS))
        if text.startswith("[", i):  # the first generation (a later model may still write it)
            return _array(text, i, partial=partial)
        out: list[Item] = []
        while True:
            m = _NAME.match(text, i)
            if m is None:
                return out, False, None if partial else f"call {len(out) + 1}: expected a tool's name after {TOOL_CALLS}"
            name, i = m.group(1), m.end()
            call_id = None
            if text.startswith(CALL_ID, i):
                end = text.find(ARGS, i)
                if end < 0:
                    out.append((name, "", False, None))
                    return out, False, None if partial else f"call {len(out)}: {CALL_ID} without {ARGS}"
                call_id, i = text[i + len(CALL_ID):end].strip(), end
            if not text.startswith(ARGS, i):
                out.append((name, "", False, call_id))
                return out, False, None if partial else f"call {len(out)}: expected {ARGS} after the name"
            j = _skip(text, i + len(ARGS))
            try:
                _, end = _decoder.raw_decode(text, j)
            except (ValueError, RecursionError):
                out.append((name, text[j:], False, call_id))
                return out, False, None if partial else f"call {len(out)}: the arguments are not JSON"
            out.append((name, text[j:end], True, call_id))
            i = _skip(text, end)
            if not text.startswith(TOOL_CALLS, i):
                return out, True, None
            i += len(TOOL_CALLS)

    def parse(self, text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
        try:
            return self._calls(text, None if tools is None else set(tools), partial=False)
        except Exception as exc:  # noqa: BLE001 - hostile text gets an error line, never an exception
            return [], f"unparsable tool call ({type(exc).__name__})"

    def _calls(self, text: str, names: set[str] | None, *, partial: bool) -> tuple[list[ToolCall], str | None]:
        if not isinstance(text, str):
            return [], f"expected text, got {type(text).__name__}"
        read, _, error = self._read(text, partial=partial)
        calls: list[ToolCall] = []
        for name, arguments, closed, call_id in read:
            if not closed:
                break
            where = f"call {len(calls) + 1}"
            if not isinstance(name, str):
                return calls, f'{where}: "name" must be a string'
            if names is not None and name not in names:
                return calls, f"{where}: unknown tool {name[:80]!r}; tools: {sorted(names)[:8]}"
            try:
                value = json.loads(arguments) if arguments else {}
                if isinstance(value, str):  # OpenAI's wire format: the arguments as a JSON string
                    value = json.loads(value)
            except (ValueError, RecursionError):
                return calls, f"{where}: the arguments are not a JSON object"
            if not isinstance(value, dict):
                return calls, f"{where}: the arguments must be an object"
            calls.append(ToolCall(name, value, call_id))
        return calls, error

    def complete_calls(self, text: str, tools: Iterable[str] | None = None) -> list[ToolCall]:
        try:
            return self._calls(text, None if tools is None else set(tools), partial=True)[0]
        except Exception:  # noqa: BLE001 - a turn still being written is read as far as it parses
            return []

    def scan(self, text: str, *, final: bool) -> list[PartialCall]:
        try:
            read, _, _ = self._read(text, partial=not final)
        except Exception:  # noqa: BLE001 - what a stream shows never raises
            return []
        return [PartialCall(name, arguments, closed) for name, arguments, closed, _ in read]

    def is_open(self, text: str) -> bool:
        return TOOL_CALLS in text and not self._read(text, partial=True)[1]

    def raw_call(self, text: str) -> str:
        return text.rsplit(TOOL_CALLS, 1)[-1]

    def grammar(self, tools: dict[str, dict], choice: str, *, parallel: bool, max_calls: int | None,
                max_string: int | None, tokenizer=None) -> str:
        opening = token_literal(tokenizer, TOOL_CALLS)
        never = r"~/(?s:.*)\[TOOL_CALLS\](?s:.*)/"  # (the control token is no text: its spelling is banned too)
        if choice == "none":
            return f"start: NO_CALL\nNO_CALL: /(?s:.*)/ & {never}\n"
        more = "" if not parallel else f"{{0,{max_calls - 1}}}" if max_calls else "*"
        if self.generation == 1:
            ids = {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}
            lines = [f"call: {call_body(tools, max_string, extra=ids)}",
                     f'calls: {opening} "[" call' + (f' (", " call){more}' if more else "") + ' "]"']
        else:
            args, cid = token_literal(tokenizer, ARGS), token_literal(tokenizer, CALL_ID)
            ident = f" {cid} /[A-Za-z0-9]{{9}}/" if self.call_ids else ""
            arguments, defs = argument_schemas(tools, max_string)
            lines = [f"call: {opening} ({' | '.join(f'call_{i}' for i in range(len(tools)))})",
                     "calls: call" + (f" call{more}" if more else "")]
            for i, name in enumerate(tools):
                schema = {**arguments[name], "x-guidance": {**library.JSON_FORMAT, "lenient": True},
                          **({"$defs": defs} if defs else {})}
                lines.append(f"call_{i}: {json.dumps(name)}{ident} {args} %json {json.dumps(schema)}")
        if choice == "auto":
            lines += ["start: TEXT | TEXT calls", f"TEXT: /(?s:.*)/ & {never}"]
        else:
            lines += ["start: calls"]
        return "\n".join(lines) + "\n"


def _skip(text: str, i: int, chars: str = " \t\r\n") -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _array(text: str, i: int, *, partial: bool) -> tuple[list[Item], bool, str | None]:
    """The first generation's array of call objects at text[i], as far as it is written."""
    try:
        calls, _ = _decoder.raw_decode(text, i)
    except (ValueError, RecursionError):
        if not partial:
            return [], False, f"the calls after {TOOL_CALLS} are not a JSON array"
        out: list[Item] = []
        j = i + 1
        while True:
            j = _skip(text, j, " \t\r\n,")
            if not text.startswith("{", j):
                return out, False, None
            try:
                obj, end = _decoder.raw_decode(text, j)
            except (ValueError, RecursionError):
                name, arguments, _ = scan_object(text[j:])
                out.append((name, arguments, False, None))
                return out, False, None
            out.append(_item(obj))
            j = end
    if not isinstance(calls, list):
        return [], True, f"expected a JSON array of calls after {TOOL_CALLS}"
    return [_item(obj) for obj in calls], True, None


def _item(obj) -> Item:
    if not isinstance(obj, dict):
        return None, json.dumps(obj), True, None
    name = obj.get("name") if isinstance(obj.get("name"), str) else None
    arguments = obj.get("arguments", {})
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    return name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False), True, call_id
