"""A chat request as a hybrid system of the engine, and what its arc shows the client.

The conversation of a request is rendered with the model's chat template, as the agent
renders its own (hybridlm.agent.protocol): the tools go into the system prompt with their
JSON schemas, an assistant turn's calls are `<tool_call>{...}</tool_call>` text, a tool
turn is `<tool_response>y</tool_response>`.

`ChatSystem` is the agent's automaton (hybridlm.agent.automaton.AgentSystem) with two
places for the jump map g:

- **client-side tools** (the request's `tools`): the jump map runs in the client. A turn
  that completes a call of one of them is in the jump set D, and the arc ends there with
  termination cause `jump_set` (finish_reason "tool_calls"); the client runs the tool and
  sends a `tool` message, and the next request continues from the state the arc ended in;
- **server-side tools** (`hybridlm serve --tools/--mcp`, offered to requests that bring no
  tools of their own): g runs here, exactly as in `hybridlm agent`, and the client gets the
  answer.

`render` reads the turns of an arc into what the client sees: the content, and the calls
with their arguments as the model wrote them. With `final=False` it holds back whatever a
later token could still change (a partial `<tool_call>`, a partial stop string, a split
UTF-8 character), so that every streamed delta is a prefix of the final text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from hybridlm.agent.automaton import AgentSystem
from hybridlm.agent.protocol import RESPONSE_CLOSE, RESPONSE_OPEN, Protocol, as_json, tools_prompt
from hybridlm.tools import ToolRegistry
from hybridlm.constraints import CLOSE, OPEN, json_schema_constraint, tool_call_constraint
from hybridlm.constraints.calls import call_spans
from hybridlm.engine.arc import Termination
from hybridlm.server.service import Continuation
from hybridlm.server.wire import invalid, text_of


# ---------------------------------------------------------------------- the conversation
def template_messages(messages, tool_schemas: list[dict]) -> list[dict]:
    """OpenAI messages as the chat template's messages: one system message (the client's
    system text, then the tool part of the prompt when tools are offered), calls as text,
    tool results wrapped as the agent's observations are."""
    system = "\n\n".join(text_of(m.content) for m in messages if m.role in ("system", "developer"))
    if tool_schemas:
        system = (system + "\n\n" if system else "") + tools_prompt(tool_schemas)
    out = [{"role": "system", "content": system}] if system else []
    for m in messages:
        if m.role in ("system", "developer"):
            continue
        if m.role == "assistant":
            out.append({"role": "assistant", "content": assistant_text(m)})
        elif m.role == "tool":
            out.append({"role": "tool", "content": f"{RESPONSE_OPEN}{text_of(m.content)}{RESPONSE_CLOSE}"})
        else:
            out.append({"role": "user", "content": text_of(m.content)})
    return out


def assistant_text(m) -> str:
    """An assistant message as the model writes it: its text, then each call."""
    return assistant_content(text_of(m.content), [(c.function.name, c.function.arguments) for c in m.tool_calls or []])


def assistant_content(text: str, calls: list[tuple[str, str]]) -> str:
    """Free text, then `<tool_call>{"name": ..., "arguments": ...}</tool_call>` for each (name,
    arguments' JSON text) call, one per line."""
    return text + "\n".join(f'{OPEN}{{"name": {as_json(name)}, "arguments": {arguments}}}{CLOSE}'
                            for name, arguments in calls)


def conversation_key(messages: list[dict]) -> str:
    """The key of a conversation as the chat template sees it (its rendered messages)."""
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def pending_tool_results(messages) -> tuple[int, dict[str, str]] | None:
    """When the conversation ends with an assistant turn of calls and the tool messages that
    answer them: (index of that assistant message, {tool_call_id: result}); else None."""
    i = len(messages)
    while i > 0 and messages[i - 1].role == "tool":
        i -= 1
    if i == len(messages) or i == 0 or messages[i - 1].role != "assistant" or not messages[i - 1].tool_calls:
        return None
    results = {m.tool_call_id: text_of(m.content) for m in messages[i:]}
    wanted = [c.id for c in messages[i - 1].tool_calls]
    missing = [c for c in wanted if c not in results]
    if missing:
        raise invalid(f"the tool calls {missing} of messages[{i - 1}] have no tool message answering them",
                      param="messages")
    unknown = [c for c in results if c not in wanted]
    if unknown:
        raise invalid(f"tool messages answer {unknown}, which messages[{i - 1}] did not call", param="messages")
    return i - 1, results


