"""Traces at the edges: written to /dev/null, a pipe or a FIFO; read back empty, cut off by a kill
mid-write, or bad at one line; replayed when the run that wrote them was killed.

References are independent of hybridlm's reader: json.loads of each complete line, the published
JSON Schema (the package's trace.schema.json, read as a file) checked with jsonschema, and the recorded token ids."""

import json
import os
import re
import socket
import stat
import tempfile
import threading
import warnings
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from hybridlm.agent import HybridAgent, Limits, replay
from hybridlm.tools import registry
from hybridlm.engine.trace import CutTraceWarning, read_trace
from hybridlm.cli import cli
from hybridlm.turns.codecs.tagged_json import CLOSE, OPEN
from hybridlm.engine.trace import TraceWriter
from hybridlm.errors import InputError
from tests.agent_fakes import ScriptedModel

SCHEMA = json.loads((Path(__file__).parents[1] / "src" / "hybridlm" / "engine" / "trace.schema.json")
                    .read_text(encoding="utf-8"))
SCRIPT = [OPEN + json.dumps({"name": "calculator", "arguments": {"expression": "6 * 7"}}) + CLOSE,
          "The answer is 42."]
BASE = {"t": 0, "k": 0, "wall_s": 0.0}


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture()
def no_model(monkeypatch):
    """Any model load fails the test: the input must be refused before it."""
    from hybridlm.weights import loading

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.fixture()
def scripted(monkeypatch, tok):
    """The CLI's model is a fresh ScriptedModel of SCRIPT (each load starts the script again)."""
    from hybridlm.weights import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: ScriptedModel(tok, SCRIPT))


