"""Every input error at a CLI entry point is one line and exit code 2, checked before the model
loads where the check needs no model; the trace reader validates every event against the
published JSON Schema (checked itself with jsonschema's meta-schema) and names line and field."""

import json
import os
import subprocess
import sys

import jsonschema
import pytest
from click.testing import CliRunner

from hybridlm.agent import HybridAgent
from hybridlm.engine.trace import read_trace
from hybridlm.tools import registry
from hybridlm.engine.trace import format_timeline, iter_trace
from hybridlm.cli import cli
from hybridlm.errors import InputError
from tests.agent_fakes import ScriptedModel


class ModelLoaded(AssertionError):
    pass


@pytest.fixture()
def no_model(monkeypatch):
    """Any model load fails the test: the input must be refused before it."""
    from hybridlm.weights import loading

    def refuse(*a, **k):
        raise ModelLoaded("the model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def one_line_exit_2(result, fragment):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    text = result.output.strip()
    assert "\n" not in text, text
    assert fragment in text, text
    assert "Traceback" not in text


@pytest.mark.parametrize("args, fragment", [
    (["generate", "x", "--seed", "18446744073709551616"], "--seed"),
    (["generate", "x", "--seed", "-1"], "0 ≤ seed"),
    (["agent", "x", "--seed", "18446744073709551616"], "--seed"),
    (["agent", "x", "--seed", "-5"], "0 ≤ seed"),
    (["generate", "\udcff\udcfe hello"], "UTF-8"),
    (["agent", "what is \udcff?"], "UTF-8"),
    (["generate", "x", "--ban", "\udcff"], "UTF-8"),
    (["generate", "x", "-n", "-3"], "-3"),
    (["generate", "x", "--top-k", "many"], "many"),
    (["generate", "x", "--logit-bias", "13"], "ID=BIAS"),
    (["generate", "x", "--logit-bias", "x=1"], "'x=1'"),
    (["generate", "x", "--logit-bias", "-4=1"], "-4"),
    (["generate", "x", "--frequency-penalty", "nan"], "frequency penalty"),
    (["generate"], "PROMPT"),
    (["generate", "x", "--json-schema", "/dev/zero"], "not a regular file"),
    (["generate", "x", "--grammar", "/dev/zero"], "not a regular file"),
    (["agent", "x", "--tools", "lookup", "--kb", "/dev/zero"], "not a regular file"),
    (["generate", "x", "--regex", "("], "unclosed group"),
    (["generate", "x", "--regex", ""], "expected a pattern"),
    (["generate", "1,x", "--ids"], "--ids expects integers"),
    (["generate", ",,,", "--ids"], "empty prompt: --ids expects token ids"),
    (["generate", "3,-5", "--ids"], "token id -5 is negative"),
    (["generate", "x", "--steer-scale", "2"], "need a steering vector"),
    (["generate", "x", "--context-policy", "block:0"], "δ an integer ≥ 1"),
    (["generate", "x", "--model", ""], "expected a model name"),
    (["agent", "x", "--tools", ","], "expected tool names"),
    (["agent", "x", "--mcp-timeout", "nan"], "finite number of seconds"),
    (["agent", "x", "--mcp-timeout", "0"], "finite number of seconds"),
    (["agent", "x", "--states"], "add --trace FILE"),
    (["consensus", "--device", "bogus"], "expected auto, cpu, cuda or cuda:N"),
    (["survey", "euler", "--width", "100000000", "--out", "unused"], "width = 100000000"),
])
def test_bad_input_is_one_line_before_the_model(no_model, args, fragment):
    one_line_exit_2(CliRunner().invoke(cli, args), fragment)


def test_option_files_are_checked_before_the_model(no_model, tmp_path):
    import os

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    one_line_exit_2(CliRunner().invoke(cli, ["generate", "x", "--json-schema", str(deep)]), "nested too deeply")
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    one_line_exit_2(CliRunner().invoke(cli, ["generate", "x", "--json-schema", str(listed)]), "expected an object")
    typed = tmp_path / "typed.json"
    typed.write_text('{"type": 5}')
    one_line_exit_2(CliRunner().invoke(cli, ["generate", "x", "--json-schema", str(typed)]), "type must be")
    empty = tmp_path / "empty.lark"
    empty.write_text("")
    one_line_exit_2(CliRunner().invoke(cli, ["generate", "x", "--grammar", str(empty)]), "mpty grammar")
    if hasattr(os, "mkfifo"):  # a FIFO would block the reader (or the writer) until its other end opens
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        one_line_exit_2(CliRunner().invoke(cli, ["generate", "x", "--json-schema", str(fifo)]), "not a regular file")
        one_line_exit_2(CliRunner().invoke(cli, ["agent", "x", "--trace", str(fifo)]), "not a regular file")
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(b"name: \xff\n")
    one_line_exit_2(CliRunner().invoke(cli, ["sweep", str(spec), "--out", str(tmp_path / "o")]), "UTF-8")
    spec.write_text("[" * 5000 + "]" * 5000)
    one_line_exit_2(CliRunner().invoke(cli, ["sweep", str(spec), "--out", str(tmp_path / "o")]), "nested too deeply")
    outside = tmp_path / "file"
    outside.write_text("")
    one_line_exit_2(CliRunner().invoke(cli, ["survey", "euler", "--out", str(outside)]), "is not a directory")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where nothing can be created")
@pytest.mark.parametrize("args", [
    ["agent", "x", "--trace", "/proc/x.jsonl"],
    ["eval", "agent", "--n", "1", "--out", "/proc/x.json"],
    ["survey", "euler", "--out", "/proc/x/y"],
    ["report", "unused.jsonl", "-o", "/proc/x.html"],
])
def test_unwritable_outputs_are_refused_before_the_work(no_model, args):
    """As root, os.access says /proc is writable; creating a file there is what fails."""
    one_line_exit_2(CliRunner().invoke(cli, args), "cannot be written")


@pytest.mark.parametrize("where", ["missing", "file"])
def test_trace_path_is_checked_before_the_model(no_model, tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    path = tmp_path / "missing" / "arc.jsonl" if where == "missing" else blocker / "arc.jsonl"
    one_line_exit_2(CliRunner().invoke(cli, ["agent", "x", "--trace", str(path)]), str(path.parent))


def test_deep_knowledge_base_is_one_line(no_model, tmp_path):
    kb = tmp_path / "kb.json"
    kb.write_text("[" * 100_000 + "]" * 100_000)
    one_line_exit_2(CliRunner().invoke(cli, ["agent", "x", "--tools", "lookup", "--kb", str(kb)]), "kb.json")


def test_huge_token_id_is_one_line(toy_hub):
    r = CliRunner().invoke(cli, ["generate", "99999999999999999999999", "--ids", "--model", str(toy_hub[0])])
    one_line_exit_2(r, "99999999999999999999999")


@pytest.mark.parametrize("config", ["[1, 2]", '{"n_embd": "64", "n_layer": 2, "n_head": 4, "vocab_size": 50257}'])
def test_bad_model_folder_config_is_one_line(tmp_path, config, toy_hub):
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "model.safetensors").write_bytes((toy_hub[0] / "model.safetensors").read_bytes())
    r = CliRunner().invoke(cli, ["generate", "x", "--model", str(tmp_path)])
    one_line_exit_2(r, "config.json")


def test_invalid_utf8_argv_through_the_console_script(toy_hub):
    cmd = [sys.executable, "-m", "hybridlm.cli", "generate", b"caf\xe9", "--model", str(toy_hub[0])]
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    assert p.returncode == 2, p.stderr
    err = p.stderr.decode("utf-8", "replace").strip()
    assert "\n" not in err and "UTF-8" in err and "Traceback" not in err


# ====================================================================== the trace schema
def good_trace(tokenizer, path):
    model = ScriptedModel(tokenizer, ['<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}'
                                      '</tool_call>', "42"])
    HybridAgent(model, registry(["calculator"]), tool_choice="auto").run("6 times 7?", trace=path)
    return path


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def test_published_schema_is_a_valid_json_schema():
    from hybridlm.engine.trace import SCHEMA_PATH

    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["$defs"]) >= {"start", "phase", "token", "control", "jump", "batch", "context", "end"}