# ---------------------------------------------------------------------- the hybrid system
@dataclass
class ToolSetup:
    """What the agent's jump map reads (the shape of hybridlm.agent.HybridAgent's fields)."""

    tokenizer: object
    tools: ToolRegistry  # the tools the server runs itself
    protocol: Protocol
    tool_choice: str
    parallel: bool
    vocab_size: int
    constrain: bool = True

    def _replayed(self, s, k):
        return None


@dataclass
class ChatPlan:
    """Everything a request's sequences share: the offered tools and the turn's constraint."""

    offered: list[dict]  # {"name", "description", "parameters"} of every offered tool
    client_tools: frozenset  # names of the tools whose jump map runs in the client
    tool_choice: str | dict  # auto | required | none | a tool's name
    parallel: bool
    schema: dict | bool | None  # response_format's JSON Schema, when the answer must follow one
    stop: tuple[str, ...] = ()
    budget: int = 0
    notes: dict = field(default_factory=dict)


class ChatSystem(AgentSystem):
    """H = (C, f, D, g) of a chat request: the agent's, with D ∩ {a client-side call} ending the arc."""

    def __init__(self, setup: ToolSetup, plan: ChatPlan) -> None:
        super().__init__(setup)
        self.plan = plan

    def turn(self, s, *, first: bool):
        """The turn's constraint: calls of the offered tools (or text), the answer's JSON Schema when
        no call may be made, text that opens no call when tools are offered but not callable."""
        plan, setup = self.plan, self.agent
        budget = max(1, s.limits.max_token_steps - s.t)
        choice = (plan.tool_choice if first else "auto") if plan.offered else "none"
        left = None
        if plan.offered and not plan.client_tools:  # server-side jumps count against the jump horizon
            left = min(s.limits.max_jumps - s.k, s.limits.max_jumps_per_step)
            if left <= 0:
                choice = "none"
        if choice == "none" and plan.schema is not None:
            return json_schema_constraint(self.tokenizer, plan.schema, budget=budget, vocab_size=setup.vocab_size)
        if not plan.offered:
            return None
        parallel = plan.parallel and (left is None or left > 1)
        return tool_call_constraint(self.tokenizer, plan.offered, choice, parallel=parallel,
                                    max_calls=left if parallel else None, budget=budget, vocab_size=setup.vocab_size)

    # C and f
    def controlled(self, s) -> bool:
        return True

    def phase_of(self, s) -> str:
        c = s.constraint
        if c is None:
            return "decode"
        return "constrained" if getattr(c, "in_call", True) else "decode"

    def flow_mask(self, s):
        return None

    def flowed(self, s, token: int) -> None:
        in_D = self.jump_set(s)
        if token in s.stop_ids and not in_D:
            s.finished = Termination.STOP_TOKEN
        elif s.constraint is not None and s.constraint.finished and not in_D:
            # a value the budget closed early is cut short, as a text at max_tokens is ("length")
            s.finished = Termination.TOKEN_BUDGET if getattr(s.constraint, "forced", False) else Termination.CONSTRAINT
        elif self.plan.stop and not in_D:
            free = self.tokenizer.decode([i for i in s.turn if i not in s.stop_ids]).split(OPEN, 1)[0]
            if any(stop in free for stop in self.plan.stop):
                s.finished = Termination.STOP_SEQUENCE

    # D and g
    def jump_set(self, s) -> bool:
        c = s.constraint
        return c is not None and hasattr(c, "calls") and c.finished and bool(c.calls())

    def jumps_elsewhere(self, s) -> bool:
        return any(call.name in self.plan.client_tools for call in s.constraint.calls())

    def continuation(self, s, state) -> tuple[str, Continuation]:
        """What the service keeps of an arc that ended in D at a client-side call: the state, under
        the key of the conversation the client will send back with the tool results."""
        view = render(turns_of(s, self.tokenizer), final=True, stops=self.plan.stop, client_tools=self.plan.client_tools)
        head = s.messages + [{"role": "assistant",
                              "content": assistant_content(view.content, [(c.name, c.arguments) for c in view.calls])}]
        closed = bool(s.turn) and s.turn[-1] in s.stop_ids
        return conversation_key(head), Continuation(state, head, [call_id(s, c.index) for c in view.calls], closed,
                                                    s.name, s.t)

    # the end: the service reads the arc itself
    def summary(self, s) -> dict:
        return {}

    def ended(self, s) -> None:
        s.result = s.arc

    def describe(self, s) -> dict:
        plan = self.plan
        out = {"system": "chat", "prompt_tokens": len(s.prompt), "tool_choice": _choice_name(plan.tool_choice),
               "parallel_tool_calls": plan.parallel, "constrain": True,
               "tools": [{**t, **({"server": "client"} if t["name"] in plan.client_tools else {})}
                         for t in plan.offered]}
        if plan.stop:
            out["stop"] = list(plan.stop)
        if plan.schema is not None:
            out["response_schema"] = plan.schema
        return {**out, **plan.notes}


