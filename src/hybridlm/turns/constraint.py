"""The constraint of one assistant turn: the mask of a turn that may or must call tools, or none.

`tool_call_constraint` compiles the call format's grammar of a turn (hybridlm.turns.codecs)
for the offered tools and the tool choice: the name is one of the offered tools and the
arguments follow that tool's JSON Schema. tool_choice "auto" is lazy: free text until the
model writes the format's opening, constrained from there; "required" starts the turn with
a call; "none" lets no call open; a tool's name forces a call of that tool. `FreeTurn` is the
unconstrained baseline: nothing is masked, the calls are parsed when the model closes one.

`offerable` is the check that a registry's tools can be offered at all: a tool server's
schema the grammar cannot compile is left out with a warning, the user's own is an error.
"""

from __future__ import annotations

import json
import warnings

from hybridlm.constraints import library
from hybridlm.constraints.calls import admit_defaults, tool_choice_name, tool_schema, tool_specs
from hybridlm.constraints.grammar import TAIL, WITNESS_CAP, GrammarConstraint, closing_witness
from hybridlm.errors import InputError
from hybridlm.tools import ToolRegistry
from hybridlm.turns.codecs import TAGGED_JSON, CallCodec, ToolCall


class ToolCallConstraint(GrammarConstraint):
    """The mask of a turn with tools; `calls()` gives the parsed calls once `finished`.

    The budget closes an open call only at its very end (no margin): a value the witness closed
    early is a wrong call (`{"city": ""}`), worse than none, so the model keeps every token the
    budget allows. A call the budget closed is `forced`: not a jump, its turn ends with the
    token budget (docs/server.md, "The budget and a call").
    """

    margin = 0

    def __init__(self, tokenizer, grammar: str, *, codec: CallCodec, tools: list[str], tool_choice: str,
                 parallel: bool, budget: int | None, vocab_size: int | None, repeats: bool = True) -> None:
        super().__init__(tokenizer, grammar, kind="tool_call",
                         source={"tools": tools, "tool_choice": tool_choice, "parallel": parallel},
                         budget=budget, vocab_size=vocab_size)
        self.codec, self.tools, self.tool_choice, self.parallel = codec, tools, tool_choice, parallel
        self.repeats = repeats  # False: a call identical to an earlier one of the turn ends the turn, unmade

    @property
    def in_call(self) -> bool:
        """A call is open: the model opened one and has not closed it yet."""
        return self.codec.is_open(self.text)

    @property
    def made_call(self) -> bool:
        """The turn holds complete calls (with `finished`: the turn is in the jump set)."""
        return bool(self.calls())

    def _closing_token(self) -> int | None:
        """The budget closes an open call in time; after a complete call, no further call opens in
        the last TAIL tokens (it could not close); free text ends at the solver's token budget instead."""
        if self.in_call:
            return super()._closing_token()
        if self.parallel and not self.repeats and not self.finished and self.repeated():
            witness = closing_witness(self.matcher, self.lib, limit=WITNESS_CAP)
            return witness[0] if witness else None
        left = self.remaining
        if left is not None and left <= TAIL and self.parallel and not self.finished and self.calls():
            witness = closing_witness(self.matcher, self.lib, limit=left) if left else None
            return witness[0] if witness else None
        return None

    def calls(self) -> list[ToolCall]:
        """The calls written so far (complete ones only), in order; without a repeat of an earlier
        call of the turn unless `repeats`."""
        made = self.codec.complete_calls(self.text, self.tools)
        return made if self.repeats else distinct(made)

    def repeated(self) -> bool:
        """The turn's last complete call is identical to an earlier one (its name and arguments)."""
        made = self.codec.complete_calls(self.text, self.tools)
        return len(made) > 1 and _key(made[-1]) in {_key(c) for c in made[:-1]}

    def answer(self) -> str:
        """The free text of the turn (before any call)."""
        return self.codec.free_text(self.text)


def _key(call: ToolCall) -> str:
    return json.dumps([call.name, call.arguments], sort_keys=True)


def distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls without those identical to an earlier one (name and arguments), in order."""
    seen: set[str] = set()
    out = []
    for c in calls:
        if _key(c) not in seen:
            seen.add(_key(c))
            out.append(c)
    return out


def tool_call_constraint(tokenizer, tools, tool_choice="auto", *, parallel: bool = False,
                         max_calls: int | None = None, budget: int | None = None, max_string: int | None = None,
                         vocab_size: int | None = None, codec: CallCodec = TAGGED_JSON,
                         repeats: bool = True, defaults: bool = False) -> ToolCallConstraint:
    """The tool-call constraint of one turn, in the call format `codec`.

    tools: the offered tools (objects with .name and .parameters, e.g. a ToolRegistry, or
    dicts {"name", "parameters"}). tool_choice: "auto", "required", "none", a tool's name,
    or OpenAI's {"type": "function", "function": {"name": ...}}. parallel: several calls
    in the turn (at most max_calls), else exactly one. budget: tokens the constraint may
    take in all (the call is closed in time); max_string: the longest string argument
    (characters) where the schema sets no shorter maxLength. repeats=False: a call identical to an
    earlier one of the turn (a small model's loop) is not made: the turn is closed right after it.
    defaults=True: an optional argument may also be its declared default where its schema does not admit it
    (hybridlm.constraints.calls.admit_defaults: a Python signature's reading, asked for by BFCL's runner).
    """
    specs = tool_specs(tools)
    choice = tool_choice_name(tool_choice, specs)
    if max_calls is not None and max_calls < 1:
        raise InputError(f"max_calls={max_calls}: expected ≥ 1")
    if max_string is not None and max_string < 0:
        raise InputError(f"max_string={max_string}: expected ≥ 0")
    offered = specs if choice in ("auto", "required", "none") else {choice: specs[choice]}
    if defaults:
        offered = {name: admit_defaults(params) for name, params in offered.items()}
    if not offered and choice != "none":
        raise InputError("tool_call_constraint: no tools offered; use tool_choice='none'")
    lib = library.library_tokenizer(tokenizer)
    for name, params in offered.items():  # each schema on its own first: the error names the tool
        library.matcher(lib, library.json_grammar(tool_schema(params, max_string), lenient=True), f"tool {name}")
    grammar = library.lark_grammar(codec.grammar(offered, choice, parallel=parallel, max_calls=max_calls,
                                                 max_string=max_string, tokenizer=tokenizer))
    return ToolCallConstraint(tokenizer, grammar, codec=codec, tools=list(offered), tool_choice=choice,
                              parallel=parallel, budget=budget, vocab_size=vocab_size, repeats=repeats)


class FreeTurn:
    """An unconstrained turn (a baseline): nothing is masked; the calls the model writes are parsed
    when it closes one (or the turn ends), and a malformed call comes back as an error observation."""

    def __init__(self, tokenizer, *, codec: CallCodec = TAGGED_JSON, text: str = "") -> None:
        self.tokenizer, self.codec, self.stop_ids = tokenizer, codec, tokenizer.stop_ids()
        self.tokens: list[int] = []
        self.prefix, self.ended = text, False  # (a call forced open enters the prompt as text)

    def mask(self) -> None:
        return None

    def advance(self, token: int) -> None:
        if token in self.stop_ids:
            self.ended = True
        else:
            self.tokens.append(int(token))

    @property
    def text(self) -> str:
        return self.prefix + self.tokenizer.decode(self.tokens)

    @property
    def in_call(self) -> bool:
        return self.codec.is_open(self.text)

    @property
    def finished(self) -> bool:
        """The model ended the turn, or closed a call it opened."""
        text = self.text
        return self.ended or (self.codec.began(text) and not self.codec.is_open(text))

    @property
    def made_call(self) -> bool:
        """The turn opened a call (well-formed or not: a malformed one is answered with an error)."""
        return self.codec.began(self.text)

    def parsed(self) -> tuple[list[ToolCall], str | None]:
        return self.codec.parse(self.text)

    def calls(self) -> list[ToolCall]:
        return self.parsed()[0]

    def describe(self) -> dict:
        return {"kind": "free_turn"}


class ToolNotOffered(UserWarning):
    """A tool server's tool left out: the call constraint cannot compile its schema."""


def without_grammar(tools: ToolRegistry, tokenizer, codec: CallCodec = TAGGED_JSON) -> dict[str, str]:
    """The tools whose argument schemas the call constraint cannot compile, and why (one line each)."""
    missing = {}
    for t in tools:
        try:
            tool_call_constraint(tokenizer, [t], "required", codec=codec)
        except InputError as exc:
            missing[t.name] = str(exc)
    return missing


def offerable(tools: ToolRegistry, tokenizer, codec: CallCodec = TAGGED_JSON) -> ToolRegistry:
    """The registry without the MCP servers' tools whose schemas the call constraint cannot
    compile, each named in a warning: a server's schema is not the user's to fix, and one such
    tool must not stop every run. A tool of the user's own that does not compile is an error."""
    try:
        tool_call_constraint(tokenizer, list(tools), "required", codec=codec)
        return tools
    except InputError:
        pass
    missing = without_grammar(tools, tokenizer, codec)
    own = [name for name in missing if tools.tools[name].server is None]
    if own:
        raise InputError(missing[own[0]])
    for name, reason in missing.items():
        warnings.warn(f"tool {name} of {tools.tools[name].server} is not offered: {reason}", ToolNotOffered,
                      stacklevel=3)
    return ToolRegistry({n: t for n, t in tools.tools.items() if n not in missing}, tools.max_output_chars)
