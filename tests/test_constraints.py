"""Constraints on llguidance: outputs checked by jsonschema, tokens by the tokenizer's own encoding.

The references are independent of the constraint: `jsonschema` decides whether a sampled
output is valid, the `tokenizers` BPE decides how a text is split into tokens, `json`
decides what a call's arguments are.
"""

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from hybridlm.constraints import library_tokenizer, json_schema_constraint, regex_constraint, grammar_constraint
from hybridlm.turns import tool_call_constraint
from hybridlm.turns.codecs.tagged_json import CLOSE, OPEN, parse_calls
from hybridlm.engine.constraint import Constraint
from hybridlm.errors import InputError
from hybridlm.tokenizer import gpt2_tokenizer


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_tokenizer()


def sample(constraint, V, seed, *, steps=400, bias=None):
    """τ = 1 sampling from random logits, masked by the constraint, until it is finished."""
    g = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        if constraint.finished:
            break
        allowed = constraint.mask()
        z = torch.randn(V, generator=g)
        if bias is not None:
            z = z + bias
        if allowed is not None:
            z = z.masked_fill(~allowed[:V], float("-inf"))
        w = int(torch.multinomial(torch.softmax(z, -1), 1, generator=g))
        constraint.advance(w)
        tokens.append(w)
    return tokens


def feed(constraint, ids):
    """Feed the tokenizer's own encoding; every token must be in the mask it meets."""
    for i in ids:
        allowed = constraint.mask()
        assert allowed is None or bool(allowed[i]), f"token {i} refused after {constraint.text!r}"
        constraint.advance(i)


def call(name, arguments):
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CLOSE}"


# ---------------------------------------------------------------------- the property
NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)


def leaves():
    integer = st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                        st.integers(-1000, 1000), st.integers(0, 5000))
    number = st.builds(lambda lo: {"type": "number", "minimum": lo}, st.integers(-50, 50))
    string = st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
                       st.integers(0, 3), st.integers(0, 12))
    enum = st.lists(st.text(alphabet="abcxyz -上海é", min_size=1, max_size=5), min_size=1, max_size=4,
                    unique=True).map(lambda vs: {"type": "string", "enum": vs})
    const = st.sampled_from([{"const": "fixed"}, {"const": 7}, {"const": True}])
    pattern = st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,6}$"},
                               {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"}])
    # formats whose strings end by themselves (an email's local part never has to end, and the
    # budget's closing witness is a heuristic that need not find its "@"); not "date": RFC 3339
    # allows the year 0000 that llguidance writes and Python's date (jsonschema's check) refuses
    fmt = st.sampled_from([{"type": "string", "format": "ipv4"}, {"type": "string", "format": "uuid"}])
    simple = st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "integer"}, {"type": "number"},
                              {"type": "string", "maxLength": 8}])
    return st.one_of(integer, number, string, enum, const, pattern, fmt, simple)


def schemas():
    def extend(children):
        obj = st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
            lambda props: st.builds(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False},
                st.lists(st.sampled_from(sorted(props)), unique=True)))
        arr = st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                                  "maxItems": lo + extra},
                        children, st.integers(0, 2), st.integers(0, 3))
        any_of = st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs})
        return st.one_of(obj, arr, any_of)

    return st.recursive(leaves(), extend, max_leaves=6)


def with_ref(schema):
    """The same schema, its root behind a $ref into $defs."""
    return {"$defs": {"root": schema}, "$ref": "#/$defs/root"}


# No shrinking: on a 2-core machine it can run for minutes; a failure prints its example anyway.
GENERATE = (Phase.explicit, Phase.reuse, Phase.generate)


