"""Two more dialects of the same chat: OpenAI's Responses API and Anthropic's Messages API.

Each request is read into an OpenAI chat request (hybridlm.server.wire.ChatBody) and runs as one
(the same hybrid system, the same kept continuations); its chat.completion, or its stream of
chat.completion.chunk events, is written back in the dialect's shape:

    /v1/responses   input items ↔ messages; function_call / function_call_output items ↔ tool_calls /
                    tool messages; `previous_response_id` prepends the conversation that response
                    ended (kept by `Conversations`), so a function_call_output continues from the
                    state the call's arc ended in, as a chat continuation does;
    /v1/messages    content blocks ↔ messages; tool_use / tool_result blocks ↔ tool_calls / tool messages;
                    stop_reason end_turn | max_tokens | stop_sequence | tool_use.

Fields of each dialect are honoured or refused (400) by the rule of the chat wire: the lists below.
"""

from __future__ import annotations

import collections
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from hybridlm.server.wire import OPENAI_NO_EFFECT, invalid

# ---------------------------------------------------------------------- Responses
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "stream",
    "previous_response_id", "parallel_tool_calls", "text", "seed", "top_k", "min_p", "repetition_penalty",
})
RESPONSES_NO_EFFECT = OPENAI_NO_EFFECT | {"truncation", "include", "reasoning", "background"}
_DEFAULT_OF = {"truncation": ("disabled",), "include": ([],), "reasoning": ({}, {"effort": None}), "background": (False,)}


class Conversations:
    """The chat messages each response ended with, by response id (the last `max_entries`)."""

    def __init__(self, max_entries: int = 1000) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, messages: list[dict]) -> None:
        with self._lock:
            self._entries[key] = messages
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, key: str) -> list[dict] | None:
        with self._lock:
            return self._entries.get(key)


def _check_fields(data: dict, honoured: frozenset, no_effect: frozenset, defaults: dict) -> None:
    for key, value in data.items():
        if key in honoured or value is None:
            continue
        if key in no_effect and (key not in defaults or value in defaults[key]):
            continue
        what = f"{key}={json.dumps(value)[:40]}" if key in no_effect else f"'{key}'"
        raise invalid(f"{what} is not a parameter this server acts on; it is refused rather than ignored "
                      "(docs/server.md lists the parameters)", param=key, code="unsupported_parameter")


