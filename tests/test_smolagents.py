"""smolagents' `ToolCallingAgent` through `hybridlm serve` on Qwen2.5-Coder-0.5B-Instruct (the registry's file).

The reference is smolagents itself: its `OpenAIServerModel` speaks to the server with the `openai` client
(tools, tool_choice "required", its stop strings), its agent runs the tools, and the test reads the agent's
own memory (each step's calls, observations and the final answer), not the server's output.

Two tools are offered; the task needs one of them (the weather), then `final_answer`. The run shows the
rule of docs/server.md: after a call, a newline is not yet the next call, so each step makes the call the
model chose and no other. (Before, the newline after Qwen's call was the separator of a next call only,
and the mask made it write the converter's call and `final_answer` in the same turn, before any result.)
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