@settings(max_examples=40, deadline=None, phases=GENERATE,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas(), ref=st.booleans(), seed=st.integers(0, 2**31))
def test_sampled_outputs_validate(gpt2, schema, ref, seed):
    schema = with_ref(schema) if ref else schema
    c = json_schema_constraint(gpt2, schema, budget=120)
    sample(c, gpt2.vocab_size, seed, steps=140)
    # The budget's closing is a heuristic (docs/constraints.md): a free token inside its margin can
    # open an item longer than the margin (one more UUID in an array, ~25 tokens), and the text
    # then reaches the budget unfinished. Such draws are left out; if most were, hypothesis fails.
    assume(c.finished)
    value = json.loads(gpt2.decode([t for t in c.tokens if t not in gpt2.stop_ids()]))
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@settings(max_examples=15, deadline=None, phases=GENERATE,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 2**31))
def test_sampled_tool_calls_validate_on_smollm2(smol, schema, seed):
    params = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    c = tool_call_constraint(smol, [{"name": "tool", "parameters": params}], "required", budget=200)
    sample(c, smol.vocab_size, seed, steps=220)
    assert len(c.tokens) <= 200, c.text
    assume(c.finished)  # as above: the closing heuristic's known limit
    (got,) = c.calls()
    body = c.text[len(OPEN):c.text.rindex(CLOSE)]
    assert got.arguments == json.loads(body)["arguments"]
    jsonschema.validate(got.arguments, params, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


# ---------------------------------------------------------------------- BFCL's functions
@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel"])
def test_every_bfcl_function_compiles(smol, category):
    pytest.importorskip("bfcl_eval", reason="BFCL's data: pip install --no-deps bfcl-eval")
    from hybridlm.agent import bfcl

    tasks = bfcl.tasks(category)
    assert len(tasks) >= 200
    for task in tasks:
        tools = [{"name": f["name"], "parameters": bfcl.json_schema(f["parameters"])} for f in task.functions]
        c = tool_call_constraint(smol, tools, "required")
        assert c.mask() is not None, task.id


# ---------------------------------------------------------------------- the grammar failures of the issue
def test_a_negative_number_after_a_key(smol):
    tools = [{"name": "solve", "parameters": {"type": "object", "properties": {"b": {"type": "integer"}},
                                              "required": ["b"]}}]
    text = call("solve", {"b": -3})
    ids = smol.encode(text)
    assert smol.encode(" -")[0] in ids  # the tokenizer writes ` -` as one token after the colon
    c = tool_call_constraint(smol, tools, "required")
    feed(c, ids)
    assert c.finished and c.calls()[0].arguments == {"b": -3}


def test_every_token_of_a_non_ascii_string(smol, gpt2):
    for tok in (smol, gpt2):
        tools = [{"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]}}]
        ids = tok.encode(call("weather", {"city": "上海"}))
        assert any(tok.decode([i]) == "\ufffd" for i in ids)  # byte-level halves of a character
        c = tool_call_constraint(tok, tools, "required")
        feed(c, ids)
        assert c.calls()[0].arguments == {"city": "上海"}


def test_enum_values_only(smol):
    units = ["metric", "imperial"]
    tools = [{"name": "convert", "parameters": {"type": "object", "properties": {
        "units": {"type": "string", "enum": units}}, "required": ["units"]}}]
    for seed in range(8):
        c = tool_call_constraint(smol, tools, "required")
        sample(c, smol.vocab_size, seed)
        assert c.calls()[0].arguments["units"] in units
    c = tool_call_constraint(smol, tools, "required")
    feed(c, smol.encode('<tool_call>{"name": "convert", "arguments": {"units": "'))
    allowed = c.mask()
    assert not allowed[smol.encode("kelvin")[0]] and allowed[smol.encode("metric")[0]]


def test_a_string_is_closed_within_the_budget(smol):
    tools = [{"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "count": {"type": "integer"}}, "required": ["text", "count"]}}]
    # logits that never want a quote: a model that would write the string forever
    quote = torch.tensor(['"' in s for s in smol.table.texts] + [False] * (smol.vocab_size - len(smol.table.texts)))
    bias = torch.where(quote, -30.0, 5.0)
    for budget in (40, 64, 120):
        c = tool_call_constraint(smol, tools, "required", budget=budget)
        tokens = sample(c, smol.vocab_size, budget, bias=bias)
        assert c.finished and len(tokens) <= budget
        (got,) = c.calls()
        assert set(got.arguments) == {"text", "count"}


def test_max_string_bounds_free_strings(smol):
    tools = [{"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                             "required": ["text"]}}]
    c = tool_call_constraint(smol, tools, "required", max_string=5)
    sample(c, smol.vocab_size, 3)
    assert len(c.calls()[0].arguments["text"]) <= 5


def test_optional_arguments_can_be_emitted(smol):
    params = {"type": "object", "properties": {"base": {"type": "integer"}, "unit": {"type": "string"},
                                               "precise": {"type": "boolean"}}, "required": ["base"]}
    tools = [{"name": "area", "parameters": params}]
    for arguments in ({"base": 10}, {"base": 10, "unit": "cm"}, {"base": 10, "precise": True},
                      {"base": 10, "unit": "cm", "precise": False}):
        c = tool_call_constraint(smol, tools, "required")
        feed(c, smol.encode(call("area", arguments)))
        assert c.finished and c.calls()[0].arguments == arguments


def test_the_lookup_key_is_one_of_the_knowledge_base_keys(smol, tmp_path):
    from hybridlm.tools import lookup_tool

    kb = tmp_path / "kb.json"
    kb.write_text(json.dumps({"speed_of_light": "299792458 m/s", "boiling point": "100 C"}))
    t = lookup_tool(kb)
    for seed in range(6):
        c = tool_call_constraint(smol, [t], "required")
        sample(c, smol.vocab_size, seed)
        assert c.calls()[0].arguments["key"] in {"speed_of_light", "boiling point"}


# ---------------------------------------------------------------------- tool choice and parallel calls
TOOLS = [
    {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                   "required": ["a", "b"]}},
    {"name": "clock", "parameters": {"type": "object", "properties": {}}},
]


def test_auto_is_free_text_until_a_call_opens(smol):
    c = tool_call_constraint(smol, TOOLS, "auto")
    feed(c, smol.encode("It is 4 o'clock."))
    assert not c.finished and not c.in_call
    c.advance(smol.end_of_turn_id)
    assert c.finished and c.calls() == [] and c.answer() == "It is 4 o'clock."

    c = tool_call_constraint(smol, TOOLS, "auto")
    feed(c, smol.encode("Let me add them. <tool_call>"))
    assert c.in_call
    allowed = c.mask()
    assert int(allowed.sum()) < 100 and not allowed[smol.encode("Hello")[0]]
    feed(c, smol.encode('{"name": "add", "arguments": {"a": 2, "b": -0.5}}</tool_call>'))
    assert c.finished and c.calls()[0].arguments == {"a": 2, "b": -0.5}


def test_a_fresh_copy_starts_over_and_leaves_the_original(smol):
    used = tool_call_constraint(smol, TOOLS, "auto", budget=100)
    feed(used, smol.encode("Let me add them. <tool_call>"))
    fresh, compiled = used.fresh(), tool_call_constraint(smol, TOOLS, "auto", budget=100)
    assert fresh.tokens == [] and fresh.remaining == 100 and used.in_call
    text = '{"name": "add", "arguments": {"a": -3, "b": 1}}</tool_call>'
    for t in smol.encode("<tool_call>" + text):  # the copy and a new compilation allow the same tokens
        a, b = fresh.mask(), compiled.mask()
        assert (a is None and b is None) or torch.equal(a, b)
        fresh.advance(t), compiled.advance(t)
    assert fresh.calls()[0].arguments == {"a": -3, "b": 1} == compiled.calls()[0].arguments
    feed(used, smol.encode(text))  # the original went on where it was
    assert used.calls()[0].arguments == {"a": -3, "b": 1} and used.answer() == "Let me add them. "
    assert used.fresh(budget=None).remaining is None and used.fresh(budget=7).remaining == 7
    with pytest.raises(InputError, match="budget 0"):
        used.fresh(budget=0)


def test_required_opens_the_turn_with_a_call(smol):
    c = tool_call_constraint(smol, TOOLS, "required")
    allowed = torch.nonzero(c.mask()).flatten().tolist()
    assert allowed and all(OPEN.startswith(smol.table.texts[i]) for i in allowed)


def test_none_lets_no_call_open(smol):
    c = tool_call_constraint(smol, TOOLS, "none")
    feed(c, smol.encode("No tools needed: <tool_call"))
    allowed = c.mask()
    assert not allowed[smol.encode(">")[0]] and allowed[smol.encode("s")[0]]
    c = tool_call_constraint(smol, TOOLS, "none")
    feed(c, smol.encode("I can answer: 4."))
    c.advance(smol.end_of_turn_id)
    assert c.finished


def test_a_named_tool_is_the_only_one(smol):
    for choice in ("clock", {"type": "function", "function": {"name": "clock"}}):
        c = tool_call_constraint(smol, TOOLS, choice)
        feed(c, smol.encode('<tool_call>{"name": "'))
        allowed = c.mask()
        assert allowed[smol.encode("clock")[0]] and not allowed[smol.encode("add")[0]]
    with pytest.raises(InputError, match="tool choice 'sing'"):
        tool_call_constraint(smol, TOOLS, "sing")


def test_parallel_calls_in_order_end_the_turn(smol):
    first, second = call("add", {"a": 1, "b": 2}), call("clock", {})
    c = tool_call_constraint(smol, TOOLS, "required", parallel=True)
    feed(c, smol.encode(first + "\n" + second))
    assert not c.finished
    c.advance(smol.end_of_turn_id)
    assert c.finished and [x.name for x in c.calls()] == ["add", "clock"]

    c = tool_call_constraint(smol, TOOLS, "required", parallel=True, max_calls=2)
    feed(c, smol.encode(first + second))
    allowed = c.mask()
    assert c.finished or torch.nonzero(allowed).flatten().tolist() == [smol.end_of_turn_id]

    c = tool_call_constraint(smol, TOOLS, "required")
    feed(c, smol.encode(first))
    assert c.finished and len(c.calls()) == 1


# ---------------------------------------------------------------------- protocol, regex, grammar
def test_the_engine_protocol(smol):
    c = json_schema_constraint(smol, {"type": "integer"})
    assert isinstance(c, Constraint)
    m = c.mask()
    assert m.dtype == torch.bool and m.shape == (smol.vocab_size,)
    assert c.describe()["kind"] == "json_schema"
    with pytest.raises(InputError):
        c.advance(smol.encode("x")[0])
    padded = json_schema_constraint(smol, {"type": "integer"}, vocab_size=smol.vocab_size + 64)
    assert padded.mask().shape == (smol.vocab_size + 64,) and not padded.mask()[smol.vocab_size:].any()


def test_regex_and_grammar(smol):
    c = regex_constraint(smol, r"[0-9]{3}-[a-z]{2}")
    sample(c, smol.vocab_size, 0)
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", smol.decode([t for t in c.tokens if t not in smol.stop_ids()]))
    c = grammar_constraint(smol, 'start: "yes" | "no"')
    sample(c, smol.vocab_size, 1)
    assert smol.decode([t for t in c.tokens if t not in smol.stop_ids()]) in ("yes", "no")


def test_bad_schemas_and_grammars_name_the_problem(smol):
    with pytest.raises(InputError, match="JSON schema"):
        json_schema_constraint(smol, "{not json")
    with pytest.raises(InputError, match="grammar"):
        grammar_constraint(smol, "start: undefined_rule")
    with pytest.raises(InputError, match="tool bad"):
        tool_call_constraint(smol, [{"name": "bad", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "format": "no-such-format", "pattern": "(?<=a)b"}}}}], "required")


def test_the_library_tokenizer_is_built_once(smol):
    assert library_tokenizer(smol) is library_tokenizer(smol)


# ---------------------------------------------------------------------- the free parser
def test_free_parser_reads_calls_like_json():
    args = {"a": [1, {"b": None}], "s": "上海 \"q\""}
    text = "thinking... " + call("f", args) + "\n" + call("g", {})
    calls, error = parse_calls(text, ["f", "g"])
    assert error is None and [c.name for c in calls] == ["f", "g"] and calls[0].arguments == args


@pytest.mark.parametrize("text, says", [
    (OPEN + "[" * 100_000 + "]" * 100_000 + CLOSE, "JSON"),
    (OPEN + '{"name": "f", "arguments": ' + "[" * 100_000 + CLOSE, "JSON"),
    (OPEN + '{"name": "f"', "never closed"),
    (OPEN + "[1, 2]" + CLOSE, "JSON list"),
    (OPEN + '{"name": 3}' + CLOSE, '"name"'),
    (OPEN + '{"name": "zzz", "arguments": {}}' + CLOSE, "unknown tool"),
    (OPEN + '{"name": "f", "arguments": 5}' + CLOSE, '"arguments"'),
    (OPEN + '{"name": "f", "arguments": {}, "x": 1}' + CLOSE, "unexpected"),
    (OPEN + "\x00\ud800" + CLOSE, "JSON"),
    ("no call here", "no <tool_call>"),
])
def test_free_parser_answers_hostile_text_with_one_line(text, says):
    calls, error = parse_calls(text, ["f"])
    assert calls == [] and says in error and "\n" not in error


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_free_parser_never_raises(text):
    calls, error = parse_calls(OPEN + text + CLOSE)
    assert isinstance(calls, list) and (error is None or isinstance(error, str))


# ---------------------------------------------------------------------- the prompt follows the tools
def test_the_prompt_follows_the_tools_offered(smol):
    from hybridlm.turns import Protocol
    from hybridlm.tools import ToolRegistry, Tool, registry

    weather = ToolRegistry()
    weather.register(Tool("get_weather", "Weather of a city.", {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}, lambda city: "sunny"))
    prompt = Protocol(smol, weather).system_prompt()
    assert "calculator" not in prompt and "get_weather" in prompt and "error" in prompt
    assert len(Protocol(smol, weather).messages("hi")) == 2  # no calculator example
    calc = Protocol(smol, registry(["calculator"]))
    assert "calculator for every calculation" in calc.system_prompt() and len(calc.messages("hi")) > 2


def test_tool_schemas_that_refer_into_themselves_are_constrained(smol):
    """A tool whose arguments use $defs (as pydantic-made MCP schemas do) beside one that does not:
    calls of either validate against their own schema with jsonschema."""
    from hybridlm.turns import tool_call_constraint

    point = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
             "required": ["x", "y"]}
    box = {"$defs": {"Point": point}, "type": "object", "required": ["box"], "properties": {"box": {
        "type": "object", "properties": {"low": {"$ref": "#/$defs/Point"}, "high": {"$ref": "#/$defs/Point"}},
        "required": ["low", "high"]}}}
    tools = [{"name": "area", "parameters": box},
             {"name": "echo", "parameters": {"type": "object", "properties": {"s": {"type": "string"}}}}]
    for seed in range(6):
        c = tool_call_constraint(smol, tools, "required", budget=120, vocab_size=smol.vocab_size)
        g = torch.Generator().manual_seed(seed)
        while not c.finished:
            allowed = c.mask()
            z = torch.randn(smol.vocab_size, generator=g)
            if allowed is not None:
                z = z.masked_fill(~allowed[: z.shape[0]], float("-inf"))
            c.advance(int(torch.multinomial(torch.softmax(z, -1), 1, generator=g)))
        (call,) = c.calls()
        jsonschema.validate(call.arguments, box if call.name == "area" else tools[1]["parameters"])


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=6),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(NAMES, c, max_size=3), max_leaves=5)


