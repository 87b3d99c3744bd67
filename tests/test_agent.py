"""The agentic hybrid automaton: guards, jump map, Π_T after a jump, limits, errors, traces."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridlm.agent import HybridAgent, Limits, replay
from hybridlm.engine.trace import read_trace
from hybridlm.tools import ToolRegistry, registry, tool
from hybridlm.turns.codecs.tagged_json import CLOSE, OPEN, RESPONSE_CLOSE, RESPONSE_OPEN
from hybridlm.tools import calculator
from hybridlm.alphabet import truncate
from hybridlm.errors import InputError
from tests.agent_fakes import ScriptedModel


def call(name, **arguments):
    return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def test_call_jump_and_answer(tok):
    script = [call("calculator", expression="123456 * 789"), "The answer is 97406784."]
    model = ScriptedModel(tok, script)
    agent = HybridAgent(model, registry(["calculator"]), tool_choice="auto")
    arc = agent.run("What is 123456 * 789?")
    assert arc.stop_reason == "stop_token" and arc.answer == "The answer is 97406784."
    (jump,) = arc.jumps
    assert (jump.k, jump.tool, jump.arguments, jump.observation, jump.error) == (
        1, "calculator", {"expression": "123456 * 789"}, "97406784", None)
    call_tokens = len(tok.encode(script[0]))
    assert jump.t == call_tokens  # the jump set is reached at the token that completes </tool_call>
    assert arc.token_steps == call_tokens + len(tok.encode(script[1])) + 1  # + end of turn


def test_jump_map_injects_observation_through_prefill(tok):
    model = ScriptedModel(tok, [call("calculator", expression="2 + 2"), "4"])
    agent = HybridAgent(model, registry(["calculator"]), tool_choice="auto")
    agent.run("What is 2 + 2?")
    before_jump = next(c for c in model.contexts if tok.decode(c).endswith(CLOSE))
    after_jump = model.contexts[model.contexts.index(before_jump) + 1]
    injected = tok.decode(after_jump[len(before_jump):])
    assert f"{RESPONSE_OPEN}4{RESPONSE_CLOSE}" in injected
    assert injected.startswith("<|im_end|>") and injected.endswith("<|im_start|>assistant\n")


def test_truncation_after_a_jump(tok):
    """s⁺ = Π_T(Φ(s, enc(y))): a horizon the observation overflows keeps the trailing T tokens."""
    probe = ScriptedModel(tok, [call("calculator", expression="2 + 2")])
    HybridAgent(probe, registry(["calculator"]), tool_choice="auto").run("What is 2 + 2?")
    at_close = next(c for c in probe.contexts if tok.decode(c).endswith(CLOSE))
    T = len(at_close) + 5  # the observation block (≈ 25 tokens) overflows this
    model = ScriptedModel(tok, [call("calculator", expression="2 + 2"), "4"], n_ctx=T)
    HybridAgent(model, registry(["calculator"]), tool_choice="auto").run("What is 2 + 2?")
    i = next(i for i, c in enumerate(model.contexts) if tok.decode(c).endswith(CLOSE))
    before, after = model.contexts[i], model.contexts[i + 1]
    enc = HybridAgent(ScriptedModel(tok, []), registry(["calculator"])).protocol.observation_ids(
        [{"role": "assistant", "content": call("calculator", expression="2 + 2")}], "4")
    assert len(after) == T
    assert after == truncate(before + enc, T)


def test_jump_horizon_bans_further_calls(tok):
    script = [call("calculator", expression=f"{i} + 1") for i in range(3)] + ["done"]
    model = ScriptedModel(tok, script)
    arc = HybridAgent(model, registry(["calculator"]), tool_choice="auto", limits=Limits(max_jumps=2)).run("go")
    assert [j.arguments["expression"] for j in arc.jumps] == ["0 + 1", "1 + 1"]
    assert OPEN not in arc.answer  # the third opening was removed from the kernel
    assert arc.stop_reason == "stop_token"


def test_no_zeno_jumps_at_distinct_token_steps(tok):
    script = [call("calculator", expression="1 + 1")] * 5
    arc = HybridAgent(ScriptedModel(tok, script), registry(["calculator"]), tool_choice="auto",
                      limits=Limits(max_jumps=5)).run("go")
    ts = [j.t for j in arc.jumps]
    assert len(ts) == 5 and all(b > a for a, b in zip(ts, ts[1:]))
    arc = HybridAgent(ScriptedModel(tok, script), registry(["calculator"]), tool_choice="auto",
                      limits=Limits(max_jumps=5, max_jumps_per_step=0)).run("go")
    assert arc.jumps == []


def test_token_budget(tok):
    model = ScriptedModel(tok, ["word " * 500])
    arc = HybridAgent(model, registry(["calculator"]), tool_choice="auto", limits=Limits(max_token_steps=37)).run("go")
    assert arc.token_steps == 37 and arc.stop_reason == "token_budget"


def test_constrained_call_cannot_leave_the_grammar(tok):
    """With tool choice 'required' the scripted garbage is overridden by the grammar."""
    model = ScriptedModel(tok, ["I think it is 5", " and so on" * 20])
    arc = HybridAgent(model, registry(["calculator"]), tool_choice="required", limits=Limits(max_token_steps=200)).run("go")
    assert arc.jumps and arc.jumps[0].tool == "calculator"
    assert arc.jumps[0].error is None or arc.jumps[0].error == "exception"


@tool(timeout_s=0.5)
def sleeper(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "woke"


@tool
def boom(x: int) -> str:
    """Raise."""
    raise RuntimeError(f"boom {x}")


@tool
def flood(n: int) -> str:
    """Return a lot."""
    return "x" * n


@pytest.mark.parametrize(
    "script_call, error, fragment",
    [
        (call("boom", x=3), "exception", "RuntimeError: boom 3"),
        (call("sleeper", seconds=30), "timeout", "within 0.5 s"),
        (call("flood", n=10_000_000), "too_large", "10000000 characters"),
        (call("nosuch", a=1), "unknown_tool", "unknown tool 'nosuch'"),
        (OPEN + '{"name": "boom", "arguments": {"x": "three"}}' + CLOSE, "invalid_arguments", "invalid arguments"),
        (OPEN + '{"name": boom' + CLOSE, "malformed_call", "malformed"),
    ],
)
def test_tool_failures_become_observations(tok, script_call, error, fragment):
    reg = ToolRegistry()
    for t in (sleeper, boom, flood):
        reg.register(t)
    model = ScriptedModel(tok, [script_call, "ok"])
    t0 = time.perf_counter()
    arc = HybridAgent(model, reg, tool_choice="auto", constrain=False).run("go")
    assert time.perf_counter() - t0 < 10
    (jump,) = arc.jumps
    assert jump.error == error and fragment in jump.observation
    assert len(jump.observation) < 2200
    assert arc.stop_reason == "stop_token" and arc.answer == "ok"


def test_trace_records_the_arc(tok, tmp_path):
    path = tmp_path / "arc.jsonl"
    model = ScriptedModel(tok, [call("calculator", expression="6 * 7"), "42"])
    arc = HybridAgent(model, registry(["calculator"]), tool_choice="auto").run("6 times 7?", trace=path)
    events = read_trace(path)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("jump") == 1
    tokens = [e for e in events if e["event"] == "token"]
    assert [e["t"] for e in tokens] == list(range(1, arc.token_steps + 1))
    assert [e["token"] for e in tokens] == arc.generated_ids
    jump = next(e for e in events if e["event"] == "jump")
    assert jump["observation"] == "42" and jump["k"] == 1
    assert all(e["k"] == (1 if e["t"] > jump["t"] else 0) for e in tokens)
    walls = [e["wall_s"] for e in events]
    assert walls == sorted(walls)


KILL_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from hybridlm import load_model
    from hybridlm.agent import HybridAgent, Limits
    from hybridlm.tools import registry
    from tests.agent_fakes import ScriptedModel
    tok = load_model().tokenizer
    model = ScriptedModel(tok, ["word " * 1000], delay_s=0.02)
    HybridAgent(model, registry(["calculator"]), tool_choice="auto", limits=Limits(max_token_steps=5000)).run(
        "go", trace={path!r})
""")


