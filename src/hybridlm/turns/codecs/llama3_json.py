"""The Llama 3.1–3.3 call format: the turn is a JSON object `{"name": …, "parameters": {…}}`.

Llama 3.1's template lists the tools in the first user message and teaches 'Respond in the
format {"name": function name, "parameters": dictionary of argument name and its value}'; the
model writes the object as its whole turn (after `<|python_tag|>` where it takes the ipython
environment for the call) and ends it with `<|eom_id|>` or `<|eot_id|>`. Results come back in
a turn of role `ipython` (the template's rendering of a tool turn). The template renders one
call per assistant turn; several calls are read (and written by the grammar) joined by "; ".
A call object may say "arguments" for "parameters" (models fine-tuned on OpenAI's spelling do).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

from hybridlm.turns.codecs.base import CallCodec, PartialCall, ToolCall
from hybridlm.turns.codecs.json_text import as_json, scan_object
from hybridlm.turns.codecs.tagged_json import call_body, no_call, read_call, repeat

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
_START = re.compile(r'\{\s*"name"\s*:')
_decoder = json.JSONDecoder()
INSTRUCTIONS = (
    "You are a helpful assistant that can call functions. To call a function, reply with only\n"
    '{"name": FUNCTION_NAME, "parameters": {...}}\n'
    "and wait for its result. Then answer the user in one short sentence that states the result.\n"
)


def call_start(text: str) -> int:
    """Where the turn's first call starts (at its `<|python_tag|>` or its object), −1 when none."""
    tag = text.find(PYTHON_TAG)
    m = _START.search(text)
    found = [i for i in (tag, m.start() if m else -1) if i >= 0]
    return min(found) if found else -1


def _objects(text: str, start: int, *, partial: bool) -> list[tuple[int, int]]:
    """(start, end) of each call object from `start` on; the last has end −1 while it is open."""
    spans: list[tuple[int, int]] = []
    i = start
    if text.startswith(PYTHON_TAG, i):
        i += len(PYTHON_TAG)
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text) or text[i] != "{":
            return spans
        try:
            _, j = _decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            spans.append((i, -1 if partial else len(text)))
            return spans
        spans.append((i, j))
        i = j


class Llama3JSON(CallCodec):
    """`{"name": …, "parameters": {…}}` as a turn of its own; results in `ipython` turns."""

    name = "llama3_json"
    opening = '{"name": '

    def tools_prompt(self, schemas: Sequence[dict], *, rules: str = "") -> str:
        return INSTRUCTIONS + rules + "Functions (JSON schemas):\n" + "\n".join(as_json(s) for s in schemas)

    def render_calls(self, text: str, calls: Sequence[tuple[str, str]]) -> str:
        return text + SEPARATOR.join(f'{{"name": {as_json(name)}, "parameters": {arguments}}}' for name, arguments in calls)

    def render_result(self, result: str) -> str:
        return result

    # ------------------------------------------------------------------ reading
    def parse(self, text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
        try:
            return self._parse(text, None if tools is None else set(tools), partial=False)
        except Exception as exc:  # noqa: BLE001 - hostile text gets an error line, never an exception
            return [], f"unparsable tool call ({type(exc).__name__})"

    def _parse(self, text: str, names: set[str] | None, *, partial: bool) -> tuple[list[ToolCall], str | None]:
        if not isinstance(text, str):
            return [], f"expected text, got {type(text).__name__}"
        start = call_start(text)
        if start < 0:
            return [], 'no {"name": ...} call in the text'
        calls: list[ToolCall] = []
        for i, j in _objects(text, start, partial=partial):
            if j < 0:
                break
            call, error = read_call(text[i:j], names, keys=("parameters", "arguments"), exact=False)
            if error is not None or call is None:
                return calls, f"call {len(calls) + 1}: {error}"
            calls.append(call)
        if not calls and not partial:
            return [], "the call is not a JSON object"
        return calls, None

    def complete_calls(self, text: str, tools: Iterable[str] | None = None) -> list[ToolCall]:
        try:
            return self._parse(text, None if tools is None else set(tools), partial=True)[0]
        except Exception:  # noqa: BLE001 - a turn still being written is read as far as it parses
            return []

    def scan(self, text: str, *, final: bool) -> list[PartialCall]:
        start = call_start(text)
        if start < 0:
            return []
        out = []
        for i, j in _objects(text, start, partial=not final):
            closed = j >= 0
            name, arguments, complete = scan_object(text[i:j] if closed else text[i:], arguments_key="parameters")
            if not arguments:
                name, arguments, complete = scan_object(text[i:j] if closed else text[i:])
            out.append(PartialCall(name, arguments, complete and (closed or final)))
        return out

    def is_open(self, text: str) -> bool:
        start = call_start(text)
        return start >= 0 and any(j < 0 for _, j in _objects(text, start, partial=True))

    def began(self, text: str) -> bool:
        return call_start(text) >= 0

    def free_text(self, text: str) -> str:
        start = call_start(text)
        return text if start < 0 else text[:start]

    def without_open_call(self, text: str) -> str:
        return text[: call_start(text)] if self.is_open(text) else text

    def raw_call(self, text: str) -> str:
        start = call_start(text)
        return "" if start < 0 else text[start:].removeprefix(PYTHON_TAG)

    def grammar(self, tools: dict[str, dict], choice: str, *, parallel: bool, max_calls: int | None,
                max_string: int | None, tokenizer=None) -> str:
        if choice == "none":
            return no_call('{"name"')
        lines = [f"call: {call_body(tools, max_string, arguments_key='parameters')}",
                 f"calls: call{repeat(parallel, max_calls, json.dumps(SEPARATOR))}"]
        if choice == "auto":  # a call is the whole turn: free text that never starts one, or the calls
            lines += ["start: NO_CALL | calls", r'NO_CALL: /(?s:.*)/ & ~/(?s:.*)\{"name"(?s:.*)/']
        else:
            lines += ["start: calls"]
        return "\n".join(lines) + "\n"