def test_real_traces_validate_against_the_schema(tok, tmp_path):
    """Checked with jsonschema itself, event by event, and by hybridlm's reader."""
    from hybridlm.engine.trace import SCHEMA_PATH

    path = good_trace(tok, tmp_path / "arc.jsonl")
    schema = json.loads(SCHEMA_PATH.read_text())
    for line in path.read_text().splitlines():
        jsonschema.validate(json.loads(line), schema)
    events = read_trace(path)
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    assert "JUMP 1: calculator" in format_timeline(events)


def write_lines(path, *lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return path


BASE = {"t": 0, "k": 0, "wall_s": 0.0}


@pytest.mark.parametrize("line, fragment", [
    (b"\x00\xff\xfe\x89PNG garbage", ":2:"),
    ({"event": "token", "k": 0, "wall_s": 0.1, "token": 1, "text": "a"}, "'t'"),
    ({"event": "token", **BASE, "token": "one", "text": "a"}, "token"),
    ({"event": "token", **BASE, "token": 1, "text": 5}, "text"),
    ({"event": "jump", **BASE, "tool": "calc", "arguments": {}, "observation": None, "error": None,
      "duration_s": 0.1}, "observation"),
    ({"event": "phase", **BASE, "phase": "decode"}, "mode"),
    ({"event": "end", **BASE, "answer": 42}, "answer"),
    ({"event": "mystery"}, "'t'"),
    ({"event": "token", "t": -1, "k": 0, "wall_s": 0.0, "token": 1, "text": "a"}, "t"),
    ({"event": "token", "t": True, "k": 0, "wall_s": 0.0, "token": 1, "text": "a"}, "t"),
    (b'{"event": "token", "t": 1, "k": 0, "wall_s": NaN, "token": 1, "text": "a"}', "NaN"),
    (b"[" * 100_000, ":2:"),
    ([1, 2], "object"),
    ({"t": 0, "k": 0, "wall_s": 0.0}, "event"),
])
def test_bad_events_name_line_and_field(tmp_path, line, fragment):
    path = write_lines(tmp_path / "t.jsonl", {"event": "start", **BASE, "task": "x"}, line)
    with pytest.raises(InputError, match=None) as info:
        read_trace(path)
    message = str(info.value)
    assert "\n" not in message and fragment in message and (":1:" in message or ":2:" in message), message
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "show", str(path)]), fragment)