@settings(max_examples=80, deadline=None, phases=GENERATE)
@given(prop=schemas(), default=JSON_VALUES, value=JSON_VALUES, required=st.booleans())
def test_an_optional_property_takes_its_declared_default(prop, default, value, required):
    """jsonschema judges: asked to, an optional property takes its declared default besides what its own schema
    takes, and nothing else; a required property's schema is left as it was (its default is never what the
    function gets), and so is one whose pattern would have to judge a string of the default (no schema's regex
    is run here)."""
    from hybridlm.constraints.calls import admit_defaults

    params = {"type": "object", "properties": {"x": {**prop, "default": default}}, "required": ["x"] * required,
              "additionalProperties": False}
    widened = jsonschema.Draft202012Validator(admit_defaults(params)).is_valid
    before = jsonschema.Draft202012Validator(params).is_valid
    judged_by_pattern = "pattern" in json.dumps(prop) and "\"" in json.dumps(default)
    is_default = jsonschema.Draft202012Validator({"const": default}).is_valid(value) and not judged_by_pattern
    assert widened({"x": default}) or required or judged_by_pattern
    assert widened({"x": value}) == (before({"x": value}) or (is_default and not required))


def test_a_default_is_never_judged_by_a_clients_pattern():
    """A catastrophic pattern and a default it rejects only after backtracking: the schema is left as declared
    (were the pattern run, the default would be found outside it, after seconds, and admitted)."""
    from hybridlm.constraints.calls import admit_defaults

    prop = {"type": "string", "pattern": "^(a+)+$", "default": "a" * 22 + "!"}
    params = {"type": "object", "properties": {"x": prop}}
    assert admit_defaults(params) == params


