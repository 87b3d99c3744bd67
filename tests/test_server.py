"""`hybridlm serve` against the real `openai` client, on 127.0.0.1 and a free port.

References: the `openai` client's own parsing of every response and stream; the library's
engine and agent for the same request run in process (the same tokens); a forward pass over
the whole string for log-probabilities; jsonschema for structured output; prometheus_client's
parser for /metrics; the trace schema for the arcs.
"""

import concurrent.futures as cf
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import jsonschema
import openai
import pytest
import torch
from click.testing import CliRunner

from agent_fakes import ScriptedModel
from hybridlm.agent import HybridAgent, Limits
from hybridlm.tools import registry
from hybridlm.engine.trace import read_trace
from hybridlm.cli import cli
from hybridlm.engine import Kernel, generate
from hybridlm.server import Service, running

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
CALCULATOR = {"type": "function", "function": registry(["calculator"]).tools["calculator"].schema()}


@pytest.fixture(scope="module")
def served(smollm2):
    service = Service(smollm2, model_id=MODEL, max_batch=32)
    with running(service) as url:
        yield url, service


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0], api_key="unused", max_retries=0, timeout=300)


def ask(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def arc_events(url: str, arc: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/arcs/{arc}") as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.read().decode().splitlines()]


def arc_tokens(url: str, arc: str) -> list[int]:
    return [e["token"] for e in arc_events(url, arc) if e["event"] == "token"]


def base(url: str) -> str:
    return url.removesuffix("/v1")


# ====================================================================== models, health, plain chat
def test_models_health_and_unknown_model(served, client):
    url, _ = served
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=ask("hi"), max_tokens=2)
    assert info.value.body["param"] == "model"
    with urllib.request.urlopen(f"{base(url)}/health") as r:
        assert json.loads(r.read()) == {"status": "ok", "model": MODEL}


def test_greedy_chat_equals_the_token_clock_on_the_same_prompt(served, client, smollm2):
    url, _ = served
    messages = ask("Name three colours.", system="You answer briefly.")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    tok = smollm2.tokenizer
    prompt = tok.encode_markup(tok.render_chat(messages, add_generation_prompt=True))
    ref = generate(smollm2, prompt, kernel=Kernel(greedy=True), max_new_tokens=12)
    ours = arc_tokens(url, r.model_extra["hybridlm"]["arcs"][0])
    assert ours == ref.generated_ids
    assert r.choices[0].message.content == tok.decode([i for i in ref.generated_ids if i not in tok.stop_ids()])
    assert r.choices[0].finish_reason == ("length" if ref.stop_reason == "token_budget" else "stop")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref.generated_ids)


def test_stream_concatenates_to_the_response(client):
    kwargs = dict(model=MODEL, messages=ask("Write a sentence about the sea."), max_tokens=24, temperature=0.9,
                  seed=11)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_and_n_choices(client):
    kwargs = dict(model=MODEL, messages=ask("Describe the moon in two sentences."), max_tokens=30, temperature=0)
    free = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = free[len(free) // 2: len(free) // 2 + 3]  # a stop string the output is known to contain
    r = client.chat.completions.create(**kwargs, stop=["\u00a7never", stop])
    assert r.choices[0].message.content == free[: free.index(stop)] and r.choices[0].finish_reason == "stop"
    two = client.chat.completions.create(model=MODEL, messages=ask("Tell me a word."), max_tokens=8, seed=5, n=2,
                                         temperature=1.0)
    second = client.chat.completions.create(model=MODEL, messages=ask("Tell me a word."), max_tokens=8, seed=6,
                                            temperature=1.0)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[1].message.content == second.choices[0].message.content  # choice i is seed + i


def test_logprobs_equal_a_forward_pass_over_the_string(served, client, smollm2):
    url, _ = served
    messages = ask("What is the capital of Italy?")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    tokens = arc_tokens(url, r.model_extra["hybridlm"]["arcs"][0])
    tok = smollm2.tokenizer
    prompt = tok.encode_markup(tok.render_chat(messages, add_generation_prompt=True))
    with torch.no_grad():
        logits = smollm2(torch.tensor([prompt + tokens]))[0]
    ref = torch.log_softmax(logits.double(), -1)
    stops = tok.stop_ids()
    kept = [(i, t) for i, t in enumerate(tokens) if t not in stops]
    assert len(content) == len(kept)
    for entry, (i, t) in zip(content, kept):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry.logprob - float(row[t])) < 2e-3
        assert len(entry.top_logprobs) == 3
        best = torch.topk(row, 3)
        assert [tok.token_str(int(j)) for j in best.indices] == [e.token for e in entry.top_logprobs]
        assert bytes(entry.bytes).decode("utf-8", "replace") == tok.token_str(t) or "\ufffd" in tok.token_str(t)


