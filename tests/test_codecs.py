"""The call formats (hybridlm.turns.codecs) against llama.cpp: its templates choose the codec, the
tool-call strings of its tests/test-chat.cpp parse to the names, arguments and ids it expects, and
every codec's rendering of a call parses back (a property)."""

import json
import re

import pytest
from hypothesis import assume, given, settings, strategies as st

from hybridlm.turns.codecs import CODECS, Hermes, Llama3JSON, Mistral, Pythonic, TaggedJSON, ToolCall, detect

ONE = ToolCall("special_function", {"arg1": 1})
TWO = ToolCall("special_function_with_opt", {"arg1": 1, "arg2": 2})


@pytest.fixture(scope="module")
def test_chat(llama_cpp_source) -> str:
    """llama.cpp's tests/test-chat.cpp with its C string escapes undone (the strings as the model writes them)."""
    return (llama_cpp_source / "tests" / "test-chat.cpp").read_text(encoding="utf-8").replace("\\n", "\n") \
        .replace('\\"', '"')


@pytest.mark.parametrize("template, kind, generation, call_ids", [
    ("Qwen-Qwen2.5-7B-Instruct", Hermes, None, None),
    ("Qwen-Qwen3-0.6B", Hermes, None, None),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", Hermes, None, None),
    ("meta-llama-Llama-3.1-8B-Instruct", Llama3JSON, None, None),
    ("meta-llama-Llama-3.3-70B-Instruct", Llama3JSON, None, None),
    ("mistralai-Mistral-Nemo-Instruct-2407", Mistral, 1, False),
    ("Mistral-Small-3.2-24B-Instruct-2506", Mistral, 2, True),
    ("Qwen3-Coder", TaggedJSON, None, None),  # XML inside <tool_call>: not Hermes' JSON
    ("google-gemma-2-2b-it", TaggedJSON, None, None),  # no tools in the template: the default format
])
def test_the_template_chooses_the_codec(llama_cpp_source, template, kind, generation, call_ids):
    source = (llama_cpp_source / "models" / "templates" / f"{template}.jinja").read_text(encoding="utf-8")
    codec = detect(source)
    assert type(codec) is kind
    if kind is Mistral:
        assert (codec.generation, codec.call_ids) == (generation, call_ids)


@pytest.mark.parametrize("codec, text, calls, ids", [
    (CODECS["hermes"], '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', [ONE], None),
    (CODECS["hermes"], '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', [ONE], None),
    (CODECS["hermes"], '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}\n'
                       '</tool_call>', [ONE, TWO], None),
    (Mistral(1), '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]', [ONE],
     ["123456789"]),
    (Mistral(2), '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', [ONE], None),
    (Mistral(2), '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}[TOOL_CALLS]special_function_with_opt[ARGS]'
                 '{"arg1": 1, "arg2": 2}', [ONE, TWO], None),
    (Mistral(2, call_ids=True), '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', [ONE],
     ["123456789"]),
])
def test_llama_cpp_tool_call_strings_parse(test_chat, codec, text, calls, ids):
    # (the case is llama.cpp's own; one written there as adjacent C strings, a call each, is checked call by call)
    pieces = ["[TOOL_CALLS]" + p for p in text.split("[TOOL_CALLS]")[1:]] if text.startswith("[TOOL_CALLS]") else [text]
    assert all(piece in test_chat for piece in pieces)
    parsed, error = codec.parse(text, tools=["special_function", "special_function_with_opt"])
    assert error is None and parsed == calls
    if ids is not None:
        assert [c.id for c in parsed] == ids


@pytest.mark.parametrize("codec, cut", [
    (CODECS["hermes"], '<tool_call>\n{"name": "special_function", "arguments": {"arg1":'),
    (CODECS["hermes"], '<tool_call>\n{"name": "special_function", "arguments": {"arg'),
])
def test_a_cut_off_call_is_seen_as_far_as_written(test_chat, codec, cut):
    assert cut in test_chat
    assert codec.is_open(cut)
    (partial,) = codec.scan(cut, final=False)
    assert partial.name == "special_function" and not partial.complete
    assert codec.complete_calls(cut) == []


