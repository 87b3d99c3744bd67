"""JSON inside a model's text: how the call formats that write JSON objects write and read them.

`as_json` writes a value the way the call constraint lets a model write it. `closing_tag` finds
where a JSON object written after an opening is closed by its tag, even when a string inside
it holds the tag. `scan_object` reads a call's JSON object as far as it is written (a turn
still being streamed), without raising whatever the text.
"""

from __future__ import annotations

import functools
import json
import re

_decoder = json.JSONDecoder()
_SPACE = " \t\r\n"


def as_json(value) -> str:
    """JSON as the call constraint writes it: non-ASCII characters as themselves (a name such as
    天气 shown as \\u5929\\u6c14 is one the constraint would not let the model write), escaped
    only where the text holds a lone surrogate, which UTF-8 cannot carry."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def closing_tag(text: str, start: int, close: str, *, partial: bool = False) -> int:
    """Where the object whose text starts at `start` is closed by `close`: the tag right after its
    JSON object, else the first tag outside a JSON string (a string may hold the tag itself); −1
    when it is not closed. For finished text (`partial` false) whose JSON is broken, the first
    tag at all."""
    i = _ws(text, start)
    try:
        _, j = _decoder.raw_decode(text, i)
    except (ValueError, RecursionError):
        for m in _string_or(close).finditer(text, start):
            if m.group() == close:
                return m.start()
        return -1 if partial else text.find(close, start)
    j = _ws(text, j)
    return j if text.startswith(close, j) else text.find(close, j)


@functools.cache
def _string_or(close: str) -> re.Pattern:
    """A JSON string (closed, or running to the end of a text still being written) or the tag."""
    return re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|' + re.escape(close), re.S)


def scan_object(body: str, *, name_key: str = "name", arguments_key: str = "arguments") -> tuple[str | None, str, bool]:
    """Read a call's JSON object as far as it is written: (its name once the name's string is
    closed, the text of its arguments value so far, whether that value is closed). Text that is
    not such an object is read as far as it is one; nothing raises."""
    try:
        return _scan(body, name_key, arguments_key)
    except (ValueError, RecursionError):
        return None, "", False


def _scan(body: str, name_key: str, arguments_key: str) -> tuple[str | None, str, bool]:
    name, arguments, complete = None, "", False
    i = _ws(body, 0)
    if not body.startswith("{", i):
        return name, arguments, complete
    i += 1
    while True:
        i = _ws(body, i)
        if i >= len(body) or body[i] != '"':
            return name, arguments, complete
        end = _string_end(body, i)
        if end is None:
            return name, arguments, complete
        key = json.loads(body[i:end])
        i = _ws(body, end)
        if not body.startswith(":", i):
            return name, arguments, complete
        i = _ws(body, i + 1)
        end, closed = _value_end(body, i)
        if key == name_key and closed and body.startswith('"', i):
            name = json.loads(body[i:end])
        elif key == arguments_key:
            arguments, complete = body[i:end], closed
        if not closed:
            return name, arguments, complete
        i = _ws(body, end)
        if body.startswith(",", i):
            i += 1
            continue
        return name, arguments, complete


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the string that opens at text[i] (a quote), or None while it is open."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> tuple[int, bool]:
    """(the index after the JSON value at text[i] as far as written, whether it is closed)."""
    if i >= len(text):
        return i, False
    if text[i] == '"':
        end = _string_end(text, i)
        return (len(text), False) if end is None else (end, True)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return len(text), False
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1, True
            j += 1
        return len(text), False
    j = i  # a number, true, false or null: closed by what follows it
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j, j < len(text)
