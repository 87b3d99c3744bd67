"""Chat templates render byte for byte as `transformers` renders them (hybridlm.chat_template).

The reference is `transformers`' own rendering (`render_jinja_template`, what `apply_chat_template(tokenize=False)`
calls), with the date pinned on both sides. Every template of llama.cpp's `models/templates/` is rendered for a
fixed set of conversations (system, user, assistant with calls, tool results, tools given, reasoning, the
generation prompt on and off); where `transformers` refuses a conversation, hybridlm must refuse it too, with
one line. The templates it refuses for every conversation here are listed, with the reason, in docs/templates.md.
No model weights: tokenizer-free rendering.
"""

import datetime as dt

import pytest

from hybridlm.chat_template import compile_template, render_chat_template
from hybridlm.errors import InputError

#: llama.cpp 0.3.36's models/templates (the test below checks the folder holds exactly these).
TEMPLATES = (
    "Apertus-8B-Instruct", "Apriel-1.6-15b-Thinker-fixed", "Bielik-11B-v3.0-Instruct", "ByteDance-Seed-OSS",
    "Cohere2MoE", "CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6", "GLM-4.7-Flash", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Kimi-K3", "LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct", "MiMo-VL",
    "MiniMax-M1", "MiniMax-M2", "MiniMax-M3", "Mistral-Small-3.2-24B-Instruct-2506", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "NVIDIA-Nemotron-Nano-v2", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
    "Qwen3-Coder", "Qwen3.5-4B", "Reka-Edge", "Spark2.5", "StepFun3.5-Flash", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-V4", "fireworks-ai-llama-3-firefunction-v2",
    "google-gemma-2-2b-it", "google-gemma-4-31B-it-interleaved", "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct", "ibm-granite-granite-4.0", "ibm-granite-granite-4.1",
    "inclusionai-ling-3.0-flash", "llama-cpp-deepseek-r1", "llama-cpp-rwkv-world", "meetkai-functionary-medium-v3.1",
    "meetkai-functionary-medium-v3.2", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct", "microsoft-Phi-3.5-mini-instruct", "mistralai-Ministral-3-14B-Reasoning-2512",
    "mistralai-Mistral-Nemo-Instruct-2407", "moonshotai-Kimi-K2", "muse-glimmer", "openai-gpt-oss-120b",
    "openbmb-MiniCPM5-1B", "poolside-Laguna-S-2.1", "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2", "tencent-Hy3",
    "unsloth-Apriel-1.5", "unsloth-mistral-Devstral-Small-2507", "upstage-Solar-Open-100B",
)
#: Templates transformers renders none of the conversations of: the table of docs/templates.md.
REFUSED_BY_TRANSFORMERS = {
    "CohereForAI-c4ai-command-r-plus-tool_use",  # tools as {name, description, parameter_definitions}, not OpenAI's
    "fireworks-ai-llama-3-firefunction-v2",  # reads `functions`, not `tools`
}

