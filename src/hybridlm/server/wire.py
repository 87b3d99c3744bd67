"""The OpenAI wire format: request bodies checked into typed requests, and errors in OpenAI's shape.

Parsing is a pure function of the body's bytes (`parse_chat`, `parse_completion`), so it can
be tested and fuzzed without a server. Every bad value becomes an `APIError` that names the
parameter and what was expected, sent as OpenAI sends it:

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

Every top-level field is honoured or refused with a 400 that names it. The only fields accepted
without an effect are those OpenAI's own clients send that do not change the tokens
(`OPENAI_NO_EFFECT`, one list); llama.cpp's and vLLM's extensions of the request are honoured
where the kernel or a constraint gives their effect (`min_p`, `top_k`, `repeat_penalty`,
`repetition_penalty`, `grammar`, `json_schema`, `guided_*`, `structured_outputs`) and refused
otherwise (docs/server.md has the table).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field, Strict

from hybridlm.server.bounds import OutOfBounds, check_counts

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings (OpenAI's limit)
MAX_STOP_CHARS = 512  # characters of one stop string (each is searched for at every streamed token)
MAX_TOP_LOGPROBS = 20

# Numbers and flags as JSON writes them: `true` is not 1 and "0.7" is not 0.7 (OpenAI refuses both).
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Flag = Annotated[bool, Strict()]


class APIError(Exception):
    """An error the client gets as an OpenAI error body with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, " ".join(message.split()), type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = "response"
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's json_object with a schema


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (one of its keys)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StreamOptions(_Strict):
    include_usage: Flag = False


class _Sampling(_Body):
    model: str
    temperature: Num | None = Field(default=None, ge=0, le=2)
    top_p: Num | None = Field(default=None, gt=0, le=1)
    # llama.cpp's and vLLM's sampling extensions (hybridlm.engine.sampling.Kernel's inputs)
    top_k: Int | None = Field(default=None, ge=-1)  # −1 and 0: off
    min_p: Num | None = Field(default=None, ge=0, le=1)
    repeat_penalty: Num | None = Field(default=None, gt=0)
    repeat_last_n: Int | None = Field(default=None, ge=-1)
    repetition_penalty: Num | None = Field(default=None, gt=0)  # vLLM's: over the whole context
    # structured output (one at most): llama.cpp's grammar (GBNF or Lark) and json_schema, vLLM's guided_*
    grammar: str | None = None
    json_schema: dict[str, Any] | bool | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None  # (vLLM takes it on completions too)
    n_predict: Int | None = Field(default=None, ge=-1)  # llama.cpp's max_tokens (−1: up to the context)
    cache_prompt: Flag | None = None  # llama.cpp's; the prefix cache never changes the tokens
    # any 64-bit integer, signed or not (llama.cpp's clients send -1); taken modulo 2⁶⁴
    seed: Int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Num | None = Field(default=None, ge=-2, le=2)
    presence_penalty: Num | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Num] | None = None
    user: str | None = None


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    parallel_tool_calls: Flag | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Flag = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    functions: Any = None  # OpenAI's deprecated form of tools: refused, not ignored
    function_call: Any = None


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=16, ge=0)
    max_completion_tokens: Int | None = Field(default=None, ge=0)  # llama.cpp's alias of n_predict here too
    logprobs: Int | None = Field(default=None, ge=0, le=5)
    echo: Flag = False
    suffix: str | None = None
    best_of: Int | None = Field(default=None, ge=1)


# Fields OpenAI's clients send that change no token here: accepted and not acted on, as OpenAI
# itself accepts them. Every other field the body models do not name is refused.
OPENAI_NO_EFFECT = frozenset({
    "user",  # an end-user id for abuse monitoring
    "metadata", "store",  # stored completions (nothing is stored beyond /v1/arcs)
    "service_tier",  # a billing tier
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention",  # OpenAI's caching and monitoring keys
})

# ---------------------------------------------------------------------- parsing
Body = TypeVar("Body", bound=BaseModel)


def known_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(f.alias or name for name, f in cls.model_fields.items())


def json_object(raw: bytes | str | dict) -> dict:
    """The body as a JSON object without its null fields (a null is the parameter's default), or an
    APIError (400): not JSON, not an object, or a string that is not text."""
    escaped = True  # (a dict given: it may hold anything)
    if isinstance(raw, (bytes, bytearray, str)):
        # JSON text can spell a surrogate only as a \\uD800-\\uDFFF escape: without one the walk below is skipped
        escaped = _SURROGATE_ESCAPE.search(raw if isinstance(raw, str) else raw.decode("latin-1")) is not None
        try:
            data = json.loads(raw)
        except RecursionError:
            raise refusal({"too_deep": True}) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise refusal({"not_json": str(exc)[:120]}) from None
    else:
        data = raw
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got a JSON {type(data).__name__}")
    # an explicit null is the parameter's default, as OpenAI, vLLM and llama.cpp read it ("n": null)
    data = {k: v for k, v in data.items() if v is not None}
    where = _lone_surrogate(data) if escaped else None
    if where is not None:
        raise invalid(f"'{where}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair): "
                      "not text", param=where or None)
    return data


