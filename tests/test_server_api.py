"""The endpoints beside chat: OpenAI's Responses API and embeddings, Anthropic's Messages API,
llama.cpp's /tokenize and /detokenize, model aliases and /health while the model loads.

References: the `openai` client (responses.create with a tool and streamed, embeddings.create in
both encodings), the `anthropic` client (messages.create with a tool, messages.stream), llama.cpp
through llama-cpp-python (mean-pooled embeddings and the tokenizer of the same GGUF file), and
the chat endpoint for the same request (the same tokens under greedy decoding).
"""

import http.client
import json

import anthropic
import jsonschema
import numpy as np
import openai
import pytest

from hybridlm.server import Service, running

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK_WEATHER = "What is the weather in Rome?"


@pytest.fixture(scope="module")
def served(smollm2):
    with running(Service(smollm2, model_id=(MODEL, "gpt-4o-mini"))) as url:
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)


def chat_text(client, text: str, max_tokens: int) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content


# ====================================================================== Responses
def test_responses_text_equals_chat_and_streams_the_same(client):
    r = client.responses.create(model=MODEL, input="Say hello in French.", max_output_tokens=12, temperature=0)
    assert r.output_text == chat_text(client, "Say hello in French.", 12)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12
    events = list(client.responses.create(model=MODEL, input="Say hello in French.", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e.text for e in events if e.type == "response.output_text.done"]
    assert deltas == done == r.output_text == events[-1].response.output_text


def test_responses_tool_call_then_function_call_output_continues_the_arc(client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather of a city now", "parameters": WEATHER}
    r = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[tool], tool_choice="required",
                                max_output_tokens=60, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    again = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=30,
                                    temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                           "output": "sunny, 21 C"}])
    assert again.output_text
    # the kept state of the call's arc, as a chat continuation: no second prefill of the conversation
    assert again.model_extra["hybridlm"]["continued_from"] == r.model_extra["hybridlm"]["arcs"][0]
    events = list(client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[tool], tool_choice="required",
                                          max_output_tokens=60, temperature=0, stream=True))
    (added,) = [e.item for e in events if e.type == "response.output_item.added"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert added.type == "function_call" and added.name == "get_weather" and deltas == done == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments


def test_responses_refuse_what_they_cannot_do(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nothing")
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="conversation"):
        client.responses.create(model=MODEL, input="x", extra_body={"conversation": "c1"})


# ====================================================================== Messages
def test_messages_text_tool_and_stream(client, claude):
    m = claude.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Say hello in French."}],
                               extra_body={"temperature": 0})
    assert m.content[0].text == chat_text(client, "Say hello in French.", 12) and m.stop_reason == "max_tokens"
    tool = {"name": "get_weather", "description": "The weather of a city now", "input_schema": WEATHER}
    ask = [{"role": "user", "content": ASK_WEATHER}]
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[tool], tool_choice={"type": "any"},
                               extra_body={"temperature": 0})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    after = claude.messages.create(model=MODEL, max_tokens=30, tools=[tool], extra_body={"temperature": 0}, messages=[
        *ask, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}])
    assert after.content[0].text and after.model_extra["hybridlm"]["continued_from"] == m.model_extra["hybridlm"]["arcs"][0]
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[tool], tool_choice={"type": "any"},
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Say hello in French."}],
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
    assert text == chat_text(client, "Say hello in French.", 12)


def test_messages_errors_in_anthropics_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               extra_body={"thinking": {"type": "enabled", "budget_tokens": 10}})
    assert err.value.body["type"] == "error" and "thinking" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nothing", max_tokens=8, messages=[{"role": "user", "content": "x"}])


# ====================================================================== embeddings, tokens
@pytest.fixture(scope="module")
def llama(smollm2):
    import llama_cpp

    return llama_cpp.Llama(str(smollm2.gguf_path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                           n_ctx=256, verbose=False)


def test_embeddings_equal_llama_cpps_in_both_encodings(client, llama):
    texts = ["The cat sat on the mat.", "Quantum chromodynamics binds quarks.", "Rome is the capital of Italy."]
    as_base64 = client.embeddings.create(model="gpt-4o-mini", input=texts)  # the client asks for base64
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ours = np.array([d.embedding for d in as_float.data])
    assert np.array_equal(np.array([d.embedding for d in as_base64.data], dtype=np.float32), ours.astype(np.float32))
    reference = np.array(llama.embed(texts, normalize=True))
    cosines = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() > 0.99, cosines
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    assert as_float.usage.prompt_tokens == sum(len(llama.tokenize(t.encode(), add_bos=False)) for t in texts)
    first = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float",
                                     extra_body={"layer": 0, "pooling": "last"})
    assert not np.allclose(first.data[0].embedding, ours[0])
    with pytest.raises(openai.BadRequestError, match="layer"):
        client.embeddings.create(model=MODEL, input="x", extra_body={"layer": 10_000})


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out


def test_tokenize_and_detokenize_as_llama_cpp(served, llama):
    text = "Hello world <|im_end|> café"
    for parse_special in (True, False):
        status, out = post(served, "/tokenize", {"content": text, "parse_special": parse_special})
        assert status == 200 and out["tokens"] == llama.tokenize(text.encode(), add_bos=False, special=parse_special)
        status, back = post(served, "/detokenize", {"tokens": out["tokens"]})
        assert status == 200 and back["content"] == text
    status, out = post(served, "/tokenize", {"content": "café", "with_pieces": True})
    assert [p["id"] for p in out["tokens"]] == llama.tokenize("café".encode(), add_bos=False, special=True)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in out["tokens"]) == "café".encode()
    status, out = post(served, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and out["error"]["param"] == "tokens"


def test_a_big_body_is_read_first_apart_and_then_served(served, llama):
    """A body past SCREEN_BYTES is read by the screening process before the server reads it: within the
    bounds it is served as any other (tokens as llama.cpp's), past them it gets the 400 naming the bound."""
    from hybridlm.server.bounds import MAX_VALUES, SCREEN_BYTES

    text = "Rome, café; " * (SCREEN_BYTES // 10)
    status, out = post(served, "/tokenize", {"content": text, "parse_special": False})
    assert status == 200 and out["tokens"] == llama.tokenize(text.encode(), add_bos=False, special=False)
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_VALUES // 2)}}
    status, out = post(served, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [{"type": "function", "function": {
                                                         "name": "f", "parameters": schema}}]})
    assert status == 400 and f"{MAX_VALUES:,} JSON values" in out["error"]["message"], out


# ====================================================================== names, health
def test_aliases_are_listed_and_answered(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "gpt-4o-mini"]
    r = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_health_says_loading_until_the_model_is_in(smollm2):
    """The app before its service is ready (`hybridlm serve` while the model loads): /health is 503
    "loading", every other route 503 `loading`; once ready, 200."""
    from fastapi.testclient import TestClient

    from hybridlm.server.app import create_app, ready

    app = create_app(None)
    with TestClient(app, base_url="http://127.0.0.1") as http:  # (the guard answers its own address only)
        r = http.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"}) and r.headers["retry-after"] == "1"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        service = Service(smollm2, model_id=MODEL).start()
        try:
            ready(app, service)
            assert http.get("/health").json() == {"status": "ok", "model": MODEL}
            assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        finally:
            service.close()
