"""The token budget and a tool call, through `hybridlm serve` and the real `openai` client.

The rule (docs/server.md, "The budget and a call"): the budget closes an open call only at its
very end, and a call it closed says `finish_reason: "length"` (never "tool_calls"), is no jump and
keeps no continuation. The reference is the request itself at every max_tokens: the model's own
call (`{"city": "Rome"}`) or "length", never a value cut short with "tool_calls".
"""

import concurrent.futures as cf
import json

import openai
import pytest

from hybridlm.server import Service, running

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ROME = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def client(smollm2):
    # every request of the sweep at once: they share the engine's batch (continuous batching)
    with running(Service(smollm2, model_id=MODEL, max_batch=64)) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)


def test_every_max_tokens_gives_the_models_call_or_length(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    asks = [("required", n) for n in range(16, 65)] + [(named, n) for n in range(16, 65, 4)]

    def one(ask):
        choice, n = ask
        r = client.chat.completions.create(model=MODEL, messages=ROME, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=n, temperature=0)
        return ask, r.choices[0], r.usage.completion_tokens

    with cf.ThreadPoolExecutor(len(asks)) as pool:
        results = list(pool.map(one, asks))
    finishes = []
    for (_, n), c, used in results:
        assert used <= n
        assert c.finish_reason in ("tool_calls", "length"), (n, c)
        if c.finish_reason == "tool_calls":
            (call,) = c.message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"}), (n, c)
        finishes.append(c.finish_reason)
    # the call the model writes itself is 30 tokens: from there on every budget holds it
    assert all(c.finish_reason == "tool_calls" for (_, n), c, _ in results if n >= 30)
    assert "length" in finishes


def test_a_call_the_budget_closed_says_length_and_is_no_jump(client, smollm2):
    """The model runs away inside a calculator expression: the budget closes the call at its last
    token; the call comes back as written with "length", and no continuation is kept for it."""
    from hybridlm.agent import HybridAgent, Limits
    from hybridlm.tools import registry

    task = "What is 123456 * 789?"
    calculator = {"type": "function", "function": registry(["calculator"]).tools["calculator"].schema()}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": task}], tools=[calculator],
                                       tool_choice="required", max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.model_extra["hybridlm"]["termination"] == ["token_budget"]
    (call,) = c.message.tool_calls  # whole JSON: the budget closed it, it did not cut it
    assert "expression" in json.loads(call.function.arguments)
    ref = HybridAgent(smollm2, registry(["calculator"]), example=False, tool_choice="required",
                      limits=Limits(max_token_steps=60, max_jumps=1)).run(task)
    assert ref.jumps == [] and ref.stop_reason == "token_budget" and ref.answer == ""


# ====================================================================== the call horizon and repeats
def call(name: str, arguments: dict) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def scripted_calls(smollm2, script: list[str], **service) -> list[tuple[str, dict]]:
    """The client-side calls a scripted model's turn returns (parallel calls allowed), whole and streamed."""
    from agent_fakes import ScriptsModel

    with running(Service(ScriptsModel(smollm2.tokenizer, [script, script]), model_id="scripted", **service)) as url:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=ROME, tools=[WEATHER], tool_choice="required",
                                      max_tokens=200, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        streamed: dict[int, str] = {}
        for chunk in c.chat.completions.create(model="scripted", messages=ROME, tools=[WEATHER], tool_choice="required",
                                               max_tokens=200, temperature=0, stream=True):
            for t in (chunk.choices[0].delta.tool_calls if chunk.choices else None) or []:
                streamed[t.index] = streamed.get(t.index, "") + (t.function.arguments or "")
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls]
    assert [json.loads(a) for _, a in sorted(streamed.items())] == [a for _, a in calls]  # the stream says the same
    return calls


def test_a_repeated_call_ends_the_turn_unmade_and_the_horizon_bounds_a_turn(smollm2):
    rome, paris, oslo, lima = ({"city": c} for c in ("Rome", "Paris", "Oslo", "Lima"))
    script = [call("get_weather", rome) + "\n" + call("get_weather", rome) + "\n" + call("get_weather", paris)]
    assert scripted_calls(smollm2, script) == [("get_weather", rome)]  # the repeat closed the turn
    assert scripted_calls(smollm2, script, repeat_calls=True) == [("get_weather", a) for a in (rome, rome, paris)]
    four = ["\n".join(call("get_weather", a) for a in (rome, paris, oslo, lima))]
    assert scripted_calls(smollm2, four, max_calls=2) == [("get_weather", rome), ("get_weather", paris)]
    assert scripted_calls(smollm2, four, max_calls=4) == [("get_weather", a) for a in (rome, paris, oslo, lima)]


# ====================================================================== server-side and client-side tools
def test_server_tools_run_here_and_client_tools_come_back_in_a_plain_request(smollm2):
    """`--tools calculator` on the server, get_weather from the client, no tool_choice: the
    calculator's call runs here (a jump of the arc, its observation the real tool's), then the
    client's call ends the arc and is returned."""
    from agent_fakes import ScriptedModel
    from hybridlm.tools import registry

    reg = registry(["calculator"])
    script = [call("calculator", {"expression": "6 * 7"}), call("get_weather", {"city": "Rome"})]
    with running(Service(ScriptedModel(smollm2.tokenizer, script), model_id="scripted", tools=reg)) as url:
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=ROME, tools=[WEATHER], max_tokens=120, temperature=0)
    choice, ext = r.choices[0], r.model_extra["hybridlm"]
    assert choice.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == \
        [("get_weather", {"city": "Rome"})]
    (jumps,) = ext["jumps"]
    six_sevens = reg.call("calculator", {"expression": "6 * 7"}).text
    assert [(j["tool"], j["observation"]) for j in jumps] == [("calculator", six_sevens)]
