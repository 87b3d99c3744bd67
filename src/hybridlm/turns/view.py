"""What the turns of an arc show a reader: the content, and the calls as the model wrote them.

`render` reads the assistant turns of an arc (their texts, in order) into the content (the
free text of every turn, cut before the first stop string) and the calls of the last turn
that name the given tools. With `final=False` it holds back whatever a later token could
still change (a partial opening of a call, a partial stop string, a split UTF-8 character),
so that every streamed delta is a prefix of the final text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridlm.turns.codecs import TAGGED_JSON, CallCodec, PartialCall


@dataclass
class CallView:
    index: int
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it (so far)
    complete: bool


@dataclass
class View:
    content: str
    calls: list[CallView]


def turns_of(s, tokenizer) -> list[str]:
    """The text of every assistant turn of an arc, in order (a jump that runs here ends a turn)."""
    turns: list[list[int]] = [[]]
    for e in s.arc.events:
        if e.kind == "phase" and e.get("phase") == "external":
            turns.append([])
        elif e.kind == "token" and not e.get("stop"):
            turns[-1].append(e["token"])
    return [tokenizer.decode(ids) for ids in turns]


def render(turns: list[str], *, final: bool, stops: tuple[str, ...] = (), client_tools=frozenset(),
           calls_possible: bool = True, cut: bool = True, codec: CallCodec = TAGGED_JSON, repeats: bool = True) -> View:
    """The content and the calls of `client_tools` of an arc whose turns' texts are `turns` (in order).

    The content is the free text of every turn (the text before its first call), cut before
    the first stop string. The calls are those of the last turn that name one of
    `client_tools`. Unless `final`, text that a later token could still change is held back;
    when final, a call's opening cut short is dropped only if the budget may have `cut` the text.
    Unless `repeats`, a call identical to an earlier one of the turn is not shown (nor, while it is
    written, one that may still become such a repeat).
    """
    content = ""
    last = len(turns) - 1
    for j, text in enumerate(turns):
        free = codec.free_text(text)
        if j == last and not codec.began(text) and calls_possible:  # a call's opening cut short is not content
            if not final or cut:  # a text the model ended itself keeps its "<" ("<<<" stays "<<<")
                free = free[: len(free) - codec.opening_tail(free)]
        content += free
    for stop in stops:
        at = content.find(stop)
        if at >= 0:
            content = content[:at]
    if not final:
        content = content[: len(content) - _partial(content, stops)]
        content = content.rstrip("\ufffd")
    calls: list[CallView] = []
    if turns and client_tools:
        shown: list[PartialCall] = []
        for call in codec.scan(turns[-1], final=final):
            if call.name is None or call.name not in client_tools:
                continue
            if not repeats and _repeats(call, shown):
                continue
            shown.append(call)
            arguments = call.arguments if final else call.arguments.rstrip("\ufffd")
            calls.append(CallView(len(calls), call.name, arguments, call.complete))
    return View(content, calls)


def _repeats(call: PartialCall, earlier: list[PartialCall]) -> bool:
    """The call is identical to one of `earlier` (complete), or may still become so (being written)."""
    for e in earlier:
        if e.name != call.name:
            continue
        if not call.complete and e.arguments.startswith(call.arguments):
            return True
        if call.complete and _json(call.arguments) == _json(e.arguments) is not None:
            return True
    return False


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial(text: str, needles) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `needles`."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:n]):
                best = n
                break
    return best