def test_killed_run_leaves_parseable_trace(tmp_path):
    path = tmp_path / "killed.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT.format(root=root, path=str(path))], cwd=root)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if path.exists() and path.read_text().count('"event": "token"') >= 20:
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lines = path.read_text().splitlines()
    assert len(lines) >= 20
    for line in lines:
        json.loads(line)
    assert not any(json.loads(line)["event"] == "end" for line in lines)


# ---------------------------------------------------------------------------- the real model
def test_real_model_calls_the_calculator(smollm2, tmp_path):
    path = tmp_path / "arc.jsonl"
    agent = HybridAgent(smollm2, registry(["calculator"]), record_states=True)
    arc = agent.run("What is 123456 * 789?", trace=path)
    assert arc.jumps and arc.jumps[0].tool == "calculator"
    assert arc.jumps[0].observation == "97406784"
    assert "97406784" in arc.answer
    from safetensors.torch import load_file

    states = load_file(str(path.with_suffix(".safetensors")))["resid_final"]
    assert states.shape == (arc.token_steps, smollm2.config.d_model)  # one final-layer state per token step
    replayed, same, first = replay(path, smollm2)
    assert same, f"replay differs from token step {first}"
    assert replayed.answer == arc.answer


def test_calculator_is_the_registered_builtin():
    assert calculator.parameters["required"] == ["expression"]


def test_a_call_cut_by_the_budget_is_not_the_answer(tok):
    model = ScriptedModel(tok, ["Let me compute. " + call("calculator", expression="12345 * 6789")])
    arc = HybridAgent(model, registry(["calculator"]), tool_choice="auto", constrain=False,
                      limits=Limits(max_token_steps=10)).run("What is 12345 * 6789?")
    assert arc.stop_reason == "token_budget" and arc.jumps == []
    assert arc.answer == "Let me compute." and OPEN not in arc.answer