def test_llama3_json_calls_parse():
    codec = CODECS["llama3_json"]
    for text in ('{"name": "special_function", "parameters": {"arg1": 1}}',
                 '<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}}',
                 '{"name": "special_function", "arguments": {"arg1": 1}}'):
        assert codec.parse(text, tools=["special_function"]) == ([ONE], None), text


NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=3), max_leaves=6)
ARGUMENTS = st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), VALUES, max_size=4)


@settings(max_examples=60, deadline=None)
@given(codec=st.sampled_from([CODECS["tagged_json"], CODECS["hermes"], CODECS["llama3_json"], Mistral(1), Mistral(2)]),
       calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3))
def test_a_rendered_call_parses_back(codec, calls):
    text = codec.render_calls("", [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls])
    parsed, error = codec.parse(text, tools=[name for name, _ in calls])
    assert error is None, (text, error)
    assert parsed == [ToolCall(name, arguments) for name, arguments in calls]


# ---------------------------------------------------------------------- Hermes, read leniently
CALL = '{"name": "special_function", "arguments": {"arg1": 1}}'


@pytest.mark.parametrize("text", [CALL, "\n" + CALL, f"```json\n{CALL}\n```", f"```\n{CALL}\n```"])
def test_hermes_reads_a_call_written_without_its_tags(text):
    # (llama.cpp's Hermes parser takes a bare object or a ```json block too)
    codec = CODECS["hermes"]
    assert codec.parse(text, tools=["special_function"]) == ([ONE], None)
    assert codec.began(text) and not codec.is_open(text) and codec.free_text(text) == ""
    assert codec.complete_calls(text) == [ONE]


def test_a_bare_call_cut_off_is_open_and_held_back():
    codec = CODECS["hermes"]
    cut = CALL[:30]
    assert codec.is_open(cut) and codec.complete_calls(cut) == [] and codec.without_open_call(cut) == ""
    (partial,) = codec.scan(cut, final=False)
    assert partial.name == "special_function" and not partial.complete
    for start in ("{", '{"na', "```", "```json\n", ' { "'):  # a stream cannot show these yet
        assert codec.opening_tail(start) == len(start), start
    for text in ("{x} is a set", "```python\n", "The answer"):  # these are text
        assert not codec.began(text) and codec.opening_tail(text) < len(text), text
    assert CODECS["tagged_json"].parse(CALL)[0] == []  # the project's own format stays strict


def _fed(tok, choice, text, *, parallel=False, codec="hermes", max_calls=None):
    """The constraint of a turn (Hermes' by default) after the tokenizer's own encoding of `text`, or None where the
    mask refuses one of its tokens."""
    from hybridlm.turns import tool_call_constraint

    tools = [{"name": "special_function", "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}},
                                                         "required": ["arg1"]}}]
    c = tool_call_constraint(tok, tools, choice, codec=CODECS[codec], parallel=parallel, max_calls=max_calls)
    for i in tok.encode(text):
        allowed = c.mask()
        if allowed is not None and not bool(allowed[i]):
            return None
        c.advance(i)
    return c


PRETTY = json.dumps({"name": "special_function", "arguments": {"arg1": 1}}, indent=2)  # as Qwen writes it free


@pytest.mark.parametrize("choice", ["auto", "required", "special_function"])
def test_a_hermes_turn_may_call_without_the_tags(smollm2, choice):
    """A turn that calls may be calls written as the model writes them left free (bare, or in a ```json block,
    compact or pretty-printed; several in one block or each in a block of its own); "none" forbids them all."""
    tok = smollm2.tokenizer
    for text in (CALL, f"```json\n{CALL}\n```", f"```json\n{PRETTY}\n```", PRETTY):
        c = _fed(tok, choice, text)
        assert c is not None and c.calls() == [ONE] and c.answer() == "", text
        assert _fed(tok, "none", text) is None  # no call where none may be made, tagged or not
    for between in ("\n", "\n```json\n", "\n```\n\n```json\n"):
        two = _fed(tok, choice, f"```json\n{PRETTY}{between}{CALL}\n```", parallel=True)
        assert two is not None and two.calls() == [ONE, ONE], between
    assert _fed(tok, choice, f"```json\n{PRETTY}\n```json\n{CALL}", parallel=False) is None  # one call at most
    two = _fed(tok, choice, CALL + "\n" + CALL, parallel=True)
    assert two is not None and two.calls() == [ONE, ONE]
    if choice == "auto":
        for text in ("The answer is 42.", "```python\nprint(1)\n```"):  # free text stays free
            c = _fed(tok, "auto", text)
            assert c is not None and c.calls() == [] and c.answer() == text