def test_unknown_kinds_and_fields_are_accepted(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", {"event": "start", **BASE, "task": "x", "new_field": [1]},
                       {"event": "hologram", **BASE, "colour": "blue"},
                       {"event": "batch", "t": 3, "k": 0, "wall_s": 0.5, "row": 2, "action": "join"},
                       {"event": "context", "t": 9, "k": 1, "wall_s": 0.7, "kept": 4},
                       {"event": "end", "t": 9, "k": 1, "wall_s": 0.9, "answer": "a", "stop_reason": "answer"})
    events = list(iter_trace(path))
    assert [e["event"] for e in events] == ["start", "hologram", "batch", "context", "end"]
    r = CliRunner().invoke(cli, ["trace", "show", str(path)])
    assert r.exit_code == 0, r.output


def test_token_events_without_text_are_shown(tmp_path):
    # found by fuzz/trace_reader.py: the schema lets a token carry no text (or null); the timeline took it as given
    path = write_lines(tmp_path / "t.jsonl", {"event": "start", **BASE, "task": "x"},
                       {"event": "token", "t": 1, "k": 0, "wall_s": 0.1, "token": 27},
                       {"event": "token", "t": 2, "k": 0, "wall_s": 0.2, "token": 28, "text": None},
                       {"event": "token", "t": 3, "k": 0, "wall_s": 0.3, "token": 29, "text": "ok"})
    for args in (["trace", "show", str(path)], ["trace", "show", "--tokens", str(path)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0 and "ok" in r.output, r.output


def test_binary_file_is_one_line(tmp_path):
    path = tmp_path / "junk.jsonl"
    path.write_bytes(bytes(range(256)) * 64)
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "show", str(path)]), "junk.jsonl")


@pytest.mark.parametrize("start, fragment", [
    ({"event": "start", **BASE, "task": "x"}, "kernel"),
    ({"event": "start", **BASE, "task": "x", "kernel": {"greedy": True}, "limits": {}, "tools": [],
      "tool_choice": "auto", "seed": "zero"}, "seed"),
    ({"event": "start", **BASE, "task": 5, "kernel": {"greedy": True}, "limits": {}, "tools": [],
      "tool_choice": "auto", "seed": 0}, "task"),
    ({"event": "start", **BASE, "task": "x", "kernel": {"greedy": True, "warp": 9}, "limits": {}, "tools": [],
      "tool_choice": "auto", "seed": 0}, "warp"),
    ({"event": "start", **BASE, "task": "x", "kernel": {"greedy": True}, "limits": {"max_jumps": -1}, "tools": [],
      "tool_choice": "auto", "seed": 0}, "max_jumps"),
    ({"event": "start", **BASE, "task": "x", "kernel": {"greedy": True}, "limits": {}, "tools": [{"name": 1}],
      "tool_choice": "auto", "seed": 0}, "tools"),
    ({"event": "start", **BASE, "task": "x", "kernel": {"greedy": True}, "limits": {}, "tools": [],
      "tool_choice": "sometimes", "seed": 0}, "tool_choice"),
])
def test_replay_validates_the_start_event_before_the_model(no_model, tmp_path, start, fragment):
    path = write_lines(tmp_path / "t.jsonl", start, {"event": "end", "t": 1, "k": 0, "wall_s": 0.1, "answer": "",
                                                      "stop_reason": "answer"})
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "replay", str(path)]), fragment)


def test_replay_without_start_is_refused_before_the_model(no_model, tmp_path):
    path = write_lines(tmp_path / "t.jsonl", {"event": "token", "t": 1, "k": 0, "wall_s": 0.0, "token": 1,
                                              "text": "a"})
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "replay", str(path)]), "start")


def test_ctrl_c_exits_130(monkeypatch):
    from hybridlm.weights import loading

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "load_model", interrupted)
    r = CliRunner().invoke(cli, ["generate", "x"])
    assert r.exit_code == 130 and "[interrupted]" in r.output and "Traceback" not in r.output
