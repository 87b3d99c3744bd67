"""Constrained decoding of a tool call: the kernel restricted to the call's grammar.

Once a tool-call segment is open, the next tokens must spell

    {"name": "<tool>", "arguments": {"<key>": <value>, ...}}</tool_call>

with <tool> a registered tool and the arguments the required properties of its JSON
schema, in order, each value of its declared type. The grammar is a queue of segments
(literal text, a choice among names, a string body, a number) fed one character at a
time; at each token step `allowed()` is the set of tokens whose text the grammar can
consume next, and the kernel samples only among them. A small model then cannot fail
on syntax, which is what it needs (SPEC.md §6).
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field

import torch

from hybridlm.agent.tools import ToolRegistry
from hybridlm.tokenizer import TokenTable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_STRING = 200


def character_class(pattern: str | None) -> str | None:
    """The class of a JSON-schema pattern of the form ^[...]+$ (the form the grammar enforces)."""
    if pattern is None:
        return None
    found = re.fullmatch(r"\^\[(.+)\]\+\$", pattern)
    if found is None:
        raise ValueError(f"pattern {pattern!r}: the call grammar supports patterns of the form ^[...]+$")
    return found.group(1)


# ---------------------------------------------------------------------- segments
@dataclass
class Literal:
    text: str


@dataclass
class Choice:
    options: list[str]  # a tool name ends with its closing quote
    selects_tool: bool = False
    done: str = ""


@dataclass
class StringBody:
    charset: str | None = None  # a regex character class the characters must belong to
    min_length: int = 0
    done: str = ""


@dataclass
class Number:
    integer: bool
    done: str = ""


@dataclass
class CallGrammar:
    """The grammar of one tool call, with `opened` telling whether <tool_call> is still to come."""

    registry: ToolRegistry
    table: TokenTable
    opened: bool = True
    segments: deque = field(default_factory=deque)
    text: str = ""  # everything consumed so far
    name: str | None = None

    def __post_init__(self) -> None:
        if not self.opened:
            self.segments.append(Literal(OPEN))
        self.segments.append(Literal('{"name": "'))
        self.segments.append(Choice([t.name + '"' for t in self.registry], selects_tool=True))

    @property
    def done(self) -> bool:
        return not self.segments

    @property
    def call_json(self) -> str:
        """The JSON object of the call (without the delimiters)."""
        body = self.text.removeprefix(OPEN)
        return body[: len(body) - len(CLOSE)] if body.endswith(CLOSE) else body

    def parsed(self) -> tuple[str, dict]:
        obj = json.loads(self.call_json)
        return obj["name"], obj["arguments"]

    # ------------------------------------------------------------------ allowed tokens
    def allowed(self) -> torch.Tensor:
        """Tokens the grammar can consume next (a token may run on into the literal that follows)."""
        seg = self.segments[0]
        nxt = self.segments[1].text if len(self.segments) > 1 and isinstance(self.segments[1], Literal) else ""
        t = self.table
        if isinstance(seg, Literal):
            return t.mask(t.prefixes(seg.text + nxt))
        if isinstance(seg, Choice):
            ids = []
            for o in seg.options:
                if o.startswith(seg.done):
                    after = self._argument_segments(o[:-1])[0].text if seg.selects_tool else nxt
                    ids += t.prefixes(o[len(seg.done):] + after)
            return t.mask(ids)
        if isinstance(seg, StringBody):
            m = t.mask(t.prefixes(nxt, head='"') if len(seg.done) >= seg.min_length else [])
            if len(seg.done) < MAX_STRING:
                m |= t.string_body if seg.charset is None else t.string_body & t.charset(seg.charset)
            return m
        if isinstance(seg, Number):
            m = t.digits.clone()
            if not seg.done:
                m |= t.mask(t.by_text.get("-", []))
            elif seg.done[-1].isdigit():
                m |= t.mask(t.prefixes(nxt))
                if not seg.integer and "." not in seg.done:
                    m |= t.mask(t.by_text.get(".", []))
            return m
        raise AssertionError(seg)

    # ------------------------------------------------------------------ consuming text
    def feed(self, text: str) -> None:
        """Consume the text of one token; raises ValueError if the grammar cannot."""
        for ch in text:
            self._feed_char(ch)
        self.text += text

    def _feed_char(self, ch: str) -> None:
        if not self.segments:
            raise ValueError(f"text {ch!r} after the end of the tool call")
        seg = self.segments[0]
        if isinstance(seg, Literal):
            if not seg.text.startswith(ch):
                raise ValueError(f"expected {seg.text[:1]!r}, got {ch!r}")
            seg.text = seg.text[1:]
            if not seg.text:
                self.segments.popleft()
        elif isinstance(seg, Choice):
            seg.done += ch
            if not any(o.startswith(seg.done) for o in seg.options):
                raise ValueError(f"{seg.done!r} starts none of {seg.options}")
            if seg.done in seg.options:
                self.segments.popleft()
                if seg.selects_tool:
                    self.name = seg.done[:-1]
                    self.segments.extend(self._argument_segments(self.name))
        elif isinstance(seg, StringBody):
            if ch == '"':
                if len(seg.done) < seg.min_length:
                    raise ValueError(f"string shorter than {seg.min_length} characters")
                self.segments.popleft()
            elif ch == "\\" or ord(ch) < 0x20:
                raise ValueError(f"character {ch!r} inside a string")
            elif seg.charset is not None and not re.fullmatch(f"[{seg.charset}]", ch):
                raise ValueError(f"character {ch!r} outside [{seg.charset}]")
            else:
                seg.done += ch
        elif isinstance(seg, Number):
            if ch.isdigit() or (ch == "-" and not seg.done) or (ch == "." and not seg.integer and "." not in seg.done):
                seg.done += ch
            else:
                if not seg.done or not seg.done[-1].isdigit():
                    raise ValueError(f"number {seg.done!r} ends early")
                self.segments.popleft()
                self._feed_char(ch)

    def _argument_segments(self, name: str) -> list:
        """After the tool's name: the segments of its required arguments, in schema order."""
        schema = self.registry.tools[name].parameters
        props = schema.get("properties", {})
        keys = [k for k in schema.get("required", []) if k in props]
        segments: list = [Literal(', "arguments": {')]
        for j, key in enumerate(keys):
            sep = ", " if j else ""
            kind = props[key].get("type")
            if kind == "string":
                segments.append(Literal(f'{sep}"{key}": "'))
                charset = character_class(props[key].get("pattern"))
                least = max(props[key].get("minLength", 0), 1 if charset else 0)
                segments.append(StringBody(charset=charset, min_length=least))
            elif kind in ("integer", "number"):
                segments.append(Literal(f'{sep}"{key}": '))
                segments.append(Number(integer=kind == "integer"))
            elif kind == "boolean":
                segments.append(Literal(f'{sep}"{key}": '))
                segments.append(Choice(["true", "false"]))
            else:
                raise ValueError(f"tool {name}: argument {key!r} of type {kind!r} has no grammar")
        segments.append(Literal("}}" + CLOSE))
        merged: list = []
        for seg in segments:  # adjacent literals become one
            if merged and isinstance(seg, Literal) and isinstance(merged[-1], Literal):
                merged[-1] = Literal(merged[-1].text + seg.text)
            else:
                merged.append(seg)
        return merged


@dataclass
class FreeCall:
    """An unconstrained call: the model writes the JSON itself until </tool_call> (a baseline).

    Nothing is masked; whatever was written is parsed at the jump, and a malformed call, an
    unknown tool or invalid arguments come back as an error observation.
    """

    text: str = OPEN
    name: str | None = None
    ended: bool = False  # the model closed its turn inside the call

    @property
    def done(self) -> bool:
        return self.ended or CLOSE in self.text

    @property
    def call_json(self) -> str:
        body = self.text.removeprefix(OPEN)
        return body.split(CLOSE)[0]

    def allowed(self) -> None:
        return None

    def feed(self, text: str) -> None:
        self.text += text

    def parsed(self) -> tuple[str, dict]:
        obj = json.loads(self.call_json)
        if not isinstance(obj, dict) or "name" not in obj:
            raise ValueError('a call is a JSON object {"name": ..., "arguments": {...}}')
        self.name = str(obj["name"])
        return self.name, obj.get("arguments", {})