@pytest.mark.parametrize("text", [
    '```json\n{\n\n  "name": "special_function", "arguments": {"arg1": 1}}',  # a blank line
    '```json\n{\n' + " " * 25 + '"name": "special_function", "arguments": {"arg1": 1}}',  # more than an indent
    '```json\n{"name":  "special_function", "arguments": {"arg1": 1}}',  # two blanks
])
def test_a_pretty_printed_call_has_bounded_blanks(smollm2, text):
    """The layout of a call written free is JSON's pretty-printing, bounded: a model cannot pad a call with blanks
    until its budget is gone (library.JSON_PRETTY)."""
    assert _fed(smollm2.tokenizer, "required", text) is None


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                       max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_.]{0,12}", fullmatch=True),
                                st.dictionaries(st.text(max_size=6), _values, max_size=3)), min_size=1, max_size=4),
       indent=st.sampled_from([None, 2, 4]), fenced=st.booleans(),
       between=st.sampled_from(["\n", "\n```json\n", "\n```\n```json\n", "\n```\n\n```json\n"]))
def test_calls_written_without_tags_parse_back(calls, indent, fenced, between):
    """Hermes reads a turn of calls written without the tags, in any of the layouts its grammar admits, as the
    same calls, in order (a law over names, arguments and layouts)."""
    objects = [json.dumps({"name": n, "arguments": a}, indent=indent, ensure_ascii=False) for n, a in calls]
    text = ("```json\n" + between.join(objects) + "\n```") if fenced else "\n".join(objects)
    parsed, error = Hermes().parse(text)
    assert error is None and [(c.name, c.arguments) for c in parsed] == calls


@pytest.mark.parametrize("codec, pad", [("hermes", "\n"), ("tagged_json", "")])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_newline_after_a_call_is_not_yet_a_second_call(smollm2, codec, pad, choice):
    """Where more calls may follow, the newline a model writes after its call leaves it both ways: the turn may
    end there (the model's stop token) or open one more call. (Before, the newline was the separator of a next
    call only: the mask then made Qwen write calls it never chose.)"""
    tok = smollm2.tokenizer
    call = f"<tool_call>{pad}{CALL}{pad}</tool_call>"
    for horizon in (None, 2, 3):
        c = _fed(tok, choice, call + "\n", parallel=True, codec=codec, max_calls=horizon)
        assert c is not None and c.calls() == [ONE] and c.accepting
        allowed, stop = c.mask(), min(tok.stop_ids())
        assert allowed is None or bool(allowed[stop])
        c.advance(stop)
        assert c.finished and c.calls() == [ONE]
    two = _fed(tok, choice, call + "\n" + call, parallel=True, codec=codec)
    assert two is not None and two.calls() == [ONE, ONE]
    assert _fed(tok, choice, call + "\n", parallel=False, codec=codec) is None  # one call: the stop token only
    if codec == "hermes" and choice == "auto":  # so does a call written without the tags
        bare = _fed(tok, choice, CALL + "\n", parallel=True, codec=codec)
        assert bare is not None and bare.calls() == [ONE] and bare.accepting


def test_the_models_list_says_each_models_call_format():
    from click.testing import CliRunner

    from hybridlm.cli import cli

    r = CliRunner().invoke(cli, ["models", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.output)}
    assert rows["smollm2-135m"]["tool_format"] == "tagged_json (default)"  # its template takes no tools
    for name, expected in (("qwen2.5-coder-0.5b", "hermes"), ("gemma-3-270m", "tagged_json (default)")):
        if rows[name]["available"] and rows[name]["grid"] is not None:
            assert rows[name]["tool_format"] == expected


# ---------------------------------------------------------------------- pythonic
LFM2 = Pythonic("<|tool_call_start|>", "<|tool_call_end|>")


