"""The interface of a call format: how a family of models writes tool calls and reads their results.

A codec owns everything about the format and nothing else: whether the model's chat
template renders it (`templated`: the tools reach the template through its `tools` variable,
calls as structured `tool_calls`, results as tool turns the template wraps), else the part of
the system prompt that lists the tools and teaches the format; the text of an assistant turn's
calls and of a tool turn's result as the model writes and reads them, the ids its template
accepts for calls, the parser of a finished turn (never raising, one line for what is
wrong), the partial parser of a turn still being written (what a stream may show), and the
llguidance grammar of a turn that may or must call (the mask of a constrained turn). The
conversation (hybridlm.turns.protocol), the turn's constraint (hybridlm.turns.constraint)
and the hybrid system (hybridlm.turns.system) reach the format only through it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """A complete call: the tool's name and its arguments (a JSON object); the id the model wrote
    for it, where its format has one (not part of the call's identity)."""

    name: str
    arguments: dict
    id: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: its name once known, its arguments' JSON text so far (as the
    model wrote it), and whether the call is complete."""

    name: str | None
    arguments: str
    complete: bool


class CallCodec(ABC):
    """One call format. Subclasses set `name` (how a user or a model's family selects it) and
    `opening` (the text that opens a call: the lazy grammar's trigger, and what a turn that may
    make no call must never write)."""

    name: str
    opening: str
    #: the model's chat template renders this format (tools, calls, results); False for the
    #: project's default format, taught by a system prompt of its own
    templated: bool = True
    #: how a turn may begin a call written without the format's opening (the texts a free turn that may
    #: make no call must not begin with); none unless the codec reads such calls
    bare_openings: tuple[str, ...] = ()

    # ------------------------------------------------------------------ the prompt
    @abstractmethod
    def tools_prompt(self, schemas: Sequence[dict], *, rules: str = "") -> str:
        """The system prompt's tool part, for a template that does not take tools: how to call,
        `rules` (extra lines of the conversation's), and each tool's {"name", "description", "parameters"}."""

    def call_id(self, index: int, seed: str = "") -> str:
        """An id for the index-th call of a turn, of the form the format's template accepts."""
        return f"call_{seed}{index}"

    def template_id(self, call_id: str) -> str:
        """A client's call id as the template accepts it (the same id unless the format restricts it)."""
        return call_id

    @abstractmethod
    def render_calls(self, text: str, calls: Sequence[tuple[str, str]]) -> str:
        """An assistant turn as the model writes it: its free text, then each (name, arguments' JSON
        text) call."""

    @abstractmethod
    def render_result(self, result: str) -> str:
        """A tool turn's content carrying one observation y."""

    # ------------------------------------------------------------------ reading a turn
    @abstractmethod
    def parse(self, text: str, tools: Iterable[str] | None = None) -> tuple[list[ToolCall], str | None]:
        """The calls of a finished turn, and None or one line naming the first bad call (the calls
        before it are returned); `tools`: the names a call may use. Never raises, whatever the text."""

    @abstractmethod
    def complete_calls(self, text: str, tools: Iterable[str] | None = None) -> list[ToolCall]:
        """The calls of a turn still being written whose end has been written, in order."""

    @abstractmethod
    def scan(self, text: str, *, final: bool) -> list[PartialCall]:
        """Every call of the turn as far as it is written (`final`: the turn has ended, nothing
        more comes); what a stream shows of them. Never raises."""

    @abstractmethod
    def is_open(self, text: str) -> bool:
        """A call has been opened and not yet closed (the turn is inside a call)."""

    def began(self, text: str) -> bool:
        """The turn has opened a call (complete or not)."""
        return self.opening in text

    def free_text(self, text: str) -> str:
        """The turn's text before its first call."""
        return text.partition(self.opening)[0]

    def opening_tail(self, text: str) -> int:
        """How many characters at the end of free text may still become the opening of a call (a
        stream holds them back)."""
        opening = self.opening
        for n in range(min(len(opening) - 1, len(text)), 0, -1):
            if text.endswith(opening[:n]):
                return n
        return 0

    def without_open_call(self, text: str) -> str:
        """The text without a call opened and never closed (a call the token budget cut)."""
        return text[: text.rfind(self.opening)] if self.is_open(text) else text

    def raw_call(self, text: str) -> str:
        """The text of the turn's last call as written (for the observation that says it is malformed)."""
        return text.rsplit(self.opening, 1)[-1]

    # ------------------------------------------------------------------ the mask
    @abstractmethod
    def grammar(self, tools: dict[str, dict], choice: str, *, parallel: bool, max_calls: int | None,
                max_string: int | None, tokenizer=None) -> str:
        """The turn's grammar in llguidance's Lark format. `tools`: name → argument schema of the
        offered tools (already checked); `choice`: auto (free text until the opening, a call from
        there: lazy), required, none (text that never opens a call) or a tool's name; `parallel`:
        several calls (at most `max_calls`), else one; `max_string`: the longest free string
        argument (hybridlm.constraints.tool_schema); `tokenizer`: the model's, where the format's
        delimiters are control tokens of its vocabulary (`token_literal`)."""


def token_literal(tokenizer, text: str) -> str:
    """A delimiter in llguidance's Lark: the token `<[id]>` where the vocabulary has `text` as an added
    token (a control token, or a user-defined one such as Qwen's `<tool_call>`, which llguidance keeps
    apart from text too: a model writes it as that one token, never spelled out), else the quoted text."""
    if tokenizer is not None:
        ids = tokenizer.encode_markup(text)
        if len(ids) == 1 and ids[0] in tokenizer.backend.get_added_tokens_decoder():
            return f"<[{ids[0]}]>"
    return json.dumps(text)