def test_asked_to_a_call_may_write_out_a_default_its_type_does_not_admit(smol):
    """A string whose default is null (how `= None` is often declared) and an enum whose default is not one of its
    values, nested in an object too: asked to (BFCL's runner), the call may write the defaults out, token by token
    as the tokenizer splits them, and parses to them. Not asked (the server, the agent's default), the schema is
    JSON Schema's, where a default is an annotation: null is refused; so it is for a required property."""
    params = {"type": "object", "required": ["song"], "properties": {
        "song": {"type": "string"}, "device": {"type": "string", "default": None},
        "unit": {"type": "string", "enum": ["seconds", "milliseconds"], "default": "N/A"},
        "where": {"type": "object", "properties": {"room": {"type": "integer", "default": None}}}}}
    arguments = {"song": "roar", "device": None, "unit": "N/A", "where": {"room": None}}
    c = tool_call_constraint(smol, [{"name": "play", "parameters": params}], "required", vocab_size=smol.vocab_size,
                             defaults=True)
    feed(c, smol.encode(call("play", arguments)))
    assert [(x.name, x.arguments) for x in c.calls()] == [("play", arguments)]
    required = {**params, "required": ["song", "device"]}
    for schema, defaults in ((params, False), (required, True)):
        c = tool_call_constraint(smol, [{"name": "play", "parameters": schema}], "required",
                                 vocab_size=smol.vocab_size, defaults=defaults)
        with pytest.raises(AssertionError, match="refused"):
            feed(c, smol.encode(call("play", {"song": "roar", "device": None})))