def refusal(verdict: dict) -> APIError:
    """The 400 for a verdict of `hybridlm.server.bounds.verdict` other than {"ok": true}."""
    if verdict.get("too_deep"):
        return invalid("the request body is nested too deeply to be a request")
    if "not_json" in verdict:
        return invalid(f"the request body is not JSON ({verdict['not_json']})")
    return invalid(str(verdict.get("bound")), param=verdict.get("param"))


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes | str | dict, cls: type[Body]) -> Body:
    """The body as `cls`, or an APIError (400) naming the first bad parameter."""
    return _validate(json_object(raw), cls)


def _validate(data: dict, cls: type[Body]) -> Body:
    unknown = [k for k in data if k not in known_fields(cls) and k not in OPENAI_NO_EFFECT]
    if unknown:
        name = str(unknown[0])[:60]
        raise invalid(f"'{name}' is not a parameter this server acts on; it is refused rather than ignored "
                      "(docs/server.md lists the parameters)", param=name, code="unsupported_parameter")
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise invalid("the request body is nested too deeply to be a request") from None


def _lone_surrogate(data) -> str | None:
    """Where in the body a string (or key) holds a lone surrogate, which JSON's \\u escapes can write
    and no encoder can turn into text; None when there is none."""
    stack = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and any("\ud800" <= ch <= "\udfff" for ch in node):
                return path
        elif isinstance(node, dict):
            for key, value in node.items():
                here = f"{path}.{key}" if path else str(key)
                if not key.isascii() and any("\ud800" <= ch <= "\udfff" for ch in key):
                    return path
                stack.append((value, here))
        elif isinstance(node, list):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(node))
    return None