def _text_of_parts(content, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: expected text or a list of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got {kind!r}", param=where)
        out.append(part["text"])
    return "".join(out)


def responses_to_chat(data: Any, store: Conversations) -> tuple[dict, list[dict]]:
    """A Responses request as (a chat request's body, its messages)."""
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    _check_fields(data, RESPONSES_FIELDS, RESPONSES_NO_EFFECT, _DEFAULT_OF)
    messages: list[dict] = []
    previous = data.get("previous_response_id")
    if previous is not None:
        kept = store.get(str(previous))
        if kept is None:
            raise invalid(f"previous_response_id {str(previous)[:60]!r}: no such response is kept "
                          f"(the last {store.max_entries} are)", param="previous_response_id", code="not_found")
        messages = [m for m in kept if m["role"] not in ("system", "developer")]
    if data.get("instructions"):
        messages.insert(0, {"role": "system", "content": str(data["instructions"])})
    items = data.get("input")
    if items is None:
        raise invalid("'input' is required", param="input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise invalid("input: expected text or a list of input items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}: role {role!r}: expected user, system, developer or assistant", param=where)
            text = _text_of_parts(item.get("content"), f"{where}.content", ("input_text", "output_text", "text"))
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            after = i > 0 and (items[i - 1].get("type") == "function_call" or items[i - 1].get("role") == "assistant")
            if after and messages and messages[-1]["role"] == "assistant":  # the calls of that assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of_parts(output, f"{where}.output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        else:
            raise invalid(f"{where}: items of type {str(kind)[:40]!r} are not supported (message, function_call, "
                          "function_call_output are)", param=where)
    chat: dict[str, Any] = {"model": data.get("model"), "messages": messages}
    for key in ("temperature", "top_p", "stream", "parallel_tool_calls", "seed", "top_k", "min_p",
                "repetition_penalty"):
        if data.get(key) is not None:
            chat[key] = data[key]
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    if data.get("tools"):
        tools = data["tools"]
        if not isinstance(tools, list):
            raise invalid("tools: expected a list", param="tools")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise invalid(f"tools[{i}]: only function tools are supported, got type {kind!r}", param=f"tools[{i}]")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            chat["tools"].append({"type": "function", "function": fn})
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (data.get("text") or {}).get("format") if isinstance(data.get("text"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise invalid("text.format: expected an object", param="text.format")
        if fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        else:
            chat["response_format"] = {"type": fmt.get("type")}
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat, messages


def _response(ident: str, data: dict, output: list[dict], status: str, usage: dict | None, created: int,
              incomplete: str | None = None) -> dict:
    return {
        "id": ident, "object": "response", "created_at": created, "status": status, "model": data.get("model"),
        "output": output, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": data.get("instructions"), "metadata": data.get("metadata") or {},
        "parallel_tool_calls": data.get("parallel_tool_calls", True), "temperature": data.get("temperature"),
        "top_p": data.get("top_p"), "tool_choice": data.get("tool_choice", "auto"), "tools": data.get("tools") or [],
        "previous_response_id": data.get("previous_response_id"), "max_output_tokens": data.get("max_output_tokens"),
        "text": data.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": usage, "store": True,
    }


def _responses_usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _assistant(content: str | None, calls: list[dict]) -> dict:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def chat_to_response(chat: dict, data: dict, messages: list[dict], store: Conversations) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    output = ([_message_item(message["content"])] if message.get("content") else []) + [_call_item(c) for c in calls]
    ident = f"resp_{chat['id'].split('-', 1)[-1]}"
    store.put(ident, messages + [_assistant(message.get("content"), calls)])
    length = choice["finish_reason"] == "length"
    return {**_response(ident, data, output, "incomplete" if length else "completed", _responses_usage(chat["usage"]),
                        chat["created"], "max_output_tokens" if length else None), "hybridlm": chat["hybridlm"]}


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _deltas(chat_stream: AsyncIterator[str]) -> AsyncIterator[tuple[str, Any]]:
    """What a chat stream says, in the order it says it, up to [DONE]: ("text", a content delta),
    ("call", a tool-call delta: index, and id and name on its first part, arguments), ("usage", the
    usage object), ("finish", a finish reason), ("error", the error object; nothing follows it). Both
    translators below read a chat stream through this one front."""
    async for text in chat_stream:
        payload = text.removeprefix("data: ").strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            yield "error", chunk["error"]
            return
        if chunk.get("usage"):
            yield "usage", chunk["usage"]
        for c in chunk.get("choices", []):
            delta = c.get("delta") or {}
            if delta.get("content"):
                yield "text", delta["content"]
            for part in delta.get("tool_calls") or []:
                yield "call", part
            if c.get("finish_reason"):
                yield "finish", c["finish_reason"]


async def response_events(chat_stream: AsyncIterator[str], data: dict, messages: list[dict],
                          store: Conversations) -> AsyncIterator[str]:
    """A chat stream as the Responses API's events: response.created, output items opened, their text
    or argument deltas, each item done, response.completed (or response.incomplete at the budget)."""
    ident, created, seq = f"resp_{secrets.token_hex(12)}", int(time.time()), 0
    output: list[dict] = []
    text_item: dict | None = None
    calls: dict[int, dict] = {}  # chat call index -> function_call item
    finish, usage = None, None

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return _sse(kind, {"type": kind, "sequence_number": seq - 1, **fields})

    def close_text():
        nonlocal text_item
        if text_item is None:
            return []
        i, part = output.index(text_item), text_item["content"][0]
        text_item["status"] = "completed"
        out = [event("response.output_text.done", item_id=text_item["id"], output_index=i, content_index=0,
                     text=part["text"], logprobs=[]),
               event("response.content_part.done", item_id=text_item["id"], output_index=i, content_index=0,
                     part=part),
               event("response.output_item.done", output_index=i, item=text_item)]
        text_item = None
        return out

    start = _response(ident, data, [], "in_progress", None, created)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    async for kind, value in _deltas(chat_stream):
        if kind == "error":
            yield event("error", code=value.get("code"), message=value["message"], param=None)
            return
        if kind == "usage":
            usage = value
        elif kind == "finish":
            finish = value
        elif kind == "text":
            if text_item is None:
                text_item = _message_item("", "in_progress")
                output.append(text_item)
                i = len(output) - 1
                yield event("response.output_item.added", output_index=i, item={**text_item, "content": []})
                yield event("response.content_part.added", item_id=text_item["id"], output_index=i,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            text_item["content"][0]["text"] += value
            yield event("response.output_text.delta", item_id=text_item["id"], output_index=output.index(text_item),
                        content_index=0, delta=value, logprobs=[])
        else:  # a tool-call delta
            for e in close_text():
                yield e
            item = calls.get(value["index"])
            args = value.get("function", {}).get("arguments", "")
            if item is None:
                item = _call_item({"id": value["id"], "function": {"name": value["function"]["name"],
                                                                   "arguments": ""}}, "in_progress")
                calls[value["index"]] = item
                output.append(item)
                yield event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
            if args:
                item["arguments"] += args
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=output.index(item), delta=args)
    for e in close_text():
        yield e
    for item in calls.values():
        i = output.index(item)
        item["status"] = "completed"
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                    arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    text = "".join(o["content"][0]["text"] for o in output if o["type"] == "message")
    chat_calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                  for o in output if o["type"] == "function_call"]
    store.put(ident, messages + [_assistant(text or None, chat_calls)])
    length = finish == "length"
    final = _response(ident, data, output, "incomplete" if length else "completed", _responses_usage(usage), created,
                      "max_output_tokens" if length else None)
    yield event("response.incomplete" if length else "response.completed", response=final)


# ---------------------------------------------------------------------- Anthropic Messages
MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "tools", "tool_choice", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "metadata",
})
STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error(status: int, message: str) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(status, "api_error"), "message": message}}