def test_a_prompt_beyond_the_context_is_one_line(tok):
    reg = registry(["calculator", "clock"])
    fits = len(HybridAgent(ScriptedModel(tok, []), reg).protocol.prompt_ids(
        HybridAgent(ScriptedModel(tok, []), reg).protocol.messages("What is 2 + 2?")))
    with pytest.raises(InputError, match=r"the agent's prompt takes \d+ tokens \(\d+ for the system prompt with "
                                         r"2 tools, \d+ for the task\); the model's context holds"):
        HybridAgent(ScriptedModel(tok, ["4"], n_ctx=fits - 1), reg).run("What is 2 + 2?")
    arc = HybridAgent(ScriptedModel(tok, ["4"], n_ctx=fits + 8), reg, tool_choice="auto").run("What is 2 + 2?")
    assert arc.answer == "4"


def test_a_servers_tool_the_grammar_cannot_write_is_left_out_with_a_warning(tok):
    from hybridlm.tools import Tool

    bad = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["s"]}
    reg = registry(["calculator"])
    reg.register(Tool("lookbehind", "A tool of someone else's server.", bad, lambda s: s, server="far"))
    with pytest.warns(UserWarning, match="tool lookbehind of far is not offered: .*look-around"):
        agent = HybridAgent(ScriptedModel(tok, ["4"]), reg, tool_choice="auto")
    assert list(agent.tools.tools) == ["calculator"] and "lookbehind" in reg  # the user's registry is kept
    own = registry(["calculator"])
    own.register(Tool("mine", "The user's own tool.", bad, lambda s: s))
    with pytest.raises(InputError, match="tool mine"):
        HybridAgent(ScriptedModel(tok, ["4"]), own)


@tool
def get_temperature(city: str) -> str:
    """The temperature in a city, in degrees Celsius."""
    return "23.0"


@pytest.fixture(scope="module")
def qwen_tokenizers():
    """Qwen2.5's vocabulary and chat template as hybridlm reads them from its GGUF file, and as `transformers` does."""
    from transformers import AutoTokenizer

    from hybridlm.errors import ModelNotFoundError
    from hybridlm.weights.gguf_header import read_header
    from hybridlm.weights.registry import real_model_path
    from hybridlm.weights.vocab import tokenizer_from_metadata

    try:
        path = real_model_path("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(f"qwen2.5-coder-0.5b: {exc}")
    ours = tokenizer_from_metadata(read_header(path).metadata, name="qwen2.5")
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


QWEN_CALL = {"name": "get_temperature", "arguments": {"city": "Rome"}}


@pytest.mark.parametrize("written, rewritten", [
    ("```json\n" + json.dumps(QWEN_CALL, indent=2) + "\n```<|im_end|>", True),  # in a block, pretty-printed
    (json.dumps(QWEN_CALL), True),  # bare: the jump comes as the object closes
    ("<tool_call>\n" + json.dumps(QWEN_CALL) + "\n</tool_call>", False),  # as the template writes it
])
def test_the_calling_turn_enters_the_state_as_the_template_writes_it(qwen_tokenizers, tmp_path, written, rewritten):
    """ρ in the jump map: after the call, the state is `transformers`' rendering of the conversation with the
    call as a structured `tool_calls` message, token for token, whichever way the model wrote the call (what a
    client re-sending the conversation gets from llama.cpp's or vLLM's server); a turn already written that way
    is kept as it is. The arc still records what the model wrote."""
    tok, reference = qwen_tokenizers
    tools = ToolRegistry()
    tools.register(get_temperature)
    task, answer = "What is the temperature in Rome?", "It is 23.0 °C in Rome."
    model = ScriptedModel(tok, [written, answer])
    arc = HybridAgent(model, tools, tool_choice="auto").run(task, trace=tmp_path / "arc.jsonl")
    assert [(j.tool, j.arguments, j.observation) for j in arc.jumps] == [("get_temperature", {"city": "Rome"}, "23.0")]
    assert arc.answer == answer and tok.decode(arc.generated_ids).startswith(written.removesuffix("<|im_end|>"))

    conversation = [{"role": "user", "content": task},
                    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": QWEN_CALL}]},
                    {"role": "tool", "content": "23.0"}]
    schema = [{"type": "function", "function": get_temperature.schema()}]
    text = reference.apply_chat_template(conversation, tools=schema, tokenize=False, add_generation_prompt=True)
    expected = reference(text, add_special_tokens=False)["input_ids"]
    assert model.contexts[-1][: len(expected)] == expected, tok.decode(model.contexts[-1])
    assert expected in model.contexts  # the state at the token step that begins the answer
    (rewrite,) = [e for e in read_trace(tmp_path / "arc.jsonl") if e["event"] == "rewrite"]
    opened = reference.apply_chat_template(conversation[:1], tools=schema, tokenize=False, add_generation_prompt=True)
    prompt = len(reference(opened, add_special_tokens=False)["input_ids"])
    turn = len(tok.encode_markup(written))
    assert (rewrite["kept"] < prompt + turn) == rewritten and rewrite["kept"] + rewrite["tokens"] == len(expected)