@pytest.mark.parametrize("text, name, arguments", [
    ('<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>', "special_function", {"arg1": 1}),
    ('<|tool_call_start|>[get_time(city="XYZCITY")]<|tool_call_end|>', "get_time", {"city": "XYZCITY"}),
    ('<|tool_call_start|>[toggle(enabled=True)]<|tool_call_end|>', "toggle", {"enabled": True}),
    ('<|tool_call_start|>[set_nullable(value=None)]<|tool_call_end|>', "set_nullable", {"value": None}),
    ('<|tool_call_start|>[set_config(config={"enabled": True, "count": 3})]<|tool_call_end|>', "set_config",
     {"config": {"enabled": True, "count": 3}}),
    ('<|tool_call_start|>[set_config(config={"enabled": true, "note": null})]<|tool_call_end|>', "set_config",
     {"config": {"enabled": True, "note": None}}),
    ('<|tool_call_start|>[Calendar.create_event(title="demo", participants=["Alice", "Bob"], '
     'metadata={"priority": "high", "reminder": true})]<|tool_call_end|>', "Calendar.create_event",
     {"title": "demo", "participants": ["Alice", "Bob"], "metadata": {"priority": "high", "reminder": True}}),
])
def test_llama_cpp_pythonic_strings_parse(test_chat, text, name, arguments):
    assert text in re.sub(r'"\s+"', "", test_chat)  # (llama.cpp's test writes the long one as two C strings)
    assert LFM2.parse(text) == ([ToolCall(name, arguments)], None)
    bare = Pythonic()
    assert bare.parse(text.removeprefix(LFM2.start).removesuffix(LFM2.end)) == ([ToolCall(name, arguments)], None)


def test_pythonic_text_stays_text_and_nothing_is_evaluated():
    link = "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org)."
    for codec in (LFM2, Pythonic()):
        assert not codec.began(link) and codec.free_text(link) == link and codec.parse(link)[0] == []
    for hostile in ("[f(a=__import__('os').system('true'))]", "[f(a=open('x'))]", "[f(*x)]", "[f(1)]", "[f(a=1+1)]"):
        calls, error = Pythonic().parse(hostile)
        assert calls == [] and error is not None, hostile
    cut = "[get_time(city="
    assert Pythonic().is_open(cut) and Pythonic().complete_calls(cut) == []
    assert [c.name for c in Pythonic().scan(cut, final=False)] == ["get_time"]
    assert Pythonic().parse('[a(x=1), b.c(y=[1, "]"])]') == ([ToolCall("a", {"x": 1}), ToolCall("b.c", {"y": [1, "]"]})],
                                                          None)


def test_pythonic_templates_are_detected(llama_cpp_source):
    folder = llama_cpp_source / "models" / "templates"
    for name in ("LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"):
        codec = detect((folder / f"{name}.jinja").read_text(encoding="utf-8"))
        assert isinstance(codec, Pythonic) and codec.start == LFM2.start, name
    assert isinstance(detect("... [func_name1(params_name1=params_value1, params_name2=params_value2...)] ..."), Pythonic)


@settings(max_examples=40, deadline=None)
@given(codec=st.sampled_from([Pythonic(), LFM2]), calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3))
def test_a_rendered_pythonic_call_parses_back(codec, calls):
    import keyword

    assume(not any(keyword.iskeyword(n) or any(keyword.iskeyword(a) for a in args) for n, args in calls))  # (not Python names)
    text = codec.render_calls("", [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls])
    parsed, error = codec.parse(text, tools=[name for name, _ in calls])
    assert error is None, (text, error)
    assert parsed == [ToolCall(name, arguments) for name, arguments in calls]


def test_a_pythonic_turn_follows_its_grammar(smollm2):
    from hybridlm.turns import tool_call_constraint

    tok = smollm2.tokenizer
    tools = [{"name": "get_time", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    for codec, choice, text in ((Pythonic(), "auto", '[get_time(city="Paris")]'), (Pythonic(), "auto", "It is noon."),
                                (LFM2, "required", '<|tool_call_start|>[get_time(city="Paris")]<|tool_call_end|>')):
        c = tool_call_constraint(tok, tools, choice, codec=codec)
        for i in tok.encode(text):
            allowed = c.mask()
            assert allowed is None or bool(allowed[i]), (text, c.text)
            c.advance(i)
        assert c.calls() == ([ToolCall("get_time", {"city": "Paris"})] if "get_time" in text else [])