# ---------------------------------------------------------------------- the budget on long completions
def _quote_bias(tok):
    """Logits that never want a quote: a model that would write every string forever."""
    texts = tok.table.texts
    quote = torch.tensor(['"' in s for s in texts] + [False] * (tok.vocab_size - len(texts)))
    return torch.where(quote, -30.0, 5.0)


def test_many_required_keys_are_closed_within_the_budget(smol):
    """The shortest completion of twelve required string keys is long; the witness must be
    checked early enough that the budget still holds all of them."""
    keys = [f"field_{i}" for i in range(12)]
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in keys}, "required": keys,
              "additionalProperties": False}
    bias = _quote_bias(smol)
    for seed, budget in ((0, 160), (1, 256), (2, 256)):
        c = json_schema_constraint(smol, schema, budget=budget, vocab_size=smol.vocab_size)
        tokens = sample(c, smol.vocab_size, seed, steps=budget + 1, bias=bias)
        assert c.finished and len(tokens) <= budget
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("fmt", ["email", "uri", "hostname"])
def test_formats_are_closed_within_the_budget(smol, fmt):
    """A closing quote is one more character inside an e-mail's local part: the witness must
    reach the separators ("@", ".", ":") the format needs before the value can end."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    bias = _quote_bias(smol)
    for seed in range(4):
        c = json_schema_constraint(smol, schema, budget=64, vocab_size=smol.vocab_size)
        tokens = sample(c, smol.vocab_size, seed, steps=65, bias=bias)
        assert c.finished and len(tokens) <= 64, (fmt, seed, c.text)
        value = json.loads(c.text)["v"]
        if fmt == "email":
            assert value.count("@") == 1 and not value.startswith("@")


def test_shortest_completion_counts_the_tokens_still_needed(smol):
    keys = [f"k{i}" for i in range(6)]
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys,
              "additionalProperties": False}
    c = json_schema_constraint(smol, schema, vocab_size=smol.vocab_size)
    shortest = c.shortest_completion()
    smallest = json.dumps({k: 0 for k in keys})  # the separators the constraint writes
    # every token holds at least one character; the stop token is one more
    assert len(keys) <= shortest <= len(smallest) + 1
    from hybridlm.constraints import closing_witness

    witness = closing_witness(c.matcher, c.lib, limit=shortest)
    assert len(witness) == shortest
    feed(c, witness)  # the witness is a completion the mask allows, token by token
    assert c.finished
    c = json_schema_constraint(smol, schema, vocab_size=smol.vocab_size)
    feed(c, smol.encode(json.dumps({k: 7 for k in keys})))
    assert c.shortest_completion() <= 1


# ---------------------------------------------------------------------- calls and schemas at the edges
def test_a_string_argument_may_hold_the_closing_tag(smol):
    tools = [{"name": "say", "parameters": {"type": "object", "properties": {"s": {"type": "string"}},
                                            "required": ["s"]}}]
    arguments = {"s": f"write {CLOSE} then {OPEN} literally"}
    text = call("say", arguments)
    calls, error = parse_calls(text, ["say"])
    assert error is None and calls[0].arguments == arguments
    c = tool_call_constraint(smol, tools, "required")
    ids = smol.encode(text)
    feed(c, ids[:-1])
    assert c.in_call
    feed(c, ids[-1:])
    assert not c.in_call and c.calls()[0].arguments == arguments
    from hybridlm.turns.codecs.tagged_json import call_is_open

    assert call_is_open(text[: text.index("literally")]) and not call_is_open(text)
    assert call_is_open(text[: text.index(" then")])  # the tag inside the unfinished string closes nothing
    from hybridlm.turns import render

    view = render([text[: text.index(" then")]], final=False, client_tools=frozenset({"say"}))
    assert view.content == "" and not any(c.complete for c in view.calls)


def test_tool_parameters_must_be_an_object_schema(smol):
    with pytest.raises(InputError, match="tool f: parameters must be a schema of type object"):
        tool_call_constraint(smol, [{"name": "f", "parameters": {"type": "string"}}], "required")


def test_a_required_key_without_a_description_is_still_writable(smol):
    params = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}
    tools = [{"name": "f", "parameters": params}]
    c = tool_call_constraint(smol, tools, "required")
    feed(c, smol.encode(call("f", {"a": "x", "b": [1, 2]})))
    assert c.finished and c.calls()[0].arguments == {"a": "x", "b": [1, 2]}
    for seed in range(3):
        c = tool_call_constraint(smol, tools, "required", budget=80, vocab_size=smol.vocab_size)
        sample(c, smol.vocab_size, seed)
        jsonschema.validate(c.calls()[0].arguments, params)


def test_boolean_schemas(smol):
    c = json_schema_constraint(smol, True, budget=40, vocab_size=smol.vocab_size)
    sample(c, smol.vocab_size, 0, steps=41)
    json.loads(c.text)
    with pytest.raises(InputError, match="admits no value"):
        json_schema_constraint(smol, False)


@pytest.mark.parametrize("bounds", [
    {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1},  # int64, as Rust and protobuf schemas say
    {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},  # uint64: beyond what 64-bit signed reads
    {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1},  # what zod writes for .int()
    {"type": "integer", "exclusiveMinimum": -(2**63)},
    {"type": "number", "minimum": -1.7976931348623157e308, "maximum": 1.7976931348623157e308},
    {"type": ["integer", "null"], "minimum": -2**63},
])
def test_bounds_at_the_edges_of_64_bits_compile_and_hold(smol, bounds):
    """The library cannot write bounds of 19 digits; they are tightened, never loosened, so every
    sampled value still validates against the schema as written."""
    schema = {"type": "object", "properties": {"n": bounds}, "required": ["n"]}
    for seed in range(3):
        c = json_schema_constraint(smol, schema, budget=60, vocab_size=smol.vocab_size)
        sample(c, smol.vocab_size, seed, steps=61)
        assert c.finished
        jsonschema.validate(json.loads(c.text), schema)
    c = json_schema_constraint(smol, schema, vocab_size=smol.vocab_size)
    feed(c, smol.encode('{"n": -12345}' if "exclusiveMinimum" in bounds or bounds.get("minimum", -1) < 0
                        else '{"n": 12345}'))
    assert c.accepting


def test_bounds_the_library_cannot_hold_are_one_line(smol):
    with pytest.raises(InputError, match=r"schema\.properties\.n\.minimum is 1e\+20"):
        json_schema_constraint(smol, {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**20}}})
    with pytest.raises(InputError, match=r"schema\.maximum is nan, not a finite number"):
        json_schema_constraint(smol, {"type": "number", "maximum": float("nan")})


def test_library_errors_are_one_line_with_their_cause(smol):
    with pytest.raises(InputError) as err:
        json_schema_constraint(smol, {"type": "string", "pattern": "(?<=a)b"})
    message = str(err.value)  # the library's second line says why
    assert "\n" not in message and "look-around" in message and "not supported" in message
    with pytest.raises(InputError) as err:
        json_schema_constraint(smol, {"oneOf": [{"type": "number"}, {"type": "integer"}]})  # overlapping
    assert "oneOf" in str(err.value) and "Write anyOf instead" in str(err.value)  # not a library option
    assert "coerce_one_of" not in str(err.value) and "\n" not in str(err.value)


def test_non_ascii_tool_names_are_shown_as_the_constraint_writes_them(smol):
    from hybridlm.turns import Protocol
    from hybridlm.turns.codecs.tagged_json import call_text
    from hybridlm.tools import Tool, ToolRegistry

    reg = ToolRegistry()
    reg.register(Tool("天气", "Das Wetter einer Stadt (°C).", {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}, lambda city: "晴"))
    prompt = Protocol(smol, reg).system_prompt()
    assert "天气" in prompt and "°C" in prompt and "\\u" not in prompt
    c = tool_call_constraint(smol, reg, "required")
    feed(c, smol.encode(call_text("天气", {"city": "上海"})))  # the spelling the prompt shows is writable
    assert c.finished and c.calls()[0].name == "天气"
