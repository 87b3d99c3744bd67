"""smolagents' `ToolCallingAgent` through `hybridlm serve` on Qwen2.5-Coder-0.5B-Instruct (the registry's file).

The reference is smolagents itself: its `OpenAIServerModel` speaks to the server with the `openai` client
(tools, tool_choice "required", its stop strings), its agent runs the tools, and the test reads the agent's
own memory (each step's calls, observations and the final answer), not the server's output.

Two tools are offered; the task needs one of them (the weather), then `final_answer`. The run shows the
rule of docs/server.md: after a call, a newline is not yet the next call, so each step makes the call the
model chose and no other. (Before, the newline after Qwen's call was the separator of a next call only,
and the mask made it write the converter's call and `final_answer` in the same turn, before any result.)

A task that needs both tools does not get past the first result through smolagents, and the server is not why:
each step's prompt is `transformers`' rendering of what smolagents sent, token for token, and smolagents sends
its history as text turns, not tool messages. The same task with the calls and results sent as tool messages
makes Qwen choose both tools (docs/server.md has the measurements).
"""

import json

import pytest
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from hybridlm.server import Service, running

MODEL = "qwen2.5-coder-0.5b"
WEATHER = "sunny, 23 degrees Celsius"
conversions: list[float] = []  # what the converter was asked (it must not be: the task needs no conversion)


@tool
def get_weather(city: str) -> str:
    """The current weather of a city.

    Args:
        city: the city's name
    """
    return WEATHER if city.strip().lower() == "rome" else f"no weather station in {city}"


@tool
def celsius_to_fahrenheit(celsius: float) -> float:
    """Converts a temperature from degrees Celsius to degrees Fahrenheit.

    Args:
        celsius: the temperature in degrees Celsius
    """
    conversions.append(celsius)
    return celsius * 9 / 5 + 32


@tool
def get_temperature(city: str) -> float:
    """The current temperature of a city, in degrees Celsius.

    Args:
        city: the city's name
    """
    return 23.0 if city.strip().lower() == "rome" else float("nan")


TWO_TOOLS = "Get the temperature in Rome, then convert it to Fahrenheit."  # a task that needs both tools