def messages_to_chat(data: Any) -> dict:
    """An Anthropic Messages request as a chat request's body."""
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    _check_fields(data, MESSAGES_FIELDS, frozenset(), {})
    if data.get("max_tokens") is None:
        raise invalid("'max_tokens' is required", param="max_tokens")
    messages: list[dict] = []
    system = data.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of_parts(system, "system", ("text",))})
    given = data.get("messages")
    if not isinstance(given, list) or not given:
        raise invalid("messages: expected a non-empty list", param="messages")
    for i, m in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{where}: expected a message with role user or assistant", param=where)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{where}.content: expected text or a list of content blocks", param=where)
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": str(b.get("name", "")),
                                           "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                result = b.get("content", "")
                result = result if isinstance(result, str) else _text_of_parts(result, f"{where}.content[{j}]",
                                                                                ("text",))
                if b.get("is_error"):
                    result = f"error: {result}"
                messages.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": result})
            else:
                raise invalid(f"{where}.content[{j}]: blocks of type {str(kind)[:40]!r} are not supported here (text, "
                              "tool_use in assistant turns, tool_result in user turns)", param=f"{where}.content")
        if m["role"] == "assistant":
            messages.append(_assistant("".join(text) or None, calls))
        elif text:
            messages.append({"role": "user", "content": "".join(text)})
    chat: dict[str, Any] = {"model": data.get("model"), "messages": messages, "max_tokens": data["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "stream"):
        if data.get(key) is not None:
            chat[key] = data[key]
    if data.get("stop_sequences"):
        chat["stop"] = data["stop_sequences"]
    if data.get("tools"):
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object", "properties": {}})}}
            for t in data["tools"] if isinstance(t, dict)]
    choice = data.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        chat["tool_choice"] = mapped if mapped else {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def chat_to_message(chat: dict, data: dict) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": _tool_input(c["function"]["arguments"])} for c in message.get("tool_calls") or []]
    reason = STOP_REASON.get(choice["finish_reason"], "end_turn")
    termination = (chat.get("hybridlm") or {}).get("termination", [None])[0]
    if termination == "stop_sequence":
        reason = "stop_sequence"
    return {"id": f"msg_{chat['id'].split('-', 1)[-1]}", "type": "message", "role": "assistant",
            "model": data.get("model"), "content": content, "stop_reason": reason,
            "stop_sequence": None, "usage": {"input_tokens": chat["usage"]["prompt_tokens"],
                                             "output_tokens": chat["usage"]["completion_tokens"]},
            "hybridlm": chat["hybridlm"]}


async def message_events(chat_stream: AsyncIterator[str], data: dict) -> AsyncIterator[str]:
    """A chat stream as Anthropic's events: message_start, each content block's start, deltas and
    stop, message_delta with the stop reason and usage, message_stop."""
    ident = f"msg_{secrets.token_hex(12)}"
    block: int = -1
    open_kind: str | None = None
    calls: dict[int, int] = {}  # chat call index -> block index
    finish, usage = None, None
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": ident, "type": "message", "role": "assistant", "model": data.get("model"), "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    async for kind, value in _deltas(chat_stream):
        if kind == "error":
            yield _sse("error", anthropic_error(500, value["message"]))
            return
        if kind == "usage":
            usage = value
        elif kind == "finish":
            finish = value
        elif kind == "text":
            if open_kind != "text":
                if open_kind is not None:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
                block, open_kind = block + 1, "text"
                yield _sse("content_block_start", {"type": "content_block_start", "index": block,
                                                   "content_block": {"type": "text", "text": ""}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": block,
                                               "delta": {"type": "text_delta", "text": value}})
        else:  # a tool-call delta
            if value["index"] not in calls:
                if open_kind is not None:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
                block, open_kind = block + 1, "tool_use"
                calls[value["index"]] = block
                yield _sse("content_block_start", {"type": "content_block_start", "index": block, "content_block": {
                    "type": "tool_use", "id": value["id"], "name": value["function"]["name"], "input": {}}})
            args = value.get("function", {}).get("arguments", "")
            if args:
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": calls[value["index"]],
                                                   "delta": {"type": "input_json_delta", "partial_json": args}})
    if open_kind is not None:
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
    yield _sse("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": STOP_REASON.get(finish or "stop", "end_turn"),
                                           "stop_sequence": None},
                                 "usage": {"output_tokens": (usage or {}).get("completion_tokens", 0)}})
    yield _sse("message_stop", {"type": "message_stop"})