def test_streamed_logprobs_ride_on_the_content_they_wrote(client):
    """Each content chunk carries the log-probabilities of its tokens, whose bytes are its text;
    all chunks together hold what the whole response holds."""
    kwargs = dict(model=MODEL, messages=ask("Name three colours."), max_tokens=12, temperature=0, logprobs=True,
                  top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed, text_bytes, lp_bytes = [], b"", b""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        entries = choice.logprobs.content if choice.logprobs is not None else []
        streamed += entries
        if choice.delta.content:
            assert entries, f"content {choice.delta.content!r} came without its log-probabilities"
            text_bytes += choice.delta.content.encode()
            lp_bytes += b"".join(bytes(e.bytes) for e in entries)
            assert lp_bytes.decode("utf-8", "replace").startswith(text_bytes.decode())
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4))
                                                                  for e in whole.logprobs.content]
    assert text_bytes.decode() == whole.message.content


def test_penalties_and_logit_bias_follow_openais_definition(served, client, smollm2):
    """Each greedy token is the argmax of a whole-string forward pass's logits with OpenAI's
    penalties and bias written out: z + b − α_f·c − α_p·1[c > 0], c counting generated tokens."""
    url, _ = served
    messages = ask("List the days of the week.")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    first = arc_tokens(url, plain.model_extra["hybridlm"]["arcs"][0])[0]
    bias = {first: -100.0, 11: 1.5}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                       frequency_penalty=1.2, presence_penalty=0.6,
                                       logit_bias={str(k): v for k, v in bias.items()})
    tokens = arc_tokens(url, r.model_extra["hybridlm"]["arcs"][0])
    assert tokens[0] != first
    tok = smollm2.tokenizer
    prompt = tok.encode_markup(tok.render_chat(messages, add_generation_prompt=True))
    with torch.no_grad():
        logits = smollm2(torch.tensor([prompt + tokens]))[0].double()
    counts: dict[int, int] = {}
    for i, t in enumerate(tokens):
        z = logits[len(prompt) - 1 + i].clone()
        for v, b in bias.items():
            z[v] += b
        for v, c in counts.items():
            z[v] -= 1.2 * c + 0.6
        assert float(z.max() - z[t]) < 1e-3, (i, t, int(z.argmax()))
        counts[t] = counts.get(t, 0) + 1


# ====================================================================== tools
def test_required_and_named_tool_choice_make_schema_valid_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER],
                                       tool_choice="required", max_tokens=60, temperature=0, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"),
                                       tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert {c.function.name for c in r.choices[0].message.tool_calls} == {"get_time"}
    for c in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), TIME["function"]["parameters"])


def test_tool_choice_none_and_auto(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER],
                                       tool_choice="none", max_tokens=30, temperature=0)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" not in r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER],
                                       max_tokens=60, temperature=0)
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls and all(c.function.name == "get_weather" for c in choice.message.tool_calls)
    else:
        assert choice.message.tool_calls is None and "<tool_call>" not in (choice.message.content or "")


def scripted(smollm2, script: str, **kwargs) -> Service:
    return Service(ScriptedModel(smollm2.tokenizer, [script]), model_id="scripted", **kwargs)


