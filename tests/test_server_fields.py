"""Every field of llama.cpp's and vLLM's chat and completion requests is honoured or refused with a
400 naming it; the honoured sampling fields against transformers' logits processors; the table in
docs/server.md.

References: the field lists of llama.cpp's server (tools/server/server-schema.cpp, server-common.cpp,
server-context.cpp) and vLLM's ChatCompletionRequest and CompletionRequest (vllm/entrypoints/openai/
protocol.py, later chat_completion/protocol.py and completion/protocol.py); transformers'
RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, MinPLogitsWarper on a whole-string forward
pass; jsonschema and Python's re for the structured-output fields.
"""

import http.client
import json
import re
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import torch

from hybridlm.server import Service, running

MODEL = "smollm2-135m"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"

# a value of each field, as a client would send it (a valid one where the field is honoured)
LLAMA_CPP = {
    "verbose": True, "timings_per_token": True, "stream": True, "stream_options": {"include_usage": True},
    "cache_prompt": True, "return_tokens": True, "return_progress": True, "sse_ping_interval": 5, "n_predict": 3,
    "n_indent": 2, "n_keep": 4, "n_discard": 4, "n_cmpl": 2, "n_cache_reuse": 8, "t_max_prompt_ms": 1000,
    "t_max_predict_ms": 1000, "response_fields": ["content"], "top_k": 40, "top_p": 0.9, "min_p": 0.05,
    "top_n_sigma": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.1, "typical_p": 0.9, "temperature": 0.8,
    "dynatemp_range": 0.5, "dynatemp_exponent": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.1,
    "frequency_penalty": 0.1, "presence_penalty": 0.1, "dry_multiplier": 0.8, "dry_base": 1.75,
    "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"], "mirostat": 2,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": 0.5, "adaptive_decay": 0.9, "seed": 7,
    "n_probs": 3, "min_keep": 1, "backend_sampling": True, "post_sampling_probs": True, "lora": [{"id": 0, "scale": 1}],
    "json_schema": {"type": "string", "maxLength": 4}, "grammar": 'root ::= "yes" | "no"', "grammar_lazy": True,
    "grammar_triggers": [{"type": 0, "value": "{"}], "preserved_tokens": ["<x>"], "chat_format": 1,
    "reasoning_format": "none", "generation_prompt": "", "parse_tool_calls": True, "chat_parser": "x",
    "continue_final_message": True, "echo": True, "reasoning_control": True, "reasoning_budget_tokens": 10,
    "reasoning_budget_start_tag": "<think>", "reasoning_budget_end_tags": ["</think>"],
    "reasoning_budget_message": "x", "logit_bias": {"11": 1.0}, "ignore_eos": True, "stop": ["\n\n"],
    "samplers": ["top_k", "temperature"], "id_slot": 0, "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": True, "response_format": {"type": "json_object"}, "max_tokens": 3, "logprobs": True,
    "top_logprobs": 2, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none", "parallel_tool_calls": False, "reasoning_effort": "low", "n": 1,
    "reasoning_budget_end_tag": "</think>", "grammar_type": "tool_calls", "thinking_budget_tokens": 10,
    "max_completion_tokens": 3,  # (an alias of n_predict)
}
# the fields llama.cpp reads only from a chat request (its chat parser); the rest make its completion request too
LLAMA_CPP_CHAT_ONLY = {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
                       "reasoning_effort", "response_format", "top_logprobs", "thinking_budget_tokens"}
VLLM = {
    "frequency_penalty": 0.1, "logit_bias": {"11": 1.0}, "logprobs": True, "top_logprobs": 2, "max_tokens": 3,
    "max_completion_tokens": 3, "n": 1, "presence_penalty": 0.1, "response_format": {"type": "json_object"},
    "seed": 7, "stop": ["\n\n"], "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.8,
    "top_p": 0.9, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none", "reasoning_effort": "low", "parallel_tool_calls": False, "user": "u1", "best_of": 2,
    "use_beam_search": True, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1, "length_penalty": 1.0,
    "stop_token_ids": [2], "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 2,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 10,
    "prompt_logprobs": 1, "allowed_token_ids": [1, 2], "bad_words": ["x"], "echo": True,
    "add_generation_prompt": True, "continue_final_message": True, "add_special_tokens": True,
    "documents": [{"text": "x"}], "chat_template": "{{ x }}", "chat_template_kwargs": {"enable_thinking": False},
    "mm_processor_kwargs": {}, "guided_json": {"type": "string", "maxLength": 4}, "guided_regex": "(yes|no)",
    "guided_choice": ["yes", "no"], "guided_grammar": 'root ::= "yes" | "no"', "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "structured_outputs": {"choice": ["a"]},
    "priority": 1, "request_id": "r1", "logits_processors": ["x"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {}, "vllm_xargs": {"a": 1},
    "thinking_token_budget": 10, "include_reasoning": False, "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2, "repetition_min_count": 3,
}
# vLLM's CompletionRequest (its guided_* fields as older releases had them there too)
VLLM_COMPLETION = {
    **{k: VLLM[k] for k in (
        "echo", "frequency_penalty", "logit_bias", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
        "stream_options", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty",
        "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
        "prompt_logprobs", "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
        "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size",
        "min_repetition_pattern_size", "repetition_min_count")},
    "logprobs": 2, "suffix": "\n", "prompt_embeds": "AAAAAA==",  # OpenAI's completion: logprobs is a count
    "best_of": 2,  # (OpenAI's; older vLLM releases)
}
COMPLETION = {**{k: v for k, v in LLAMA_CPP.items() if k not in LLAMA_CPP_CHAT_ONLY}, "logprobs": 2, **VLLM_COMPLETION}
NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}}  # what a field is valid with


