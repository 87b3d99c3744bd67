"""BFCL's own checker and data, loaded without its SDKs (skipped without bfcl-eval)."""

import json

import jsonschema
import pytest

pytest.importorskip("bfcl_eval", reason="BFCL's data and checker: pip install --no-deps bfcl-eval")

from hybridlm.agent import bfcl
from hybridlm.errors import InputError


def first(accepted: dict) -> dict:
    """The first accepted value of each parameter ("" marks an optional one left out), nested dicts too."""
    out = {}
    for k, v in accepted.items():
        if not isinstance(v, list):  # (a few nested answers give a value itself)
            out[k] = v
        elif v and v[0] != "":
            out[k] = first(v[0]) if isinstance(v[0], dict) else v[0]
    return out


def first_answer(task):
    return [{name: first(params)} for call in task.answer for name, params in call.items()]


@pytest.mark.parametrize("category, n", [("simple_python", 400), ("live_simple", 258), ("multiple", 200),
                                         ("parallel", 200), ("parallel_multiple", 200), ("live_multiple", 1053),
                                         ("live_parallel", 16), ("live_parallel_multiple", 24)])
def test_the_checker_accepts_the_ground_truth_and_the_mapped_schema_admits_it(category, n):
    tasks = bfcl.tasks(category)
    assert len(tasks) == n
    for task in tasks[:40]:
        calls = first_answer(task)
        declared = {f["name"]: set(f["parameters"].get("properties", {})) for f in task.functions}
        if any(set(args) - declared[name] for call in calls for name, args in call.items()):
            continue  # a few answers name a parameter their function does not declare (BFCL's data)
        assert bfcl.check(task, calls)["valid"], task.id
        schemas = {f["name"]: bfcl.json_schema(f["parameters"]) for f in task.functions}
        for call in calls:
            ((name, arguments),) = call.items()
            try:
                jsonschema.validate(arguments, schemas[name])
            except jsonschema.ValidationError as exc:  # BFCL writes ints where it declares floats
                assert "is not of type 'number'" not in exc.message, task.id


def test_a_wrong_call_is_refused_with_its_error_type():
    task = bfcl.tasks("simple_python", limit=1)[0]
    verdict = bfcl.check(task, [{"calculate_triangle_area": {"base": 11, "height": 5}}])
    assert not verdict["valid"] and verdict["error_type"].startswith("value_error")
    assert bfcl.check(task, [])["error_type"] == "simple_function_checker:wrong_count"


def test_types_map_to_json_schema():
    schema = bfcl.json_schema({"type": "dict", "properties": {
        "x": {"type": "float"}, "t": {"type": "tuple", "items": {"type": "float"}},
        "d": {"type": "dict", "properties": {"a": {"type": "any"}}}}, "required": ["x"]})
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object" and schema["properties"]["x"]["type"] == "number"
    assert schema["properties"]["t"] == {"type": "array", "items": {"type": "number"}}
    assert schema["properties"]["d"]["properties"]["a"]["type"] == "string"


def test_unknown_category_and_resume(tmp_path):
    with pytest.raises(InputError, match="category 'nope'"):
        bfcl.tasks("nope")
    out = tmp_path / "r.jsonl"
    runner = type("R", (), {"name": "fake", "__call__": lambda self, t: first_answer(t)})()
    rows = bfcl.evaluate(runner, ["simple_python"], limit=3, out=out)
    assert [r["valid"] for r in rows] == [True, True, True]
    with pytest.raises(InputError, match="--resume"):
        bfcl.evaluate(runner, ["simple_python"], limit=3, out=out)
    out.write_text(out.read_text() + '{"cut')  # a line cut by a killed run
    rows = bfcl.evaluate(runner, ["simple_python"], limit=4, out=out, resume=True)
    assert len(rows) == 4 and len(out.read_text().splitlines()) == 5


def test_every_kth_task_spreads_the_sample(tmp_path):
    whole = [t.id for t in bfcl.tasks("live_simple")]
    sample = [t.id for t in bfcl.tasks("live_simple", every=10, limit=5)]
    assert sample == whole[::10][:5]
    runner = type("R", (), {"name": "fake", "__call__": lambda self, t: first_answer(t)})()
    rows = bfcl.evaluate(runner, ["live_simple"], every=50, out=tmp_path / "r.jsonl")
    assert [r["id"] for r in rows] == whole[::50]