PARALLEL = ('<tool_call>{"name": "add", "arguments": {"a": -3, "b": 4.5}}</tool_call>\n'
            '<tool_call>{"name": "city", "arguments": {"name": "上海", "tags": ["port", "east"]}}</tool_call>')
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
CITY = {"type": "function", "function": {"name": "city", "description": "facts about a city", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_stream_as_exact_argument_deltas(smollm2, stream):
    with running(scripted(smollm2, PARALLEL)) as url:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        kwargs = dict(model="scripted", messages=ask("Add -3 and 4.5, and tell me about Shanghai."),
                      tools=[ADD, CITY], tool_choice="required", max_tokens=120, temperature=0)
        if not stream:
            r = c.chat.completions.create(**kwargs)
            calls = [(t.id, t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
            finish = r.choices[0].finish_reason
        else:
            parts: dict[int, dict] = {}
            finish = None
            for chunk in c.chat.completions.create(**kwargs, stream=True):
                delta = chunk.choices[0].delta
                for t in delta.tool_calls or []:
                    p = parts.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                    if t.id is not None:
                        assert p["id"] is None, "the id is sent once"
                        p["id"], p["name"] = t.id, t.function.name
                    else:
                        assert t.function.name is None, "the name is sent once"
                    p["arguments"] += t.function.arguments or ""
                assert not delta.content
                finish = chunk.choices[0].finish_reason or finish
            calls = [(p["id"], p["name"], p["arguments"]) for _, p in sorted(parts.items())]
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [("add", '{"a": -3, "b": 4.5}'),
                                             ("city", '{"name": "上海", "tags": ["port", "east"]}')]
    assert len({i for i, _, _ in calls}) == 2


def test_client_side_round_trip_continues_the_agents_arc(served, client, smollm2):
    """A call returned to the client, its result sent back: the tokens are those of the agent that
    runs the same tool itself (the state continued, not prefilled again). The task is one whose call
    the model closes itself: a call the budget closed is no jump and says "length" (test_budget.py)."""
    url, service = served
    task = "What is 5230 minus 148?"
    agent = HybridAgent(smollm2, registry(["calculator"]), example=False, tool_choice="required",
                        limits=Limits(max_token_steps=120, max_jumps=1))
    ref = agent.run(task)
    assert len(ref.jumps) == 1
    messages = ask(task)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == ref.jumps[0].arguments
    result = registry(["calculator"]).call(call.function.name, json.loads(call.function.arguments)).text
    hits = service.continuations.hits
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], tool_choice="none",
                                            max_tokens=120 - first.usage.completion_tokens, temperature=0)
    assert service.continuations.hits == hits + 1
    ext = second.model_extra["hybridlm"]
    assert ext["continued_from"] == first.model_extra["hybridlm"]["arcs"][0]
    tokens = arc_tokens(url, first.model_extra["hybridlm"]["arcs"][0]) + arc_tokens(url, ext["arcs"][0])
    assert tokens == ref.generated_ids
    assert second.choices[0].message.content.strip() == ref.answer
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_every_round_trip_continues_the_arc_before_it(served, client):
    """The second request that brings a result continues the arc of the first, as the first continued the
    request before it: a continued arc's conversation is keyed as the client will send it back, not as the
    model wrote it (tests/test_smolagents.py checks the same on Qwen, whose template takes the calls structured)."""
    _, service = served
    messages = ask("What is the weather in Paris, in Rome and in Oslo?")
    arcs: list[str] = []
    for result in ("sunny", "rainy", "snowing"):
        hits = service.continuations.hits
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
        ext = r.model_extra["hybridlm"]
        assert r.choices[0].finish_reason == "tool_calls", (arcs, r.choices[0].message)
        assert ext.get("continued_from") == (arcs[-1] if arcs else None)
        assert service.continuations.hits == hits + bool(arcs)
        arcs.append(ext["arcs"][0])
        (call,) = r.choices[0].message.tool_calls
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]


def test_server_side_tools_run_the_agents_jump_map(smollm2):
    task = "What is 123456 * 789?"
    reg = registry(["calculator"])
    ref = HybridAgent(smollm2, reg, example=False, tool_choice="auto", parallel_tool_calls=True,
                      limits=Limits(max_token_steps=100, max_jumps=3, max_jumps_per_step=3)).run(task)
    with running(Service(smollm2, model_id=MODEL, tools=reg, max_jumps=3)) as url:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=ask(task), max_tokens=100, temperature=0)
        ext = r.model_extra["hybridlm"]
        assert arc_tokens(url, ext["arcs"][0]) == ref.generated_ids
        assert [j["arguments"] for j in ext.get("jumps", [[]])[0]] == [j.arguments for j in ref.jumps]
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content.strip().endswith(ref.answer)
        events = arc_events(url, ext["arcs"][0])
        leave = [e for e in events if e["event"] == "batch" and e["action"] == "leave"]
        assert len(leave) == len(ref.jumps) and all(e["reason"] == "q_E" for e in leave)
        # a structured reply asked of a server with tools of its own: they are not offered
        r = c.chat.completions.create(model=MODEL, messages=ask("A number, as JSON."), max_tokens=24,
                                      temperature=0, response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict) and not r.model_extra["hybridlm"].get("jumps")