DATE = dt.datetime(2026, 3, 14, 9, 26, 53)
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city, \"now\" & <later>; 'quoted'.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
]
CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Zürich"}}}
CALL2 = {"id": "f5g6h7i8j", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 < 3 & 4"}}}
SYSTEM = {"role": "system", "content": "You are terse. Ünïcödé, 日本語, emoji 🤖."}
USER = {"role": "user", "content": "What's the weather in Zürich, and is 2 < 3 & 4?"}
USER2 = {"role": "user", "content": "Thanks! And tomorrow?"}
CALLS = {"role": "assistant", "content": "", "tool_calls": [CALL, CALL2]}
ONE_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": '{"temp": 21, "sky": "clear"}'}
RESULT2 = {"role": "tool", "tool_call_id": "f5g6h7i8j", "name": "calculator", "content": "1"}
ANSWER = {"role": "assistant", "content": "It is 21 °C and clear; 2 < 3 & 4 is 1."}
THOUGHT = {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 + 2 = 4, simple."}

#: name → (messages, tools, extra template variables)
CONVERSATIONS = {
    "user": ([USER], None, {}),
    "system_user": ([SYSTEM, USER], None, {}),
    "chat": ([SYSTEM, USER, ANSWER, USER2], None, {}),
    "chat_no_system": ([USER, ANSWER, USER2], None, {}),
    "tools_offered": ([SYSTEM, USER], TOOLS, {}),
    "parallel_calls": ([SYSTEM, USER, CALLS, RESULT, RESULT2], TOOLS, {}),
    "parallel_answered": ([SYSTEM, USER, CALLS, RESULT, RESULT2, ANSWER], TOOLS, {}),
    "one_call_no_system": ([USER, ONE_CALL, RESULT, ANSWER, USER2], TOOLS, {}),
    "reasoning": ([USER, THOUGHT, USER2], None, {"enable_thinking": False}),
    "thinking_on": ([SYSTEM, USER], TOOLS, {"enable_thinking": True}),
}


@pytest.fixture(scope="module")
def templates(llama_cpp_source):
    return llama_cpp_source / "models" / "templates"


def test_the_template_folder_is_the_one_listed(templates):
    assert {p.name.removesuffix(".jinja") for p in templates.glob("*.jinja")} == set(TEMPLATES)


def transformers_rendering(source, messages, tools, generation, variables, monkeypatch):
    from transformers.utils import chat_template_utils

    class Pinned(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return DATE

    monkeypatch.setattr(chat_template_utils, "datetime", Pinned)
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            [messages], tools=tools, chat_template=source, add_generation_prompt=generation, **SPECIALS, **variables)
    except Exception as exc:  # noqa: BLE001 - any refusal of the reference: hybridlm must refuse too
        return exc
    return rendered[0]


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendering_is_byte_identical_to_transformers(templates, name, monkeypatch):
    source = (templates / f"{name}.jinja").read_text(encoding="utf-8")
    rendered = 0
    for conversation, (messages, tools, variables) in CONVERSATIONS.items():
        for generation in (True, False):
            expected = transformers_rendering(source, messages, tools, generation, variables, monkeypatch)
            if isinstance(expected, Exception):
                with pytest.raises(InputError, match=r"^chat template: [^\n]*$"):
                    render_chat_template(source, messages, tools=tools, add_generation_prompt=generation,
                                         now=lambda: DATE, **SPECIALS, **variables)
                continue
            ours = render_chat_template(source, messages, tools=tools, add_generation_prompt=generation,
                                        now=lambda: DATE, **SPECIALS, **variables)
            assert ours == expected, (conversation, generation)
            rendered += 1
    assert (rendered == 0) == (name in REFUSED_BY_TRANSFORMERS)


def test_tojson_keeps_order_and_text():
    source = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ y | tojson }}"
    out = render_chat_template(source, [], x={"b": 1, "a": ["<&'>", "é"]}, y="日本")
    assert out == '{"b": 1, "a": ["<&\'>", "é"]}|{\n  "b": 1,\n  "a": [\n    "<&\'>",\n    "é"\n  ]\n}|"日本"'


def test_environment_conventions():
    assert render_chat_template("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}", []) == "012"
    assert render_chat_template("{{ strftime_now('%Y-%m-%d') }}", [], now=lambda: DATE) == "2026-03-14"
    assert render_chat_template("{% generation %}x{% endgeneration %}", []) == "x"
    assert render_chat_template("  {% if true %}\nx\n{% endif %}\n", []) == "x\n"  # trim_blocks and lstrip_blocks
    # calls' arguments as an OpenAI client sends them (a JSON text) reach the template as an object
    sent = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    source = "{% for m in messages %}{{ m.content is defined }}{{ m.tool_calls[0].function.arguments.a }}{% endfor %}"
    assert render_chat_template(source, sent) == "False1"


@pytest.mark.parametrize("source, fragment", [
    ("{{ raise_exception('roles must alternate') }}", "chat template: roles must alternate"),
    ("{% set ns = namespace(_x=1) %}", "starts with '_'"),
    ("{{ missing.attribute }}", "chat template: 'missing' is undefined"),
    ("{{ messages.append(1) }}", "unsafe"),
])
def test_refusals_are_one_line(source, fragment):
    with pytest.raises(InputError, match=r"^[^\n]*$") as info:
        render_chat_template(source, [{"role": "user", "content": "x"}])
    assert fragment in str(info.value)


def test_a_broken_template_is_refused_when_compiled():
    with pytest.raises(InputError, match=r"^chat template: line 1: .*expected a Jinja template$"):
        compile_template("{% for %}")