def _choice_name(choice) -> str:
    return choice if isinstance(choice, str) else str(choice)


# ---------------------------------------------------------------------- what the client sees
def turns_of(s, tokenizer) -> list[str]:
    """The text of every assistant turn of an arc, in order (a server-side jump ends a turn)."""
    turns: list[list[int]] = [[]]
    for e in s.arc.events:
        if e.kind == "phase" and e.get("phase") == "external":
            turns.append([])
        elif e.kind == "token" and not e.get("stop"):
            turns[-1].append(e["token"])
    return [tokenizer.decode(ids) for ids in turns]


def call_id(s, index: int) -> str:
    """The id of the index-th call of a sequence's last turn (unique: the arc's name is)."""
    return f"call_{s.name.split('-', 1)[-1]}_{index}"


def state_tokens(x) -> list[int]:
    """The token string s a state holds."""
    tokens = x.tokens
    return tokens[0].tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


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


def render(turns: list[str], *, final: bool, stops: tuple[str, ...] = (), client_tools=frozenset(),
           calls_possible: bool = True, cut: bool = True) -> View:
    """The content and client-side calls of an arc whose turns' texts are `turns` (in order).

    The content is the free text of every turn (the text before its first call), cut before
    the first stop string. The calls are those of the last turn that name a client-side
    tool. Unless `final`, text that a later token could still change is held back; when final,
    a call's opening cut short is dropped only if the budget may have `cut` the text.
    """
    content = ""
    last = len(turns) - 1
    for j, text in enumerate(turns):
        free, _, _ = text.partition(OPEN)
        if j == last and OPEN not in text and calls_possible:  # a call's opening cut short is not content
            if not final or cut:  # a text the model ended itself keeps its "<" ("<<<" stays "<<<")
                free = free[: len(free) - _partial(free, (OPEN,))]
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
        text = turns[-1]
        for start, end in call_spans(text, partial=not final):  # (a string argument may hold </tool_call>)
            closed = end >= 0
            name, arguments, complete = scan_call(text[start:end] if closed else text[start:])
            if name is None or name not in client_tools:
                continue
            if not final:
                arguments = arguments.rstrip("\ufffd")
            calls.append(CallView(len(calls), name, arguments, complete and closed or (final and complete)))
    return View(content, calls)


def _partial(text: str, needles) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `needles`."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:n]):
                best = n
                break
    return best


def scan_call(body: str) -> tuple[str | None, str, bool]:
    """Read a call's JSON object as far as it is written: (its name once the name's string is
    closed, the text of its arguments value so far, whether that value is closed). Text that is
    not such an object is read as far as it is one; nothing raises."""
    try:
        return _scan_call(body)
    except (ValueError, RecursionError):
        return None, "", False


def _scan_call(body: str) -> tuple[str | None, str, bool]:
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
        if key == "name" and closed and body.startswith('"', i):
            name = json.loads(body[i:end])
        elif key == "arguments":
            arguments, complete = body[i:end], closed
        if not closed:
            return name, arguments, complete
        i = _ws(body, end)
        if body.startswith(",", i):
            i += 1
            continue
        return name, arguments, complete


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
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