def test_server_side_mcp_tool_is_a_jump_of_the_request(smollm2):
    """--mcp on serve: a real MCP server (tests/mcp_server.py, stdio) offers `add`; a request that
    brings no tools gets it, the server runs the call, and the arc names the tool's server."""
    from pathlib import Path

    from hybridlm.cli.options import tool_registry

    server = f"{sys.executable} {Path(__file__).with_name('mcp_server.py')}"
    script = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
    with tool_registry("none", mcp=[server]) as reg:
        service = Service(ScriptedModel(smollm2.tokenizer, [script, "The sum is 42."]), model_id="scripted",
                          tools=reg)
        with running(service) as url:
            c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
            r = c.chat.completions.create(model="scripted", messages=ask("Add 20 and 22."), tool_choice="required",
                                          max_tokens=80, temperature=0)
            (jumps,) = r.model_extra["hybridlm"]["jumps"]
            assert [(j["tool"], j["arguments"], j["observation"], j["error"]) for j in jumps] == \
                [("add", {"a": 20, "b": 22}, "42", None)]
            assert r.choices[0].message.tool_calls is None and "42" in r.choices[0].message.content
            (jump,) = [e for e in arc_events(url, r.model_extra["hybridlm"]["arcs"][0]) if e["event"] == "jump"]
            assert jump["server"] is not None


