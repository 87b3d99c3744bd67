"""The pythonic call format (Llama 3.2's and Llama 4's pythonic templates, LFM2): a list of Python calls.

The model writes its calls as one Python list of calls with keyword arguments,
`[get_time(city="XYZCITY"), toggle(enabled=True)]`, the whole turn (Llama 3.2) or between the
delimiters of its template (LFM2: `<|tool_call_start|>[…]<|tool_call_end|>`). The values are
Python literals (JSON's `true`, `false`, `null` read too). The list is read with Python's own
parser (`ast`), never evaluated: only literal values are taken. Results come back as tool turns
that the template renders.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Sequence

from hybridlm.turns.codecs.base import CallCodec, PartialCall, ToolCall
from hybridlm.turns.codecs.json_text import as_json

MAX_CALL_CHARS = 100_000  # a list longer than this is not parsed (bounds the parser's time)
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_LITERALS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
INSTRUCTIONS = (
    "You are a helpful assistant that can call functions. To call functions, reply with only a Python list\n"
    '[func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)]\n'
    "and wait for the results. Then answer the user in one short sentence that states the result.\n"
)


def value_of(node: ast.AST):
    """A Python (or JSON) literal's value; ValueError for anything else (a name, a call, an operator)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        number = node.operand.value
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, ast.Name) and node.id in _LITERALS:
        return _LITERALS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [value_of(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = value_of(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("a dict key that is not a string")
            out[key] = value_of(v)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


def dotted(node: ast.AST) -> str:
    """A called function's (dotted) name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    raise ValueError(f"the called thing is not a name: {type(node).__name__}")


def read_list(text: str) -> list[ToolCall]:
    """The calls of one Python list of calls `[f(a=1), …]`; ValueError (or SyntaxError) when it is not one."""
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("an element that is not a call with keyword arguments")
        arguments = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError("**arguments")
            arguments[kw.arg] = value_of(kw.value)
        calls.append(ToolCall(dotted(node.func), arguments))
    return calls


def python_literal(value) -> str:
    """A JSON value written as a Python literal (as the templates write arguments)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return as_json(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    return "{" + ", ".join(f"{as_json(str(k))}: {python_literal(v)}" for k, v in value.items()) + "}"


class Pythonic(CallCodec):
    """`[f(a=1, b="x"), …]`, the whole turn or between `start` and `end` (the template's delimiters)."""

    name = "pythonic"

    def __init__(self, start: str = "", end: str = "") -> None:
        self.start, self.end = start, end
        self.opening = start + "[" if start else "["

    def __repr__(self) -> str:
        return f"Pythonic({self.start!r}, {self.end!r})"

    def tools_prompt(self, schemas: Sequence[dict], *, rules: str = "") -> str:
        return INSTRUCTIONS + rules + "Functions (JSON schemas):\n" + "\n".join(as_json(s) for s in schemas)

    def render_calls(self, text: str, calls: Sequence[tuple[str, str]]) -> str:
        items = []
        for name, arguments in calls:
            args = json.loads(arguments)
            items.append(f"{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in args.items()) + ")")
        return text + self.start + "[" + ", ".join(items) + "]" + self.end

    def render_result(self, result: str) -> str:
        return result

    # ------------------------------------------------------------------ reading
    def call_start(self, text: str) -> int:
        """Where the calls start: at the delimiter, or (without one) at a turn that opens with `[name(`."""
        if self.start:
            return text.find(self.start)
        stripped = len(text) - len(text.lstrip())
        return stripped if _NAME.match(text, stripped + 1) and text.startswith("[", stripped) else -1

    def _span(self, text: str) -> tuple[int, int] | None:
        """(start, end) of the calls' list in the text (end −1 while it is not closed), None when none."""
        at = self.call_start(text)
        if at < 0:
            return None
        begin = at + len(self.start)
        if self.end:
            close = text.find(self.end, begin)
            return begin, close
        for m in re.finditer(r"\]", text[begin:]):
            try:
                read_list(text[begin: begin + m.end()])
                return begin, begin + m.end()
            except (ValueError, SyntaxError, RecursionError):
                continue
        return begin, -1

    def parse(self, text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
        try:
            if not isinstance(text, str):
                return [], f"expected text, got {type(text).__name__}"
            span = self._span(text)
            if span is None:
                return [], f"no {self.opening!r} call list in the text"
            begin, end = span
            if end < 0:
                return [], "the list of calls is never closed"
            if end - begin > MAX_CALL_CHARS:
                return [], f"{end - begin} characters, more than {MAX_CALL_CHARS}"
            calls = read_list(text[begin:end])
        except (ValueError, SyntaxError, RecursionError, MemoryError) as exc:
            return [], f"not a list of calls ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})"
        names = None if tools is None else set(tools)
        for i, call in enumerate(calls):
            if names is not None and call.name not in names:
                return calls[:i], f"call {i + 1}: unknown tool {call.name[:80]!r}; tools: {sorted(names)[:8]}"
        return calls, None

    def complete_calls(self, text: str, tools: Iterable[str] | None = None) -> list[ToolCall]:
        span = self._span(text) if isinstance(text, str) else None
        return self.parse(text, tools)[0] if span is not None and span[1] >= 0 else []

    def scan(self, text: str, *, final: bool) -> list[PartialCall]:
        span = self._span(text)
        if span is None:
            return []
        if span[1] >= 0:
            calls, error = self.parse(text)
            if error is None:
                return [PartialCall(c.name, as_json(c.arguments), True) for c in calls]
        body = text[span[0]:] if span[1] < 0 else text[span[0]:span[1]]
        m = _NAME.match(body, 1) if body.startswith("[") else None
        return [PartialCall(m.group(1) if m else None, "", False)] if m or not final else []

    def is_open(self, text: str) -> bool:
        span = self._span(text)
        return span is not None and span[1] < 0

    def began(self, text: str) -> bool:
        return self.call_start(text) >= 0

    def free_text(self, text: str) -> str:
        at = self.call_start(text)
        return text if at < 0 else text[:at]

    def without_open_call(self, text: str) -> str:
        return self.free_text(text) if self.is_open(text) else text

    def raw_call(self, text: str) -> str:
        at = self.call_start(text)
        return "" if at < 0 else text[at + len(self.start):]

    # ------------------------------------------------------------------ the mask
    def grammar(self, tools: dict[str, dict], choice: str, *, parallel: bool, max_calls: int | None,
                max_string: int | None, tokenizer=None) -> str:
        from hybridlm.turns.codecs.base import token_literal
        from hybridlm.turns.codecs.tagged_json import no_call

        if choice == "none":
            return no_call(self.opening)
        lines = []
        for i, (name, schema) in enumerate(tools.items()):
            params = list((schema or {}).get("properties") or {})
            arg = " | ".join(f'"{p}=" value' for p in params) or '"_=" value'
            lines += [f"call{i}: {json.dumps(name + '(')} (arg{i} (\", \" arg{i})*)? \")\"", f"arg{i}: {arg}"]
        call = " | ".join(f"call{i}" for i in range(len(tools)))
        more = "" if not parallel else (f' (", " call){{0,{max_calls - 1}}}' if max_calls else ' (", " call)*')
        start = token_literal(tokenizer, self.start) + " " if self.start else ""
        end = " " + token_literal(tokenizer, self.end) if self.end else ""
        lines += [
            f"call: {call}",
            f'calls: {start}"[" call{more} "]"{end}',
            'value: STRING | NUMBER | "True" | "False" | "None" | "[" (value (", " value)*)? "]"'
            ' | "{" (STRING ": " value (", " STRING ": " value)*)? "}"',
            r'STRING: /"([^"\\\n]|\\.)*"/',
            r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
        ]
        if choice == "auto":  # a call list is the whole turn (or follows free text, where the format has delimiters)
            text = f"/(?s:.*)/ & ~/(?s:.*){re.escape(self.start)}(?s:.*)/" if self.start \
                else r"/(?s:.*)/ & ~/[ \t\r\n]*\[(?s:.*)/"
            lines += [f"TEXT: {text}", "start: TEXT | TEXT calls" if self.start else "start: TEXT | calls"]
        else:
            lines += ["start: calls"]
        return "\n".join(lines) + "\n"