def _validation_error(exc: pydantic.ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = min(errors, key=lambda e: len(e["loc"]))  # the shallowest: a union's branches nest deeper
    loc = [str(p) for p in first["loc"] if not _union_branch(p)]
    param = ""
    for part in loc:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    value = first.get("input")
    shown = json.dumps(value, default=str)[:80] if first["type"] != "missing" else None
    what = "is required" if first["type"] == "missing" else f"= {shown}: {first['msg'].lower()}"
    return invalid(f"'{param or 'body'}' {what}", param=param or None)


def _union_branch(part) -> bool:
    """pydantic names the union branch it tried in the location (e.g. 'str', 'list[int]')."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part.startswith(
        ("function-", "literal[", "json-or-python")) or part in ("NamedToolChoice",))


def parse_chat(raw) -> ChatBody:
    data = json_object(raw)
    _check_counts(data)
    body = _validate(data, ChatBody)
    _check_sampling(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise invalid("max_tokens and max_completion_tokens differ; give one", param="max_completion_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream: true", param="stream_options")
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, old) is not None:
            raise invalid(f"{old} is OpenAI's deprecated form of {new}: send {new} instead", param=old)
    for i, m in enumerate(body.messages):
        _check_message(m, i)
    _check_tool_turns(body.messages)
    if body.tools is not None:
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise invalid(f"tool names must be unique, got {names}", param="tools")
        for i, t in enumerate(body.tools):
            kind = t.function.parameters.get("type", "object")
            if kind != "object":
                raise invalid(f"tools[{i}] ({t.function.name}): parameters must be a JSON Schema of type object, "
                              f"got type {json.dumps(kind)[:40]}", param=f"tools[{i}].function.parameters")
    return body


def parse_completion(raw) -> CompletionBody:
    data = json_object(raw)
    _check_counts(data)
    body = _validate(data, CompletionBody)
    _check_sampling(body)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream: true", param="stream_options")
    if body.suffix:
        raise invalid("suffix (insertion) is not supported by this model", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of other than n is not supported", param="best_of")
    if body.echo and body.logprobs is not None:
        raise invalid("echo with logprobs (the prompt's log-probabilities) is not supported", param="echo")
    prompts = prompt_list(body.prompt)
    if not prompts:
        raise invalid("prompt is empty", param="prompt")
    for i, p in enumerate(prompts):
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise invalid(f"prompt[{i}] is empty", param="prompt")
    return body


def prompt_list(prompt) -> list[str | list[int]]:
    """OpenAI's four shapes of `prompt` as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def stop_list(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP:
        raise invalid(f"at most {MAX_STOP} stop sequences, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise invalid("a stop sequence must not be empty", param="stop")
    long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise invalid(f"a stop sequence of {len(long):,} characters: at most {MAX_STOP_CHARS}", param="stop")
    return stops


MAX_BIAS = 100  # OpenAI's bound on a logit bias
MAX_ID_DIGITS = 9  # a token id has fewer digits than this (vocabularies are far below 10⁹)


def _check_counts(data: dict) -> None:
    try:
        check_counts(data)
    except OutOfBounds as exc:
        raise invalid(exc.message, param=exc.param) from None


def _check_sampling(body: _Sampling) -> None:
    for key, bias in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > MAX_ID_DIGITS:
            raise invalid(f"logit_bias key {key[:24]!r}: expected a token id (at most {MAX_ID_DIGITS} digits)",
                          param="logit_bias")
        if not -MAX_BIAS <= bias <= MAX_BIAS:
            raise invalid(f"logit_bias for token {key}: {bias} is outside [-{MAX_BIAS}, {MAX_BIAS}]",
                          param="logit_bias")
    stop_list(body.stop)
    if body.repetition_penalty is not None and body.repeat_penalty is not None \
            and body.repetition_penalty != body.repeat_penalty:
        raise invalid("repeat_penalty (llama.cpp's) and repetition_penalty (vLLM's) differ; give one",
                      param="repetition_penalty")
    if body.repetition_penalty is not None and body.repeat_last_n not in (None, -1):
        raise invalid("repetition_penalty acts on the whole context (repeat_last_n -1); for a window give "
                      "repeat_penalty with repeat_last_n", param="repeat_last_n")
    given = [k for k in STRUCTURED if getattr(body, k) is not None]
    if len(given) > 1:
        raise invalid(f"{given[0]} and {given[1]} each constrain the output; give one", param=given[1])
    rf = body.response_format
    if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
        raise invalid("response_format of type json_schema needs json_schema.schema", param="response_format")


def response_format_schema(rf: ResponseFormat | None) -> dict | bool | None:
    """The JSON Schema a `response_format` asks the reply to follow (json_object: any object, or
    llama.cpp's `schema`); None for text or none."""
    if rf is not None and rf.type == "json_object":
        return rf.schema_ if rf.schema_ is not None else {"type": "object"}
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        return rf.json_schema.schema_
    return None


STRUCTURED = ("grammar", "json_schema", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
              "structured_outputs")


def structured(body: _Sampling) -> tuple[str, Any] | None:
    """The output constraint a request's llama.cpp or vLLM fields ask for, as (kind, value) with
    kind json_schema | regex | grammar | choice; None when none does."""
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if len(given) != 1:
            raise invalid("structured_outputs needs exactly one of json, regex, choice, grammar",
                          param="structured_outputs")
        return given[0]
    for field, kind in (("json_schema", "json_schema"), ("guided_json", "json_schema"), ("grammar", "grammar"),
                        ("guided_grammar", "grammar"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = getattr(body, field)
        if value is not None:
            return kind, value
    return None


def _check_message(m: Message, i: int) -> None:
    where = f"messages[{i}]"
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.get("type") != "text":
                raise invalid(f"{where}.content[{j}]: only text parts are supported, got type {part.get('type')!r}",
                              param=f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]: a text part needs 'text' (a string), got "
                              f"{json.dumps(part.get('text'))[:40]}", param=f"{where}.content")
    if m.role == "tool" and not m.tool_call_id:
        raise invalid(f"{where}: a tool message needs tool_call_id", param=f"{where}.tool_call_id")
    if m.role != "assistant" and m.tool_calls:
        raise invalid(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    if m.role in ("system", "developer", "user", "tool") and m.content is None:
        raise invalid(f"{where}: a {m.role} message needs content", param=f"{where}.content")
    # (a call's arguments in the history are taken as written: a call cut by max_tokens is not JSON)


def _check_tool_turns(messages: list[Message]) -> None:
    """OpenAI's rule for a conversation with calls: every tool message answers a call of the
    assistant message before its run of tool messages, and every such call is answered before the
    conversation goes on (or ends)."""
    open_calls: dict[str, None] = {}  # calls of the last assistant message not yet answered (a set in call order)
    opened_at = -1
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                what = "no preceding assistant message has tool_calls" if opened_at < 0 else \
                    f"messages[{opened_at}] has no unanswered call with that id"
                raise invalid(f"messages[{i}]: a tool message must answer a call of the assistant message before "
                              f"it; tool_call_id {str(m.tool_call_id)[:40]!r}: {what}", param=f"messages[{i}].tool_call_id")
            del open_calls[m.tool_call_id]
            continue
        if open_calls:
            raise _unanswered(opened_at, list(open_calls))
        if m.role == "assistant" and m.tool_calls:
            open_calls, opened_at = dict.fromkeys(c.id for c in m.tool_calls), i
        else:
            opened_at = -1
    if open_calls:
        raise _unanswered(opened_at, list(open_calls))


def _unanswered(at: int, ids: list[str]) -> APIError:
    return invalid(f"messages[{at}]: an assistant message with tool_calls must be followed by tool messages "
                   f"answering each call; unanswered: {', '.join(repr(i[:40]) for i in ids[:4])}",
                   param=f"messages[{at}].tool_calls")


def text_of(content) -> str:
    """A message's content as text (a list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


# ---------------------------------------------------------------------- embeddings, tokenize
class EmbeddingsBody(_Body):
    """OpenAI's embeddings request; `layer` and `pooling` choose the hidden state (hybridlm's)."""

    model: str
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(default=None, ge=1)
    layer: Int | None = None
    pooling: Literal["mean", "last"] = "mean"
    normalize: Flag = True


class TokenizeBody(_Body):
    """llama.cpp's /tokenize."""

    content: str
    add_special: Flag = False
    parse_special: Flag = True
    with_pieces: Flag = False


class DetokenizeBody(_Body):
    """llama.cpp's /detokenize."""

    tokens: list[Int]