# ====================================================================== structured output
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(client, stream):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "tired"]}, "friends": {"type": "array", "items": {"type": "string"},
                                                                "maxItems": 3}},
        "required": ["name", "age", "mood"], "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=ask("Invent a person and describe them as JSON."), max_tokens=80,
                  temperature=1.0, seed=3, response_format={"type": "json_schema", "json_schema": {
                      "name": "person", "schema": schema, "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("max_tokens", [1, 3, 6])
def test_a_call_cut_by_max_tokens_leaks_no_markup(client, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=ask("Weather in Paris?"), tools=[WEATHER],
                                       tool_choice="required", max_tokens=max_tokens, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and "<" not in (choice.message.content or "")
    stream = client.chat.completions.create(model=MODEL, messages=ask("Weather in Paris?"), tools=[WEATHER],
                                            tool_choice="required", max_tokens=max_tokens, temperature=0, stream=True)
    assert "<" not in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_response_format_holds_beside_tools_that_may_not_be_called(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=ask("Which city is the capital of France? JSON."),
                                       tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {"name": "c",
                                                                                               "schema": schema}})
    assert r.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# ====================================================================== errors
@pytest.mark.parametrize("kwargs, status, param, code", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "response_format", None),
    (dict(messages=ask("word " * 9000)), 400, "messages", "context_length_exceeded"),
    (dict(max_tokens=10**6), 400, "max_tokens", "context_length_exceeded"),
    (dict(temperature=3), 400, "temperature", None),
    (dict(n=0), 400, "n", None),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "tool_choice", None),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]), 400, None, None),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, None, None),
    (dict(messages=[{"role": "tool", "content": "5"}]), 400, None, None),
    (dict(frequency_penalty=2.5), 400, "frequency_penalty", None),
    (dict(logit_bias={"hello": 1}), 400, "logit_bias", None),
    (dict(logit_bias={"\u00b2": 1}), 400, "logit_bias", None),
    (dict(logit_bias={"13": 101}), 400, "logit_bias", None),
    (dict(logit_bias={"49152": -100}), 400, "logit_bias", None),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    (dict(temperature=True), 400, "temperature", None),
    (dict(n=17), 400, "n", None),
    (dict(logit_bias={"9" * 5000: 1}), 400, "logit_bias", None),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages[0].content", None),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), 400,
     "tools[0].function.parameters", None),
    # OpenAI's rule for calls in the history: each tool message answers a call just made, each call is answered
    (dict(messages=ask("hi") + [{"role": "tool", "tool_call_id": "x", "content": "1"}]), 400,
     "messages[1].tool_call_id", None),
    (dict(messages=ask("hi") + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}] + ask("and?"),
        tools=[WEATHER]), 400, "messages[1].tool_calls", None),
    (dict(messages=ask("hi") + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "1"}], tools=[WEATHER]), 400, "messages[2].tool_call_id",
     None),
])
def test_bad_requests_get_openai_errors(client, kwargs, status, param, code):
    request = dict(model=MODEL, messages=ask("hi"), max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**request)
    err = info.value
    assert err.status_code == status
    body = err.body
    assert set(body) >= {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert "\n" not in body["message"] and len(body["message"]) < 400
    if param is not None:
        assert body["param"] == param, body
    if code is not None:
        assert body["code"] == code, body


def raw(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}


def test_bodies_that_are_not_requests(served):
    url, _ = served
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b"{" * 100_000, b'{"model": "smollm2-135m"}'):
        status, out = raw(url, "POST", "/v1/chat/completions", body)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (body[:20], out)
    status, out = raw(url, "GET", "/v1/arcs/no-such-arc")
    assert status == 404 and out["error"]["code"] == "arc_not_found"
    status, out = raw(url, "GET", "/v1/nowhere")
    assert status == 404 and "error" in out
    # JSON can escape a lone UTF-16 surrogate, which is no text: 400 naming where, never a 500
    for path, body in (("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": '
                                                 b'"a\\ud800b"}], "max_tokens": 2}'),
                       ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\udfff"], "max_tokens": 2}')):
        status, out = raw(url, "POST", path, body.replace(b"%s", MODEL.encode()))
        assert status == 400 and "surrogate" in out["error"]["message"], out
        assert out["error"]["param"] in ("messages[0].content", "prompt[1]"), out
    status, out = raw(url, "POST", "/v1/chat/completions",
                      json.dumps({"model": MODEL, "messages": ask("hi"), "temperature": float("nan")}).encode())
    assert status == 400 and out["error"]["param"] == "temperature", out
    status, out = raw(url, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": [True, False]}).encode())
    assert status == 400 and out["error"]["param"] == "prompt", out
    status, out = raw(url, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 9000}).encode())
    assert status == 400 and out["error"]["param"] == "prompt", out
    assert out["error"]["code"] == "context_length_exceeded"
    status, _ = raw(url, "HEAD", "/health")
    assert status == 200


def test_metrics_label_routes_not_raw_paths(served):
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = served
    for junk in ("a1", "b2", "c3"):
        assert raw(url, "GET", f"/v1/arcs/{junk}")[0] == 404
    with urllib.request.urlopen(f"{base(url)}/metrics") as r:
        text = r.read().decode()
    endpoints = {s.labels["endpoint"] for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name.startswith("hybridlm_requests")}
    assert "/v1/arcs/{arc_id}" in endpoints and not any(e.endswith(("a1", "b2", "c3")) for e in endpoints)


@pytest.fixture(scope="module")
def strict(smollm2):
    """A server with an API key, a 64 KB body limit, a batch of one and no queue."""
    service = Service(smollm2, model_id=MODEL, max_batch=1, max_queue=0)
    with running(service, api_key="s3cret", max_body_bytes=64 * 1024) as url:
        yield url, service