@pytest.fixture(scope="module")
def qwen():
    from hybridlm import load_model
    from hybridlm.errors import ModelNotFoundError
    from hybridlm.weights.registry import real_model_path

    try:
        real_model_path(MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(f"{MODEL}: {exc}")
    return load_model(MODEL)


def test_tool_calling_agent_calls_the_weather_tool_then_final_answer(qwen):
    conversions.clear()
    with running(Service(qwen, model_id=MODEL)) as url:
        model = OpenAIServerModel(MODEL, api_base=url, api_key="unused", max_tokens=100, temperature=0,
                                  client_kwargs={"max_retries": 0, "timeout": 600})
        agent = ToolCallingAgent(tools=[get_weather, celsius_to_fahrenheit], model=model, max_steps=4,
                                 verbosity_level=-1)
        result = agent.run("What is the weather in Rome now?", return_full_result=True)
    steps = [s for s in agent.memory.steps if hasattr(s, "tool_calls")]
    calls = [[(c.name, c.arguments) for c in s.tool_calls or []] for s in steps]
    print(f"smolagents on {MODEL}: {len(steps)} steps, calls {calls}, {result.timing.duration:.1f} s")
    assert result.state == "success", calls
    assert calls == [[("get_weather", {"city": "Rome"})], [("final_answer", calls[-1][0][1])]], calls
    assert steps[0].observations == WEATHER and steps[-1].is_final_answer and not conversions
    # the final answer carries what the tool returned
    assert "23" in str(result.output) and "23" in json.dumps(calls[-1][0][1])
    # every step was one arc of the server that ended in its jump set at the model's own call
    for s in steps:
        extra = s.model_output_message.raw.model_extra["hybridlm"]
        assert extra["termination"] == ["jump_set"], extra


def test_a_two_tool_task_is_rendered_as_transformers_renders_it(qwen):
    """Each step of a task that needs both tools reaches the model as `transformers` renders the request
    smolagents sent (its system prompt, the tools through Qwen's own template, its history), token for token.

    What this pins down (docs/server.md): smolagents 1.26 writes its memory back as text, not as OpenAI tool
    messages: an assistant turn "Calling tools:\n[{...}]" (a Python repr) and a user turn "Observation:\n...".
    Qwen then never sees a call or a result in the `<tool_call>`/`<tool_response>` form it was trained on, and
    after the first result it calls `final_answer`; llama.cpp on the same rendering picks the same name. The same
    step with the call and result sent as tool messages makes the model choose the converter (the next test).
    """
    from transformers import AutoTokenizer

    from hybridlm.weights.registry import real_model_path

    path = real_model_path(MODEL)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    sent: list[dict] = []  # the requests smolagents makes, as it hands them to the openai client
    service = Service(qwen, model_id=MODEL)
    with running(service) as url:
        model = OpenAIServerModel(MODEL, api_base=url, api_key="unused", max_tokens=100, temperature=0,
                                  client_kwargs={"max_retries": 0, "timeout": 600})
        create = model.client.chat.completions.create
        model.client.chat.completions.create = lambda **request: (sent.append(request), create(**request))[1]
        agent = ToolCallingAgent(tools=[get_temperature, celsius_to_fahrenheit], model=model, max_steps=3,
                                 verbosity_level=-1)
        result = agent.run(TWO_TOOLS, return_full_result=True)
        arcs = [service.arcs.get(s.model_output_message.raw.model_extra["hybridlm"]["arcs"][0])
                for s in agent.memory.steps if getattr(s, "model_output_message", None) is not None]
    steps = [s for s in agent.memory.steps if hasattr(s, "tool_calls")]
    calls = [[(c.name, c.arguments) for c in s.tool_calls or []] for s in steps]
    print(f"smolagents on {MODEL}, two-tool task: calls {calls}, {result.timing.duration:.1f} s")
    assert len(sent) == len(arcs) >= 2 and result.state == "success" and steps[-1].is_final_answer, calls
    assert calls[0] == [("get_temperature", {"city": "Rome"})] and steps[0].observations == "23.0", calls
    for body, arc in zip(sent, arcs):
        assert body["tool_choice"] == "required" and [t["function"]["name"] for t in body["tools"]] == [
            "get_temperature", "celsius_to_fahrenheit", "final_answer"]
        messages = [{**m, "content": _text(m["content"])} for m in body["messages"]]
        text = reference.apply_chat_template(messages, tools=body["tools"], tokenize=False, add_generation_prompt=True)
        assert reference.decode(arc.prompt) == text
        assert arc.prompt == reference(text, add_special_tokens=False)["input_ids"]
    # the history smolagents sends: its calls and results as text turns, never tool messages
    history = [{**m, "content": _text(m["content"])} for m in sent[1]["messages"][2:]]
    assert [m["role"] for m in history] == ["assistant", "user"], history
    assert history[0]["content"].startswith("Calling tools:\n[{") and history[1]["content"] == "Observation:\n23.0"


def test_the_same_task_with_tool_messages_makes_both_calls(qwen):
    """The task and tools of the test above, the calls and results sent back as OpenAI tool messages (the
    openai client's own loop): Qwen chooses the converter itself after the first result, with its value, and
    each request continues the arc of the one before (the server's state, not a new prefill). The continued
    state is `transformers`' rendering of the conversation sent, token for token, as a new prefill of it
    would be: Qwen writes its calls in a ```json block, and the jump map writes them back as its template
    does (ρ, docs/theory.md §4)."""
    import openai
    from smolagents.default_tools import FinalAnswerTool
    from smolagents.models import get_tool_json_schema
    from transformers import AutoTokenizer

    from hybridlm.weights.registry import real_model_path

    path = real_model_path(MODEL)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tools = {t.name: t for t in (get_temperature, celsius_to_fahrenheit, FinalAnswerTool())}
    schemas = [get_tool_json_schema(t) for t in tools.values()]
    messages: list[dict] = [{"role": "user", "content": TWO_TOOLS}]
    calls, arcs, written = [], [], []
    service = Service(qwen, model_id=MODEL)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        for max_tokens in (100, 100, 1):  # the third request only shows that it continues the second arc
            r = client.chat.completions.create(model=MODEL, messages=messages, tool_choice="required", temperature=0,
                                               tools=schemas, max_tokens=max_tokens)
            ext = r.model_extra["hybridlm"]
            assert ext.get("continued_from") == (arcs[-1] if arcs else None), (calls, ext)
            arcs.append(ext["arcs"][0])
            arc = service.arcs.get(arcs[-1])
            written.append(qwen.tokenizer.decode(arc.generated))
            text = reference.apply_chat_template(_arguments_parsed(messages), tools=schemas, tokenize=False,
                                                 add_generation_prompt=True)
            assert arc.prompt == reference(text, add_special_tokens=False)["input_ids"], written
            if max_tokens == 1:
                break
            (call,) = r.choices[0].message.tool_calls
            calls.append((call.function.name, json.loads(call.function.arguments)))
            result = tools[call.function.name](**calls[-1][1])
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    print(f"{MODEL} with tool messages: calls {calls}, written {written}")
    assert calls == [("get_temperature", {"city": "Rome"}), ("celsius_to_fahrenheit", {"celsius": 23.0})], calls
    assert not written[0].startswith("<tool_call>"), written  # (so the turn was rewritten, not kept as written)
    assert messages[-1]["content"] == str(23.0 * 9 / 5 + 32)


def _arguments_parsed(messages: list[dict]) -> list[dict]:
    """The messages as a server gives them to a chat template: each call's arguments, a JSON string on the wire,
    parsed into the object the template writes with its `tojson` (llama.cpp's and vLLM's servers do the same)."""
    out = []
    for m in messages:
        calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in m.get("tool_calls") or []]
        out.append({**m, "tool_calls": calls} if calls else m)
    return out