@pytest.fixture(scope="module")
def served(smollm2):
    with running(Service(smollm2, model_id=MODEL)) as url:
        yield url


def post(url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict | str]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    return r.status, json.loads(data) if r.headers.get("content-type", "").startswith("application/json") else data


def documented(column: int) -> dict[str, str]:
    """A column of the table of docs/server.md (0: chat, 1: completions): field → honoured | refused | no effect,
    the fields that are no part of that endpoint's request ("–") left out."""
    outcome = "(honoured|refused|no effect|–)"
    rows = re.findall(rf"^\| `([a-z_]+)` \| [^|]+ \| {outcome} \| {outcome} \|", DOCS.read_text(), re.M)
    return {row[0]: row[1 + column] for row in rows if row[1 + column] != "–"}


def outcomes(url: str, fields: dict, path: str, base: dict) -> dict[str, str]:
    """What the endpoint does with each field sent alone: honoured (200), refused (400 naming it), or no effect."""
    outcome = {}
    for field, value in fields.items():
        body = {"model": MODEL, **base, "max_tokens": 3, **NEEDS.get(field, {}), field: value}
        status, out = post(url, body, path)
        assert status in (200, 400), (field, status, out)
        if status == 400:
            assert isinstance(out, dict) and out["error"]["param"] == field, (field, out)
            assert out["error"]["type"] == "invalid_request_error" and "\n" not in out["error"]["message"]
        outcome[field] = "refused" if status == 400 else "no effect" if field == "user" else "honoured"
    return outcome


def test_every_llama_cpp_and_vllm_field_is_honoured_or_refused(served):
    chat = outcomes(served, {**LLAMA_CPP, **VLLM}, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Yes or no?"}]})
    assert chat == documented(0)  # the table says what the server does, field by field


def test_every_field_of_a_completion_request_is_honoured_or_refused(served):
    completion = outcomes(served, COMPLETION, "/v1/completions", {"prompt": "Yes or no?"})
    assert completion == documented(1)


@pytest.mark.parametrize("field,value,check", [
    ("grammar", 'root ::= ("yes" | "no") "!"', lambda t: t in ("yes!", "no!")),
    ("grammar", 'start: /[0-9]{3}/', lambda t: re.fullmatch(r"[0-9]{3}", t)),  # Lark is read as it is
    ("guided_grammar", 'root ::= [a-c]+ "."', lambda t: re.fullmatch(r"[a-c]+\.", t)),
    ("guided_regex", r"(red|green|blue)", lambda t: t in ("red", "green", "blue")),
    ("guided_choice", ["alpha", "beta"], lambda t: t in ("alpha", "beta")),
    ("structured_outputs", {"regex": "[A-Z][a-z]+"}, lambda t: re.fullmatch("[A-Z][a-z]+", t)),
])
def test_structured_output_fields_constrain_the_reply(served, field, value, check):
    for path, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Pick one."}]}),
                        ("/v1/completions", {"prompt": "Pick one:"})):
        status, out = post(served, {"model": MODEL, "max_tokens": 12, "temperature": 0.9, "seed": 3, field: value,
                                    **extra}, path)
        assert status == 200, out
        choice = out["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert check(text), (field, path, text)


PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
         "additionalProperties": False}


@pytest.mark.parametrize("field", ["json_schema", "guided_json"])
def test_json_schema_fields_validate(served, field):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    status, out = post(served, {"model": MODEL, "messages": [{"role": "user", "content": "Where is the Eiffel tower?"}],
                                "max_tokens": 40, "temperature": 0, field: schema})
    assert status == 200, out
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}},
                                 {"type": "json_object", "schema": PLACE}])  # (llama.cpp's json_object with a schema)
def test_response_format_constrains_a_completion(served, fmt):
    """vLLM takes response_format on /v1/completions too: the text is one JSON value of the schema."""
    status, out = post(served, {"model": MODEL, "prompt": "The Eiffel tower is in", "max_tokens": 40, "temperature": 0,
                                "response_format": fmt}, "/v1/completions")
    assert status == 200, out
    jsonschema.validate(json.loads(out["choices"][0]["text"]), PLACE)
    status, out = post(served, {"model": MODEL, "prompt": "x", "response_format": fmt, "guided_regex": "a"},
                       "/v1/completions")
    assert status == 400 and out["error"]["param"] == "guided_regex", out