def test_api_key_body_limit_and_overload(strict):
    url, service = strict
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert info.value.body["code"] == "invalid_api_key"
    c = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
    assert [m.id for m in c.models.list()] == [MODEL]
    with urllib.request.urlopen(f"{base(url)}/health") as r:  # no key needed
        assert r.status == 200
    with pytest.raises(openai.APIStatusError) as info:
        c.chat.completions.create(model=MODEL, messages=ask("x" * 100_000), max_tokens=2)
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    # one long stream holds the only row; the next request is refused with 503 and Retry-After
    stream = c.chat.completions.create(model=MODEL, messages=ask("Tell me a long story."), max_tokens=400,
                                       temperature=1.0, seed=1, stream=True)
    next(iter(stream))
    with pytest.raises(openai.APIStatusError) as info:
        c.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "overloaded"
    assert info.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.BadRequestError) as info:  # more than it could ever hold: no retry helps
        c.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2, n=2)
    assert info.value.body["param"] == "n" and info.value.body["code"] == "too_many_sequences"
    stream.close()
    wait_until(lambda: service.in_flight == 0)
    assert c.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2).choices


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_disconnect_mid_stream_frees_the_rows(served, client):
    url, service = served
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": MODEL, "messages": ask("Tell me a very long story about a dragon."),
                       "max_tokens": 2000, "stream": True, "temperature": 1.0, "seed": 2}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while seen.count(b"data: ") < 5:
        got = sock.recv(65536)
        assert got, seen  # (the server closed the connection: its answer says why)
        seen += got
    arc = re.search(rb"x-hybridlm-arcs: (\S+)", seen, re.I).group(1).decode()
    sock.close()
    wait_until(lambda: service.arcs.get(arc).done, timeout=10)
    s = service.arcs.get(arc)
    assert s.arc.termination.value == "cancelled" and s.t < 2000
    assert s not in service.engine.active
    r = client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


# ====================================================================== concurrency
def test_64_concurrent_requests_each_equal_served_alone(served, client):
    url, _ = served
    prompts = ["Name a fruit.", "Name a river.", "Say a number.", "Name a planet."]
    requests = [(prompts[i % 4], 100 + i // 4) for i in range(16)] * 4  # 16 distinct, each four times

    def one(req):
        text, seed = req
        r = client.chat.completions.create(model=MODEL, messages=ask(text), max_tokens=6, temperature=1.0, seed=seed)
        return r.model_extra["hybridlm"]["arcs"][0]

    with cf.ThreadPoolExecutor(64) as pool:
        arcs = list(pool.map(one, requests))
    alone = {req: arc_tokens(url, one(req)) for req in dict.fromkeys(requests)}
    for req, arc in zip(requests, arcs):
        assert arc_tokens(url, arc) == alone[req], req


# ====================================================================== completions, arcs, metrics
def test_completions_plain_stream_echo_and_logprobs(served, smollm2):
    url, _ = served
    c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    tok = smollm2.tokenizer
    prompt = "The capital of France is"
    ref = generate(smollm2, tok.encode(prompt), kernel=Kernel(greedy=True), max_new_tokens=8, stop_ids=set())
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    assert r.choices[0].text == tok.decode(ref.generated_ids)
    assert r.choices[0].logprobs.tokens == [tok.token_str(i) for i in ref.generated_ids]
    assert all(len(top) == 2 for top in r.choices[0].logprobs.top_logprobs)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                                          temperature=0, stream=True) if ch.choices)
    assert streamed == r.choices[0].text
    echo = c.completions.create(model=MODEL, prompt=[prompt, "One, two,"], max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(prompt) and echo.choices[1].text.startswith("One, two,")
    ids = c.completions.create(model=MODEL, prompt=tok.encode(prompt), max_tokens=8, temperature=0)
    assert ids.choices[0].text == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)