def _text(content) -> str:
    """A message's content as text (smolagents sends a list of text parts; Qwen's template reads a string)."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def test_a_call_written_in_a_block_streams_as_it_answers_whole(qwen):
    """Under "required" Qwen writes its call in a ```json block, pretty-printed (its first choice after its own
    template's prompt): the `openai` client reads the same call from the stream's deltas as from the whole answer,
    and its arguments are JSON that follows the tool's schema."""
    import jsonschema
    import openai

    parameters = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                                                                                      "enum": ["C", "F"]}},
                  "required": ["city"]}
    request = dict(model=MODEL, messages=[{"role": "user", "content": "What's the weather in Rome and in Paris?"}],
                   tools=[{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                                            "parameters": parameters}}],
                   tool_choice="required", temperature=0, max_tokens=120)
    service = Service(qwen, model_id=MODEL)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        whole = client.chat.completions.create(**request)
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**request, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, ["", ""])
                if delta.function is not None:
                    entry[0] += delta.function.name or ""
                    entry[1] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        arc = service.arcs.get(whole.model_extra["hybridlm"]["arcs"][0])
    text = qwen.tokenizer.decode(arc.generated)
    print(f"{MODEL} under required: {text!r}")
    assert text.startswith("```json\n{\n")  # the block, pretty-printed: the form the model chose (one call: it
    # ends its turn after the first, as on BFCL's parallel tasks)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == finish == "tool_calls"
    assert [(call.function.name, call.function.arguments)] == [tuple(v) for _, v in sorted(streamed.items())]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters)
    assert call.function.name == "get_weather" and arguments["city"] == "Rome"