def test_max_completion_tokens_is_max_tokens_on_a_completion(served):
    """llama.cpp reads max_completion_tokens as n_predict on a completion too: the same text as max_tokens."""
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0}
    _, alias = post(served, {**body, "max_completion_tokens": 7}, "/v1/completions")
    _, plain = post(served, {**body, "max_tokens": 7}, "/v1/completions")
    assert alias["choices"][0]["text"] == plain["choices"][0]["text"] and alias["usage"]["completion_tokens"] == 7
    status, out = post(served, {**body, "max_tokens": 5, "max_completion_tokens": 7}, "/v1/completions")
    assert status == 400 and out["error"]["param"] == "max_completion_tokens", out


@pytest.mark.parametrize("body,param", [
    ({"grammar": 'root ::= foo'}, "grammar"),  # an undefined rule: the converter's reason, and where Lark goes
    ({"grammar": "start: (((", }, "grammar"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_regex"),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"top_k": -2}, "top_k"), ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"json_schema": {"type": "string"}, "response_format": {"type": "json_object"}}, "json_schema"),
])
def test_bad_structured_and_sampling_fields_are_named(served, body, param):
    status, out = post(served, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, **body})
    assert status == 400 and out["error"]["param"] == param, out
    if body.get("grammar", "").startswith("root ::= foo"):
        assert "Lark" in out["error"]["message"]


# ---------------------------------------------------------------------- the sampling fields against transformers
def _whole_string_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens]))[0].double()[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def _chat(served, **fields):
    status, out = post(served, {"model": MODEL, "messages": [{"role": "user", "content": "List the days of the week, "
                                                                                         "then list them again."}],
                                "max_tokens": 24, **fields})
    assert status == 200, out
    arc = out["hybridlm"]["arcs"][0]
    with urllib.request.urlopen(f"{served}/arcs/{arc}") as r:
        events = [json.loads(line) for line in r.read().decode().splitlines()]
    return [e["token"] for e in events if e["event"] == "token" and not e.get("stop")]


def _prompt(smollm2) -> list[int]:
    tok = smollm2.tokenizer
    text = tok.render_chat([{"role": "user", "content": "List the days of the week, then list them again."}],
                           add_generation_prompt=True)
    return tok.encode_markup(text)


@pytest.mark.parametrize("fields,window", [({"repetition_penalty": 1.8}, None),
                                           ({"repeat_penalty": 1.8, "repeat_last_n": 8}, 8)])
def test_repeat_penalties_equal_transformers_processor(served, smollm2, fields, window):
    """Greedy under vLLM's repetition_penalty (whole context) and llama.cpp's repeat_penalty (its last
    repeat_last_n tokens): each token is the argmax of transformers' RepetitionPenaltyLogitsProcessor
    applied to the whole-string logits over the same context."""
    from transformers import RepetitionPenaltyLogitsProcessor

    tokens = _chat(served, temperature=0, **fields)
    prompt = _prompt(smollm2)
    logits = _whole_string_logits(smollm2, prompt, tokens)
    penalty = RepetitionPenaltyLogitsProcessor(fields.get("repetition_penalty", fields.get("repeat_penalty")))
    plain = _chat(served, temperature=0)
    assert tokens != plain  # the penalty acted
    for i, t in enumerate(tokens):
        context = (prompt + tokens)[: len(prompt) + i]
        if window is not None:
            context = context[-window:]
        z = penalty(torch.tensor([context]), logits[i: i + 1].clone())[0]
        assert float(z.max() - z[t]) < 1e-3, (i, t, int(z.argmax()))


@pytest.mark.parametrize("fields", [{"top_k": 3}, {"min_p": 0.3}, {"top_k": 5, "min_p": 0.2}])
def test_truncations_keep_every_draw_inside_transformers_support(served, smollm2, fields):
    """Sampling at τ = 1.3 with top_k / min_p: every drawn token lies in the support that
    transformers' TopKLogitsWarper then MinPLogitsWarper leave of z/τ (and top_k -1 / 0 is off)."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper

    prompt = _prompt(smollm2)
    outside = 0
    for seed in range(3):
        tokens = _chat(served, temperature=1.3, seed=seed, **fields)
        logits = _whole_string_logits(smollm2, prompt, tokens) / 1.3
        for i, t in enumerate(tokens):
            z = logits[i: i + 1].float()
            if "top_k" in fields:
                z = TopKLogitsWarper(fields["top_k"])(None, z)
            if "min_p" in fields:
                z = MinPLogitsWarper(fields["min_p"])(None, z)
            outside += int(not torch.isfinite(z[0, t]))
    assert outside == 0
    off = [_chat(served, temperature=0, top_k=k) for k in (-1, 0)]
    assert off[0] == off[1] == _chat(served, temperature=0)
