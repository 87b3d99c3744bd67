"""A chat request in the turns of a conversation, and the client's side of its jump map.

The conversation of a request is rendered with the model's chat template and its call format
(hybridlm.turns): the tools go into the system prompt with their JSON schemas, an assistant
turn's calls are written as the model writes them, a tool turn carries its result. The
request's hybrid system is the conversation's (`hybridlm.turns.Conversation`), composed in
hybridlm.server.handlers with two places for the jump map g:

- **client-side tools** (the request's `tools`): the jump map runs in the client
  (`ClientTools`). A turn that completes a call of one of them is in the jump set D, and the
  arc ends there with termination cause `jump_set` (finish_reason "tool_calls"); the client
  runs the tool and sends a `tool` message, and the next request continues from the state the
  arc ended in (`ClientTools.continuation`, kept by the service);
- **server-side tools** (`hybridlm serve --tools/--mcp`, offered to every request beside its
  own tools, unless it asks for a structured reply): g runs here, exactly as in `hybridlm agent`,
  and the arc goes on. Where both kinds are offered a turn makes one call: the server's runs here,
  a client's ends the arc as above.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from hybridlm.server.service import Continuation
from hybridlm.server.wire import invalid, text_of
from hybridlm.turns import Protocol, render, turns_of
from hybridlm.turns.system import rewrite_state


# ---------------------------------------------------------------------- the conversation
def template_messages(messages, protocol: Protocol) -> list[dict]:
    """OpenAI messages as the chat template's messages: one system message (the client's system
    text, then the tool part of the prompt where the template does not list the tools), calls and
    tool results as the protocol gives them to the template (hybridlm.turns.protocol)."""
    system = "\n\n".join(text_of(m.content) for m in messages if m.role in ("system", "developer"))
    tools = protocol.tools_prompt()
    if tools:
        system = (system + "\n\n" if system else "") + tools
    out = [{"role": "system", "content": system}] if system else []
    names: dict[str, str] = {}
    for m in messages:
        if m.role in ("system", "developer"):
            continue
        if m.role == "assistant":
            calls = m.tool_calls or []
            names |= {c.id: c.function.name for c in calls}
            out.append(protocol.assistant(text_of(m.content), [(c.function.name, c.function.arguments) for c in calls],
                                          [c.id for c in calls]))
        elif m.role == "tool":
            ident = m.tool_call_id or ""
            out.append(protocol.tool(text_of(m.content), name=names.get(ident, ""), call_id=ident))
        else:
            out.append({"role": "user", "content": text_of(m.content)})
    return out


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
    wanted = dict.fromkeys(c.id for c in messages[i - 1].tool_calls)  # (a set in call order)
    missing = [c for c in wanted if c not in results]
    if missing:
        raise invalid(f"the tool calls {missing} of messages[{i - 1}] have no tool message answering them",
                      param="messages")
    unknown = [c for c in results if c not in wanted]
    if unknown:
        raise invalid(f"tool messages answer {unknown}, which messages[{i - 1}] did not call", param="messages")
    return i - 1, results


# ---------------------------------------------------------------------- the client's jump map
@dataclass
class ClientTools:
    """The request's own tools: their jump map runs in the client (`hybridlm.turns.Elsewhere`)."""

    names: frozenset[str]
    tokenizer: object
    protocol: Protocol
    stops: tuple[str, ...] = ()
    repeats: bool = False  # a call identical to an earlier one of its turn is returned too
    sent: list[dict] | None = None  # the request's conversation as the client sent it (`template_messages`)
    start: int = 0  # where the turns of this arc begin in s.messages (after the request's conversation)

    def continuation(self, s, state) -> tuple[str, Continuation]:
        """What the service keeps of an arc that ended in D at a client-side call: the state, under
        the key of the conversation the client will send back with the tool results (the request's
        conversation as the client sent it, then this turn's calls as the protocol gives them to the
        template), and the conversation as the state holds it (what enc(y) continues): the turn as the
        template writes it where ρ cut the state there (`Continuation.kept`), else as the model wrote it.
        The two differ where the arc continues an earlier one whose turns stayed as written, which the
        client sends back as structured calls (the turns of the server's own jumps in this arc stay in
        the key: the client never sends them)."""
        turns = turns_of(s, self.tokenizer)
        view = render(turns, final=True, stops=self.stops, client_tools=self.names, codec=self.protocol.codec,
                      repeats=self.repeats)
        ids = [call_id(s, c.index) for c in view.calls]
        sent = self.protocol.assistant(view.content, [(c.name, c.arguments) for c in view.calls], ids)
        closed = bool(s.turn) and s.turn[-1] in s.stop_ids
        # ρ, as the agent's jump map applies it: where it cuts the state, the turn continues as the template
        # writes it, else as the model wrote it
        cut = rewrite_state(self.protocol, state, s.turn, s.messages, sent)
        kept, written = (None, {"role": "assistant", "content": turns[-1]}) if cut is None else (cut[0], sent)
        client = s.messages if self.sent is None else self.sent + s.messages[self.start:]
        return conversation_key(client + [sent]), Continuation(state, s.messages + [written], ids, closed, s.name, s.t,
                                                               kept)


def call_id(s, index: int) -> str:
    """The id of the index-th call of a sequence's last turn (unique: the arc's name is)."""
    return f"call_{s.name.split('-', 1)[-1]}_{index}"