def one_line_exit_2(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    text = result.output.strip()
    assert "\n" not in text and "Traceback" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def record(tok, path) -> Path:
    """A finished arc with one jump, written by the TraceWriter."""
    HybridAgent(ScriptedModel(tok, SCRIPT), registry(["calculator"]), tool_choice="auto").run("6 times 7?", trace=path)
    return path


def valid_events(data: bytes) -> list[dict]:
    """The events of complete lines, by json and jsonschema alone."""
    events = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    for e in events:
        jsonschema.validate(e, SCHEMA)
    return events


def cut_after_tokens(src: Path, dst: Path, n: int) -> Path:
    """The lines a run killed after its n-th token step leaves: all before the (n+1)-th token, no end."""
    out, seen = [], 0
    for line in src.read_text(encoding="utf-8").splitlines(keepends=True):
        kind = json.loads(line)["event"]
        if kind == "end" or (kind == "token" and seen == n):
            break
        seen += kind == "token"
        out.append(line)
    dst.write_text("".join(out), encoding="utf-8")
    return dst


# ====================================================================== 1. fsync only regular files
def test_trace_to_dev_null_runs(tok):
    # fsync(2) of /dev/null is EINVAL: the start, phase, jump and end events (the fsynced kinds) must not raise
    arc = HybridAgent(ScriptedModel(tok, SCRIPT), registry(["calculator"]), tool_choice="auto").run(
        "6 times 7?", trace="/dev/null")
    assert arc.answer == "The answer is 42." and len(arc.jumps) == 1


def test_agent_cli_traces_to_dev_null(scripted):
    r = CliRunner().invoke(cli, ["agent", "What is 6 * 7?", "--tool-choice", "auto", "--trace", "/dev/null"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "42" in r.stdout and "Traceback" not in r.output


def test_trace_to_a_pipe_is_written_whole(tok):
    # a pipe with a reader (what /dev/stdout is under `| cat`): every line arrives and matches the schema
    read_end, write_end = os.pipe()
    got = bytearray()

    def drain():
        while chunk := os.read(read_end, 65536):
            got.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        arc = HybridAgent(ScriptedModel(tok, SCRIPT), registry(["calculator"]), tool_choice="auto").run(
            "6 times 7?", trace=f"/proc/self/fd/{write_end}")
    finally:
        os.close(write_end)
        reader.join(10)
        os.close(read_end)
    events = valid_events(bytes(got))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("jump") == 1
    assert [e["token"] for e in events if e["event"] == "token"] == arc.generated_ids


# ====================================================================== 2. FIFOs and sockets never hang
def test_writer_refuses_a_fifo_without_reader_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome = []

    def open_it():
        try:
            TraceWriter(fifo).close()
            outcome.append("opened")
        except InputError as exc:
            outcome.append(str(exc))

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(5)
    if opener.is_alive():  # free the blocked open(2) before failing
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("TraceWriter waited for a reader of the FIFO")
    assert len(outcome) == 1 and "FIFO" in outcome[0] and str(fifo) in outcome[0], outcome
    assert "\n" not in outcome[0]


def test_writer_uses_a_fifo_that_has_a_reader(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with TraceWriter(fifo) as w:
            w.write("start", **BASE, task="x")
            w.write("end", **BASE, answer="a", stop_reason="stop_token")
        data = os.read(reader, 65536)
    finally:
        os.close(reader)
    assert [e["event"] for e in valid_events(data)] == ["start", "end"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # written through, not replaced by a file


def test_cli_refuses_a_fifo_before_the_model(no_model, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_exit_2(CliRunner().invoke(cli, ["agent", "x", "--trace", str(fifo)]), str(fifo), "not a regular file")


def test_cli_refuses_a_socket_before_the_model(no_model):
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # (a socket's path has at most 107 bytes)
        path = os.path.join(folder, "s")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(path)
            one_line_exit_2(CliRunner().invoke(cli, ["agent", "x", "--trace", path]), path, "not a regular file")
            with pytest.raises(InputError, match="socket"):
                TraceWriter(path)
        finally:
            server.close()


# ====================================================================== 3. a file without events
@pytest.mark.parametrize("content, why", [(b"", "the file is empty"), (b"\n \n\n", "only blank lines")])
def test_a_trace_without_events_is_refused(tmp_path, content, why):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match="holds no trace events"):
        read_trace(path)
    runner = CliRunner()
    one_line_exit_2(runner.invoke(cli, ["trace", "show", str(path)]), str(path), "holds no trace events", why)
    one_line_exit_2(runner.invoke(cli, ["report", str(path)]), str(path), "holds no trace events")
    assert not path.with_suffix(".html").exists()


def test_replay_of_an_empty_trace_is_refused_before_the_model(no_model, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "replay", str(path)]), "holds no trace events")


# ====================================================================== 4. a last line cut by a kill
LINES = [{"event": "start", **BASE, "task": "x → y"},
         {"event": "token", "t": 1, "k": 0, "wall_s": 0.1, "token": 5, "text": "a"},
         {"event": "token", "t": 2, "k": 0, "wall_s": 0.2, "token": 6, "text": "é→ü"}]


def trace_bytes(events) -> bytes:
    return b"".join(json.dumps(e, ensure_ascii=False).encode("utf-8") + b"\n" for e in events)


def cut_positions():
    """Every place a kill can cut the last line: after each of its bytes but the newline (mid-character too)."""
    last = json.dumps(LINES[-1], ensure_ascii=False).encode("utf-8")
    return range(1, len(last))


@pytest.mark.parametrize("keep", cut_positions())
def test_a_cut_last_line_is_skipped_with_a_warning(tmp_path, keep):
    whole = trace_bytes(LINES[:-1])
    path = tmp_path / "cut.jsonl"
    path.write_bytes(whole + json.dumps(LINES[-1], ensure_ascii=False).encode("utf-8")[:keep])
    with pytest.warns(CutTraceWarning, match=r"the last line is cut .*; 2 events read"):
        events = read_trace(path)
    assert events == valid_events(whole)


def test_cli_reads_a_cut_trace_and_says_so(tmp_path):
    whole = trace_bytes(LINES[:-1])
    path = tmp_path / "cut.jsonl"
    path.write_bytes(whole + b'{"event": "token", "t": 2, "k": 0, "wal')
    warning = f"[warning: {path}: the last line is cut (a run killed while writing it); 2 events read]"
    runner = CliRunner()
    r = runner.invoke(cli, ["trace", "show", "--tokens", str(path)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stderr.strip() == warning
    assert "token      5 'a'" in r.stdout and "token      6" not in r.stdout
    spans = tmp_path / "spans.jsonl"
    r = runner.invoke(cli, ["report", str(path), "--otel", str(spans)])  # the trace is read twice: one warning
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stderr.strip() == warning
    assert path.with_suffix(".html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("data, line, fragment", [
    # a bad line that is not the last
    (trace_bytes(LINES[:1]) + b'{"event": "tok\n' + trace_bytes(LINES[1:]), 2, "not a JSON line"),
    # a last line that ends with its newline: it was written whole, so it is bad, not cut
    (trace_bytes(LINES[:-1]) + b'{"event": "token", "t": 2\n', 3, "not a JSON line"),
    # no newline, but not begun as an event: garbage, not a cut
    (trace_bytes(LINES[:-1]) + b"\x00\xff\xfe garbage", 3, "not UTF-8 text"),
    (trace_bytes(LINES[:-1]) + b"[1, 2", 3, "not a JSON line"),
    # no newline, but a whole object with more after it
    (trace_bytes(LINES[:-1]) + b'{"event": "start", "t": 0, "k": 0, "wall_s": 0} {', 3, "not a JSON line"),
    # no newline, a bad byte inside the line rather than a character cut at its end
    (trace_bytes(LINES[:-1]) + b'{"event": "token", "text": "\xff abc', 3, "not UTF-8 text"),
    # no newline and whole, but not an event of the schema
    (trace_bytes(LINES[:-1]) + b'{"event": "token", "t": 2, "k": 0, "wall_s": 0.2, "token": "six"}', 3, "token"),
])
def test_other_bad_lines_stay_errors(tmp_path, data, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CutTraceWarning)
        with pytest.raises(InputError) as info:
            read_trace(path)
    assert str(info.value).startswith(f"{path}:{line}: ") and fragment in str(info.value), str(info.value)
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "show", str(path)]), f"{path}:{line}: ", fragment)


def test_a_trace_whose_only_line_is_cut_holds_no_events(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b'{"event": "start", "t": 0, "k"')
    with pytest.raises(InputError, match="holds no trace events .*cut off"):
        read_trace(path)
    one_line_exit_2(CliRunner().invoke(cli, ["trace", "show", str(path)]), "holds no trace events")


# ====================================================================== 5. replaying a killed run
@pytest.fixture()
def arc_trace(tok, tmp_path):
    path = record(tok, tmp_path / "arc.jsonl")
    events = valid_events(path.read_bytes())
    assert events[-1]["event"] == "end"
    return path, events


def token_counts(events) -> dict[str, int]:
    tokens = [e for e in events if e["event"] == "token"]
    jump_t = next(e["t"] for e in events if e["event"] == "jump")
    return {"early": 3, "at the jump": jump_t, "after the jump": len(tokens) - 2}


@pytest.mark.parametrize("where", ["early", "at the jump", "after the jump"])
def test_replay_of_a_killed_run_compares_the_recorded_part(scripted, tok, arc_trace, tmp_path, where):
    path, events = arc_trace
    n = token_counts(events)[where]
    cut = cut_after_tokens(path, tmp_path / "cut.jsonl", n)
    kept = valid_events(cut.read_bytes())
    recorded = [e["token"] for e in kept if e["event"] == "token"]
    jumps = sum(e["event"] == "jump" for e in kept)
    assert len(recorded) == n and not any(e["event"] == "end" for e in kept)
    r = CliRunner().invoke(cli, ["trace", "replay", str(cut)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout.strip() == (f"identical as far as recorded: the {n} recorded token steps and {jumps} "
                                f"jump{'' if jumps == 1 else 's'} were reproduced; the recording is cut there (no "
                                "end event: the run was killed)")
    arc, same, first = replay(cut, ScriptedModel(tok, SCRIPT))
    assert same and first is None
    assert arc.generated_ids[:n] == recorded
    # stopped where the recording stops (a jump landing at the cut may let one more token step through)
    assert arc.stop_reason == "cancelled" and n <= arc.token_steps <= n + 1
    assert len(arc.jumps) == jumps


def test_replay_of_a_killed_run_with_a_cut_line(scripted, arc_trace, tmp_path):
    path, events = arc_trace
    cut = cut_after_tokens(path, tmp_path / "cut.jsonl", 5)
    tail = json.dumps(events[-1]).encode()
    with open(cut, "ab") as fh:
        fh.write(tail[: len(tail) // 2])  # what a kill inside a write leaves
    r = CliRunner().invoke(cli, ["trace", "replay", str(cut)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout.startswith("identical as far as recorded: the 5 recorded token steps")
    assert re.fullmatch(rf"\[warning: {re.escape(str(cut))}: the last line is cut .*\]", r.stderr.strip())


def test_replay_of_a_killed_run_still_finds_a_difference(scripted, arc_trace, tmp_path):
    path, events = arc_trace
    cut = cut_after_tokens(path, tmp_path / "cut.jsonl", 8)
    lines = cut.read_text(encoding="utf-8").splitlines(keepends=True)
    changed = []
    for line in lines:
        e = json.loads(line)
        if e["event"] == "token" and e["t"] == 4:
            e["token"] = (e["token"] + 1) % 1000
            line = json.dumps(e) + "\n"
        changed.append(line)
    cut.write_text("".join(changed), encoding="utf-8")
    r = CliRunner().invoke(cli, ["trace", "replay", str(cut)])
    assert r.exit_code == 1 and r.stdout.strip() == "differs from token step 4", r.output


def test_replay_of_a_recording_longer_than_the_run_differs(scripted, tok, arc_trace, tmp_path):
    # no end event, but two token steps recorded past where the replayed run ends: a real difference
    path, events = arc_trace
    steps = sum(e["event"] == "token" for e in events)
    extra = [{"event": "token", "t": steps + i, "k": 1, "wall_s": 9.0, "token": 42, "text": "x"} for i in (1, 2)]
    longer = tmp_path / "longer.jsonl"
    longer.write_bytes(trace_bytes(events[:-1] + extra))
    r = CliRunner().invoke(cli, ["trace", "replay", str(longer)])
    assert r.exit_code == 1 and r.stdout.strip() == f"differs from token step {steps + 1}", r.output


def test_replay_of_a_finished_run_is_unchanged(scripted, arc_trace):
    path, events = arc_trace
    steps = sum(e["event"] == "token" for e in events)
    r = CliRunner().invoke(cli, ["trace", "replay", str(path)])
    assert r.exit_code == 0 and r.stdout.strip() == f"identical: {steps} token steps, 1 jumps reproduced", r.output


def test_a_trace_of_an_earlier_version_is_replayed_and_read(scripted, arc_trace, tmp_path):
    """Written before the kernel had min-p and the repeat penalty and before token events carried
    `kernel_logprob` (their `logprob` was the kernel's: 0 under greedy decoding): it still replays, and its
    probabilities read as the kernel's, the model's unknown."""
    from hybridlm.engine.arc import HybridArc
    from hybridlm.engine.clock import steps_of

    _, events = arc_trace
    new = [e for e in events if e["event"] == "token"]
    assert all(e["kernel_logprob"] == 0.0 and "logprob" in e for e in new)  # greedy: the kernel's 1, the model's own
    old = []
    for e in events:
        e = dict(e)
        if e["event"] == "token":
            e["logprob"] = e.pop("kernel_logprob")
        if e["event"] == "start":
            e["kernel"] = {k: v for k, v in e["kernel"].items() if k not in ("min_p", "repeat_penalty", "repeat_last_n")}
        old.append(e)
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_bytes(trace_bytes(old))
    valid_events(earlier.read_bytes())
    r = CliRunner().invoke(cli, ["trace", "replay", str(earlier)])
    assert r.exit_code == 0 and r.stdout.startswith("identical:"), r.output
    steps = list(steps_of(HybridArc.from_events(read_trace(earlier)).events))
    assert len(steps) == len(new) and all(s.logprob is None and s.kernel_logprob == 0.0 for s in steps)


def test_replay_of_a_killed_real_model_run(smollm2, monkeypatch, tmp_path):
    # the real sampler and grammar: the recorded prefix is reproduced, and the replay stops there
    from hybridlm.weights import loading

    path = tmp_path / "arc.jsonl"
    full = HybridAgent(smollm2, registry([]), tool_choice="none", limits=Limits(max_token_steps=8)).run(
        "Name a colour.", trace=path)  # (no tools: a short prompt, a fast test)
    assert full.token_steps > 4
    cut = cut_after_tokens(path, tmp_path / "cut.jsonl", 4)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: smollm2)
    r = CliRunner().invoke(cli, ["trace", "replay", str(cut)])
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout.startswith("identical as far as recorded: the 4 recorded token steps and 0 jumps"), r.stdout


# ====================================================================== 6. error messages: file:line: message
@pytest.mark.parametrize("line, fragment", [
    ({"event": "token", **BASE, "token": "one", "text": "a"}, "field 'token'"),
    ([1, 2], "a trace event is a JSON object"),
    (b"not json", "not a JSON line"),
    (b"\xff\xfe", "not UTF-8 text"),
    (b"[" * 100_000, "JSON nested too deep"),
])
def test_errors_name_file_and_line_with_one_colon(tmp_path, line, fragment):
    path = tmp_path / "t.jsonl"
    path.write_bytes(trace_bytes(LINES[:1]) + (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    with pytest.raises(InputError) as info:
        read_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and "::" not in message and fragment in message, message
    r = CliRunner().invoke(cli, ["trace", "show", str(path)])
    one_line_exit_2(r, f"Error: {path}:2: ", fragment)
    assert "::" not in r.output


def test_a_run_that_admits_defaults_records_it_and_replays_with_it(tok, tmp_path):
    """A call that writes out an optional argument's null default, which only `admit_defaults` lets through: the
    start event says so (valid against the published schema), and the replay, rebuilt from the trace alone,
    makes the same tokens; the same trace with the flag taken out of its start event does not."""
    from hybridlm.tools import Tool, ToolRegistry

    schema = {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "station": {"type": "string", "default": None}}}
    tools = ToolRegistry()
    tools.register(Tool("weather", "The weather of a city.", schema, lambda city, station=None: "sunny",
                        runs_in="thread"))
    script = [OPEN + json.dumps({"name": "weather", "arguments": {"city": "Rome", "station": None}}) + CLOSE,
              "It is sunny."]
    path = tmp_path / "arc.jsonl"
    arc = HybridAgent(ScriptedModel(tok, script), tools, admit_defaults=True).run("Weather in Rome?", trace=path)
    assert [(j.tool, j.arguments) for j in arc.jumps] == [("weather", {"city": "Rome", "station": None})]
    events = valid_events(path.read_bytes())
    assert events[0]["event"] == "start" and events[0]["admit_defaults"] is True
    _, identical, _ = replay(path, ScriptedModel(tok, script))
    assert identical
    strict = tmp_path / "strict.jsonl"
    strict.write_text("\n".join(json.dumps({k: v for k, v in e.items() if k != "admit_defaults"}) for e in events)
                      + "\n", encoding="utf-8")
    _, identical, _ = replay(strict, ScriptedModel(tok, script))
    assert not identical