def test_arcs_parse_against_the_trace_schema_and_render(served, client, tmp_path):
    url, _ = served
    r = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER],
                                       tool_choice="required", max_tokens=60, temperature=0)
    arc = r.model_extra["hybridlm"]["arcs"][0]
    path = tmp_path / "arc.jsonl"
    with urllib.request.urlopen(f"{url}/arcs/{arc}") as resp:
        path.write_bytes(resp.read())
    events = read_trace(path)
    assert events[0]["event"] == "start" and events[0]["system"] == "chat"
    assert events[-1]["event"] == "end" and events[-1]["stop_reason"] == "jump_set"
    with urllib.request.urlopen(f"{url}/arcs/{arc}/report") as resp:
        html = resp.read().decode()
    assert html.startswith("<!DOCTYPE html>") and "get_weather" in html
    kept = served[1].arcs.get(arc)  # an ended arc keeps its events, not its rows of the KV state
    assert kept.done and kept.x is None and kept.continues is None and len(kept.arc.events) == len(events)


def test_metrics_count_tokens_batches_and_prefix_reuse(served, client):
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = served
    system = "You are a careful assistant. " * 20  # a shared system prompt: prefilled once
    for question in ("Name a colour.", "Name an animal."):
        client.chat.completions.create(model=MODEL, messages=ask(question, system=system), max_tokens=3)
    with urllib.request.urlopen(f"{base(url)}/metrics") as r:
        text = r.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert values["hybridlm_tokens_generated_total"] > 0
    assert values["hybridlm_prefix_cache_hits_total"] >= 1 and values["hybridlm_prefix_cache_hit_tokens_total"] > 100
    for name in ("hybridlm_tokens_per_second", "hybridlm_batch_rows", "hybridlm_queue_length",
                 "hybridlm_batch_occupancy_mean", "hybridlm_time_to_first_token_seconds_count"):
        assert name in values and math.isfinite(values[name])
    modes = {s.labels["mode"] for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "hybridlm_mode_seconds_total"}
    assert modes == {"q_G", "q_E"}


# ====================================================================== the command line
@pytest.mark.parametrize("args, fragment", [
    (["--port", "70000"], "70000"),
    (["--max-batch", "0"], "max-batch"),
    (["--api-key", " "], "api-key"),
    (["--tools", "teleport"], "teleport"),
    (["--context-policy", "sideways"], "sideways"),
    (["--threads", "0"], "threads"),
    (["--served-model-name", "a,,b"], "served-model-name"),
])
def test_serve_rejects_bad_options_in_one_line(args, fragment):
    r = CliRunner().invoke(cli, ["serve", "--model", "no-such-model", *args])
    assert r.exit_code == 2 and fragment in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_serve_device_cuda_without_cuda_is_one_line():
    r = CliRunner().invoke(cli, ["serve", "--model", "no-such-model", "--device", "cuda"])
    assert r.exit_code == 2 and "no CUDA device" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_serve_names_a_busy_port_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = CliRunner().invoke(cli, ["serve", "--model", "no-such-model", "--port", str(port)])
    assert r.exit_code == 2 and f"127.0.0.1:{port}" in r.output, r.output


def test_serve_command_answers_the_openai_client():
    env = {**os.environ, "HYBRIDLM_API_KEY": "k", "PYTHONFAULTHANDLER": "1"}
    p = subprocess.Popen([sys.executable, "-m", "hybridlm.cli", "serve", "--port", "0", "--max-batch", "4",
                          "--log-level", "warning", "--threads", "1"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "/v1" not in line and time.monotonic() < deadline:
            line = p.stderr.readline()
            assert line or p.poll() is None, "the server exited"
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line).group(1)
        assert ", cpu, 1 thread)" in line, line  # --threads: torch's own count of intra-op threads in the server
        c = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=3)
        assert r.choices[0].message.content is not None
    finally:
        # SIGTERM, which serve handles as Ctrl-C: a SIGINT is ignored by a child of a backgrounded job (`cmd &`)
        p.send_signal(signal.SIGTERM)
        try:
            _, rest = p.communicate(timeout=90)  # reading stderr to its end: a full pipe would hold the exit
        except subprocess.TimeoutExpired:  # (SIGABRT: the child's faulthandler prints where each thread waits)
            p.send_signal(signal.SIGABRT)
            try:
                _, rest = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, rest = p.communicate()
    assert p.returncode == 0, rest[-6000:]