def test_the_lenient_reference_reads_a_json_block_or_bare_json():
    from hybridlm.agent.bfcl import LlamaCppRunner, bare_calls

    call = {"name": "f", "arguments": {"x": 1}}
    text = f"Sure:\n```json\n{json.dumps(call)}\n```\nand [{json.dumps(call)}, {json.dumps({'name': 'g', 'parameters': {}})}]"
    assert [(c.name, c.arguments) for c in bare_calls(text)] == [("f", {"x": 1}), ("f", {"x": 1}), ("g", {})]
    assert bare_calls('{"name": 3} {"a": {"name": "h", "arguments": "not json"}}') == []
    strict, lenient = (LlamaCppRunner.__new__(LlamaCppRunner) for _ in range(2))
    strict.parsing, lenient.parsing = "hermes", "lenient"
    tagged = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    assert strict.parsed(tagged, ["f"]) == lenient.parsed(tagged, ["f"]) == [{"f": {"x": 1}}]
    assert strict.parsed(text, ["f", "g"]) == [] and len(lenient.parsed(text, ["f", "g"])) == 3


def test_the_agent_prompt_of_a_task_is_the_tasks_own_conversation_as_transformers_renders_it():
    """Qwen2.5's template given the tools: the agent's prompt for a task (no system message of the project's
    own; the task's system message where it has one) is byte for byte `transformers`' rendering of the task's
    own messages with its tools, as a client of llama.cpp's or vLLM's server would send them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from hybridlm.turns import Protocol
    from hybridlm.turns.codecs import detect
    from hybridlm.weights.gguf_header import read_header
    from hybridlm.weights.registry import real_model_path
    from hybridlm.weights.vocab import tokenizer_from_metadata

    tok = tokenizer_from_metadata(read_header(real_model_path("qwen2.5-coder-0.5b")).metadata, name="qwen2.5")
    live = bfcl.tasks("live_simple")
    chosen = [bfcl.tasks("simple_python", limit=1)[0], next(t for t in live if t.system)]
    for task in chosen:
        schemas = [{"name": f["name"], "description": f.get("description", ""),
                    "parameters": bfcl.json_schema(f["parameters"])} for f in task.functions]
        protocol = Protocol(tok, schemas, example=False, codec=detect(tok.chat_template), system=task.system)
        assert protocol.templated
        ours = tok.render_chat(protocol.messages(task.question), tools=protocol.tools(), add_generation_prompt=True)
        (theirs,), _ = render_jinja_template([task.messages], tools=protocol.tools(), chat_template=tok.chat_template,
                                             add_generation_prompt=True, bos_token="", eos_token="<|im_end|>")
        assert ours == theirs, task.id
        assert ("You are Qwen" in ours) == (not task.system)


def test_parallel_calls_made_one_per_turn_are_read_without_repeats():
    """A parallel task answered one call per turn with repeats: read without them, in the order first made,
    BFCL's checker accepts what it refused with the repeats."""
    task = bfcl.tasks("parallel", limit=1)[0]
    calls = first_answer(task)
    assert len(calls) >= 2 and bfcl.check(task, calls)["valid"]
    made = [calls[0], calls[0], *calls[1:], calls[1]]
    assert not bfcl.check(task, made)["valid"]
    assert bfcl.distinct(made) == calls and bfcl.check(task, bfcl.distinct(made))["valid"]
    assert bfcl.distinct([]) == []


def test_a_default_written_out_is_taken_by_the_checker_and_by_the_runners_grammar():
    """BFCL's checker is the reference. Each answer with an optional parameter written out as its declared default,
    where the checker takes it, validates against the schema the runner's turns enforce (admit_defaults); many of
    them (null for a string declared `"default": null`) do not validate against JSON Schema's reading."""
    from hybridlm.constraints.calls import admit_defaults

    taken = widened_only = 0
    for category in ("simple_python", "live_simple", "multiple"):
        for task in bfcl.tasks(category)[:100]:
            ((name, arguments),) = first_answer(task)[0].items()
            ((_, accepted),) = task.answer[0].items()
            declared = next(f for f in task.functions if f["name"] == name)["parameters"]
            for key, prop in (declared.get("properties") or {}).items():
                if key in arguments or "default" not in prop or key not in accepted:
                    continue
                call = {**arguments, key: prop["default"]}
                if not bfcl.check(task, [{name: call}])["valid"]:
                    continue  # (the checker does not take this default: nothing to admit)
                taken += 1  # (the parameter itself is judged: BFCL's data has answers its own schemas refuse elsewhere)
                schema = bfcl.json_schema(declared)
                jsonschema.validate(prop["default"], admit_defaults(schema)["properties"][key])
                widened_only += not jsonschema.Draft202012Validator(schema["properties"][key]).is_valid(prop["default"])
    assert taken > 50 and widened_only > 5, (taken, widened_only)
