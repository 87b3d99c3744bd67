"""Chat templates rendered the way the models' own files expect: `transformers`' conventions.

A model's chat template (Jinja, from its GGUF metadata, `tokenizer_config.json` or `chat_template.jinja`)
was written against `transformers`' `apply_chat_template`, so it is rendered in an environment with that
library's conventions: a sandbox with `trim_blocks`/`lstrip_blocks` and loop controls; a `tojson` filter
that keeps key order, writes non-ASCII as is and takes `indent`; `raise_exception`; `strftime_now`; the
`{% generation %}` block (rendered as its body); and the variables `messages`, `tools` (OpenAI-style
function schemas), `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`) and any extra
keyword (`enable_thinking`, ...). Messages reach the template as plain JSON data: keys whose value is
None are dropped, a call's `arguments` given as a JSON text becomes the object it encodes (templates
write `tool_call.arguments | tojson`), and reasoning is offered under every name templates read.

`mark_specials` and `MARK_OPEN`/`MARK_CLOSE` serve `Tokenizer.encode_chat`: the special-token strings
inside untrusted text are wrapped in private-use marks before rendering, so that the rendering shows
which of its special-token strings the template wrote.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from hybridlm.errors import InputError

# Two Unicode noncharacters: no text a template writes holds them; they are removed from untrusted text.
MARK_OPEN, MARK_CLOSE = "\ufdd0", "\ufdd1"

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: marks the assistant's part for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace` without attributes that start with "_" (no reach into the interpreter's internals)."""

    def __init__(*args, **kwargs):  # Jinja Namespace's signature, so that `namespace(self=…)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} starts with '_'")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the chat environment (cached: a server renders the same one per request)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict, namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"chat template: line {exc.lineno}: {exc.message}: expected a Jinja template") from None


def plain(value: Any) -> Any:
    """`value` as plain JSON data (dicts, lists, str, int, float, bool, None): all a template in the sandbox
    sees (a subclass of str could carry methods the sandbox does not know)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # a pydantic message (the openai client's types)
        return plain(value.model_dump())
    raise InputError(f"chat message holds a {type(value).__name__}: expected JSON data")


def template_messages(messages: list) -> list[dict]:
    """The messages as the template reads them: plain data without the fields whose value is None (an OpenAI
    `content: null` would render as "None"), calls' arguments as objects, reasoning under each of its names."""
    out = []
    for message in plain(list(messages)):
        if not isinstance(message, dict):
            raise InputError(f"chat message {str(message)[:40]!r}: expected an object with 'role' and 'content'")
        message = {k: v for k, v in message.items() if v is not None}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_structured_call(c) for c in calls]
        reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _structured_call(call):
    """A call whose `arguments` is a JSON text (the OpenAI wire form) with them decoded, as vLLM and llama.cpp
    hand them to a template; other arguments as given."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            decoded = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        if isinstance(decoded, dict):
            return {**call, "function": {**function, "arguments": decoded}}
    return call


def render_chat_template(source: str, messages: list, *, tools: list | None = None, add_generation_prompt: bool = True,
           now: Callable[[], datetime] | None = None, **variables: Any) -> str:
    """Render `messages` (and `tools`, OpenAI-style function schemas) with the chat template `source`.

    `variables` reach the template as they are (`bos_token`, `eos_token`, `enable_thinking`, ...); `now`
    pins the clock `strftime_now` reads (a fixed date for reproducible renderings)."""
    template = compile_template(source)
    clock = {} if now is None else {"strftime_now": lambda fmt: now().strftime(fmt)}
    try:
        return template.render(messages=template_messages(messages), tools=None if tools is None else plain(list(tools)),
                               add_generation_prompt=add_generation_prompt, **plain(variables), **clock)
    except jinja2.TemplateError as exc:
        raise InputError(f"chat template: {exc.message or type(exc).__name__}") from None
    except (TypeError, ValueError) as exc:  # a template's operation on values of the wrong kind
        raise InputError(f"chat template: {exc}") from None


# ------------------------------------------------------------------ special-token strings in untrusted text
@functools.lru_cache(maxsize=16)
def _specials_pattern(specials: tuple[str, ...]) -> re.Pattern | None:
    if not specials:
        return None
    return re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))


def mark_specials(value: Any, specials: tuple[str, ...]) -> Any:
    """Every string inside `value` (messages, tools; not the keys of objects) with each occurrence of a
    special-token string wrapped in MARK_OPEN…MARK_CLOSE, and the marks it already held removed (so
    none can be forged). The longest special string wins where two start at one place."""
    pattern = _specials_pattern(specials)

    def walk(v):
        if isinstance(v, str):
            v = v.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
            return v if pattern is None else pattern.sub(lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v

    return walk(value)