def test_nulls_negative_seeds_and_deprecated_functions(served, client):
    """OpenAI's clients send explicit nulls and llama.cpp's send seed −1; the deprecated
    functions/function_call are refused (not silently replaced by the server's own tools)."""
    url, _ = served
    body = {"model": MODEL, "messages": ask("Say hi."), "max_tokens": 3, "temperature": 0, "n": None, "stream": None,
            "logprobs": None, "seed": -1}
    status, out = raw(url, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and len(out["choices"]) == 1, out
    again = client.chat.completions.create(model=MODEL, messages=ask("Tell me a word."), max_tokens=6, seed=-1,
                                           temperature=1.0)
    same = client.chat.completions.create(model=MODEL, messages=ask("Tell me a word."), max_tokens=6, seed=-1,
                                          temperature=1.0)
    assert again.choices[0].message.content == same.choices[0].message.content  # −1 is a seed like any other
    for name, value in (("functions", [WEATHER["function"]]), ("function_call", "auto")):
        status, out = raw(url, "POST", "/v1/chat/completions",
                          json.dumps({"model": MODEL, "messages": ask("hi"), name: value}).encode())
        assert status == 400 and out["error"]["param"] == name and "deprecated" in out["error"]["message"]


def test_a_value_closed_by_max_tokens_says_length(client):
    """max_tokens below a demanded call's or value's shortest form cuts it ("length", as OpenAI's
    truncation does); a value that fits only because the budget closed it early is whole JSON and
    says "length" too; one the model ended itself says "stop"."""
    for kwargs in (dict(tools=[WEATHER], tool_choice="required"),
                   dict(response_format={"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": {
                       "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                       "required": ["city", "country"], "additionalProperties": False}}})):
        r = client.chat.completions.create(model=MODEL, messages=ask("Where is the Eiffel tower?"), max_tokens=4,
                                           temperature=0, **kwargs)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens <= 4
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": schema}}
    for max_tokens in (12, 14, 200):
        r = client.chat.completions.create(model=MODEL, messages=ask("Where is the Eiffel tower? Answer in JSON."),
                                           max_tokens=max_tokens, temperature=0, response_format=fmt)
        choice = r.choices[0]
        jsonschema.validate(json.loads(choice.message.content), schema)  # always a whole value
        # 12 and 14 leave less than the closing witness and its margin: the budget closes the value
        assert choice.finish_reason == ("stop" if max_tokens == 200 else "length"), (max_tokens, choice)
        assert r.usage.completion_tokens <= max_tokens


def test_a_final_lone_angle_bracket_is_the_models():
    from hybridlm.turns import render

    tools = frozenset({"f"})
    assert render(["a <<<"], final=True, client_tools=tools, cut=False).content == "a <<<"  # the model ended it
    assert render(["a <<<"], final=True, client_tools=tools, cut=True).content == "a <<"  # a call cut by the budget
    assert render(["a <tool_c"], final=True, client_tools=tools).content == "a "
    assert render(["a <"], final=False, client_tools=tools).content == "a "  # held back while it may still open


def test_an_ended_request_hands_memory_back_while_others_run(smollm2, monkeypatch):
    """The heap's free pages go back to the kernel when a sequence ends, not only when the engine goes
    idle: a server that always has a stream running would otherwise keep every ended request's buffers."""
    import hybridlm.server.service as service_module

    service = Service(smollm2, model_id=MODEL, max_batch=4)
    trims: list[int] = []  # rows still running at each trim
    monkeypatch.setattr(service_module, "return_freed_memory", lambda: trims.append(len(service.engine.active)))
    with running(service) as url:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        with cf.ThreadPoolExecutor(2) as pool:
            long = pool.submit(c.chat.completions.create, model=MODEL, messages=ask("Tell me a long story."),
                               max_tokens=80, temperature=0,
                               logit_bias={str(i): -100 for i in smollm2.tokenizer.stop_ids()})  # runs all 80
            time.sleep(0.5)
            short = c.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=2, temperature=0)
            assert short.choices[0].finish_reason == "length"
            assert long.result().usage.completion_tokens == 80
    assert any(rows > 0 for rows in trims), trims  # a trim while the long request still ran
    assert len(trims) >= 2  # and one after each ended request
