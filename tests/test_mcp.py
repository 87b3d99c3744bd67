"""MCP tool servers in the external mode, against real servers started by the tests.

The servers are tests/mcp_server.py (written with the `mcp` package's server API), reached
over stdio and over streamable HTTP on 127.0.0.1, and the published reference server
`mcp-server-time`. References: the servers' own results, Python's arithmetic, `zoneinfo`,
and `jsonschema` for the listed schemas.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import jsonschema
import pytest
from click.testing import CliRunner

from hybridlm.agent import HybridAgent, Limits
from hybridlm.engine.trace import read_trace
from hybridlm.tools import ToolRegistry
from hybridlm.cli.options import tool_registry
from hybridlm.tools.mcp import MCPServers, ServerSpec, mcp_tools
from hybridlm.cli import cli
from hybridlm.errors import InputError

SERVER = Path(__file__).with_name("mcp_server.py")
STDIO = f"{sys.executable} {SERVER}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server():
    """The test server over streamable HTTP on a free loopback port, stopped after the test."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"the HTTP test server exited with {proc.returncode}")
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the HTTP test server did not listen within 60 s")
    yield proc, f"http://127.0.0.1:{port}/mcp"
    proc.kill()
    proc.wait(10)


def check_server_tools(reg: ToolRegistry, server: str) -> None:
    """What every transport must give: schemas, results, and each failure as its own error kind."""
    assert {"add", "fail", "hang", "box_area", "summary", "flood"} <= set(reg.tools)
    for t in reg:
        assert t.runs_in == "thread" and t.server == server
        jsonschema.Draft202012Validator.check_schema(t.parameters)
    # the nested-object schema is the server's: it accepts a box and rejects a box without a corner
    box = {"box": {"low": {"x": 1.5, "y": -2}, "high": {"x": 4, "y": 3}}}
    jsonschema.validate(box, reg.tools["box_area"].parameters)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"box": {"low": {"x": 0, "y": 0}}}, reg.tools["box_area"].parameters)

    assert reg.call("add", {"a": 123456, "b": -789}).text == str(123456 - 789)
    area = reg.call("box_area", box)
    assert area.ok and float(area.text) == (4 - 1.5) * (3 - (-2))
    structured = reg.call("summary", {"values": [1.0, 2.5, 4.0]})
    assert structured.ok and json.loads(structured.text) == {"mean": 2.5, "count": 3}

    failed = reg.call("fail", {"reason": "no water"})
    assert failed.error == "tool_error" and "no water" in failed.text
    hung = reg.call("hang", {"seconds": 30})
    assert hung.error == "timeout"
    assert reg.call("add", {"a": 2, "b": 2}).text == "4"  # the session outlives a cancelled call
    flood = reg.call("flood", {"chars": reg.max_output_chars * 3})
    assert flood.error == "too_large" and str(reg.max_output_chars * 3) in flood.text
    invalid = reg.call("box_area", {"box": {"low": {"x": 0}}})
    assert invalid.error == "invalid_arguments"


def test_stdio_server_tools_results_and_failures():
    with mcp_tools([STDIO], timeout_s=1.5) as reg:
        check_server_tools(reg, "hybridlm-test")
        before = int(reg.call("pid", {}).text)
        crashed = reg.call("crash", {})
        assert crashed.error == "server_disconnected" and "exiting on request" in crashed.text  # its stderr
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the broken session is reset: the server is started anew
            after = reg.call("add", {"a": 1, "b": 1})
            if after.ok:
                break
            time.sleep(0.5)
        assert after.text == "2"
        assert int(reg.call("pid", {}).text) != before


def test_the_server_dies_with_its_client(tmp_path):
    """A client killed with SIGKILL (no cleanup runs) takes its stdio server with it (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    script = ("import sys, time\nfrom hybridlm.tools.mcp import mcp_tools\n"
              f"with mcp_tools([{STDIO!r}]) as reg:\n"
              "    print(reg.call('pid', {}).text, flush=True)\n    time.sleep(600)\n")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(client.stdout.readline())
        os.kill(pid, 0)
    finally:
        client.kill()
        client.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the MCP server {pid} outlived its client")


def test_http_server_tools_results_and_a_kill_mid_call(http_server):
    proc, url = http_server
    with mcp_tools([url], timeout_s=1.5) as reg:
        check_server_tools(reg, "hybridlm-test")
        killer = threading.Timer(0.5, proc.kill)
        killer.start()
        killed = reg.call("hang", {"seconds": 1.2})
        killer.join()
        assert killed.error == "server_disconnected"
        assert reg.call("add", {"a": 1, "b": 1}).error == "server_disconnected"


def test_close_ends_the_server_process_and_the_loop_thread():
    with mcp_tools([STDIO]) as reg:
        pid = int(reg.call("pid", {}).text)
        os.kill(pid, 0)  # alive while the block runs
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not [t for t in threading.enumerate() if t.name == "mcp-loop"]


def test_two_servers_and_a_name_taken_twice(http_server):
    _, url = http_server
    with tool_registry("calculator", mcp=[STDIO, url]) as reg:
        assert "calculator" in reg and reg.tools["calculator"].server is None
        assert reg.tools["add"].server == "hybridlm-test#1"
        assert reg.tools["hybridlm-test#2.add"].server == "hybridlm-test#2"
        assert reg.call("hybridlm-test#2.add", {"a": 40, "b": 2}).text == "42"


@pytest.mark.parametrize("spec, message", [
    ("", "empty server"),
    ("no-such-command-here --flag", "not found"),
    ("http://", "no host"),
    (f"{sys.executable} -c pass", "cannot connect"),
])
def test_bad_servers_are_one_line_errors(spec, message):
    with pytest.raises(InputError, match=message):
        MCPServers([spec], connect_timeout_s=30)
    assert not [t for t in threading.enumerate() if t.name == "mcp-loop"]


def _processes_running(fragment: str) -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fragment in cmdline:
            out.append(cmdline)
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_a_server_that_never_answers_the_handshake_is_ended(tmp_path):
    script = tmp_path / "mute_server.py"
    script.write_text("import time\ntime.sleep(120)\n")
    start = time.monotonic()
    with pytest.raises(InputError, match="no handshake within 2 s"):
        MCPServers([f"{sys.executable} {script}"], connect_timeout_s=2)
    assert time.monotonic() - start < 2 + 12  # the SDK's shutdown: stdin closed, a grace period, a kill
    assert not _processes_running(str(script))
    assert not [t for t in threading.enumerate() if t.name == "mcp-loop"]


def test_an_infinite_timeout_is_refused_before_any_server_starts():
    start = time.monotonic()
    with pytest.raises(InputError, match="MCP timeout inf: expected a positive, finite number"):
        MCPServers([STDIO], timeout_s=float("inf"))
    assert time.monotonic() - start < 1


def test_stdio_servers_get_the_environment_and_whole_descriptions(monkeypatch):
    monkeypatch.setenv("HYBRIDLM_TEST_TOKEN", "s3cret-\u00e9")
    with mcp_tools([STDIO]) as reg:
        assert reg.call("env", {"name": "HYBRIDLM_TEST_TOKEN"}).text == "s3cret-\u00e9"
        description = reg.tools["add"].description
        assert description.startswith("Add two integers.") and "a: the first term" in description


def test_cli_bad_mcp_value_exits_2_before_the_model_loads():
    result = CliRunner().invoke(cli, ["agent", "--mcp", "no-such-command-here", "What is 2 + 2?"])
    assert result.exit_code == 2 and "not found" in result.output
    result = CliRunner().invoke(cli, ["agent", "--tools", "none,calculator", "What is 2 + 2?"])
    assert result.exit_code == 2 and "'none' cannot be combined" in result.output


def test_published_reference_server_mcp_server_time():
    """`mcp-server-time` from PyPI: a conversion between two zones without daylight saving time."""
    with mcp_tools([f"{sys.executable} -m mcp_server_time --local-timezone UTC"]) as reg:
        convert = reg.tools["convert_time"]
        assert convert.server == "mcp-time"
        args = {"source_timezone": "Asia/Tokyo", "time": "12:00", "target_timezone": "Asia/Kolkata"}
        jsonschema.validate(args, convert.parameters)
        obs = reg.call("convert_time", args)
        assert obs.ok, obs.text
        result = json.loads(obs.text)
    today = datetime.now(ZoneInfo("Asia/Tokyo")).date()
    noon = datetime(today.year, today.month, today.day, 12, 0, tzinfo=ZoneInfo("Asia/Tokyo"))
    expected = noon.astimezone(ZoneInfo("Asia/Kolkata"))
    assert datetime.fromisoformat(result["target"]["datetime"]) == expected
    assert result["time_difference"] == "-3.5h"
    assert expected.utcoffset() == timedelta(hours=5, minutes=30)


def test_killing_the_server_mid_call_ends_the_run_within_its_limits(smollm2, tmp_path):
    """The agent's only tool blocks; the test kills the server during the call."""
    pid_file = tmp_path / "server.pid"
    trace = tmp_path / "arc.jsonl"
    with mcp_tools([f"{STDIO} --pid-file {pid_file}"], timeout_s=120) as full:
        reg = ToolRegistry({"block": full.tools["block"]})

        def kill_when_blocked():
            deadline = time.monotonic() + 300
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)

        killer = threading.Thread(target=kill_when_blocked, daemon=True)
        killer.start()
        limits = Limits(max_token_steps=40, max_jumps=2)
        arc = HybridAgent(smollm2, reg, limits=limits, tool_choice="required").run("Block.", trace=trace)
        killer.join(5)
    assert arc.jumps and arc.jumps[0].tool == "block" and arc.jumps[0].error == "server_disconnected"
    assert all(j.error == "server_disconnected" for j in arc.jumps)
    assert arc.token_steps <= limits.max_token_steps and len(arc.jumps) <= limits.max_jumps
    events = read_trace(trace)
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    assert [e["error"] for e in events if e["event"] == "jump"] == [j.error for j in arc.jumps]


def test_agent_cli_with_an_mcp_server_jumps_to_it(smollm2, tmp_path):
    """End to end on the default model: the observation of the jump is the server's sum."""
    trace = tmp_path / "arc.jsonl"
    result = CliRunner().invoke(cli, ["agent", "--mcp", STDIO, "--tools", "none", "--trace", str(trace),
                                      "-n", "80", "What is 1234 plus 4321? Use the add tool."])
    assert result.exit_code == 0, result.output
    jumps = [e for e in read_trace(trace) if e["event"] == "jump"]
    assert jumps and all(j["server"] == "hybridlm-test" for j in jumps)
    first = jumps[0]
    if first["tool"] == "add":
        assert first["error"] is None and first["observation"] == str(first["arguments"]["a"] + first["arguments"]["b"])
    else:  # whichever tool the model chose, its observation is the server's answer to those arguments
        assert first["error"] in (None, "tool_error", "timeout") and first["observation"]
    # box_area's schema refers to its own $defs (a nested pydantic model): offered and constrained
    # like every tool (its pointers rebased under the turn's schema), no tool left out
    assert "not offered" not in result.output
    start = read_trace(trace)[0]
    assert "box_area" in {t["name"] for t in start["tools"]}


def test_server_spec_parsing():
    assert ServerSpec.parse("http://127.0.0.1:9/mcp").url == "http://127.0.0.1:9/mcp"
    spec = ServerSpec.parse(f"{sys.executable} '{SERVER}' --flag")
    assert (spec.command, spec.args, spec.label) == (sys.executable, [str(SERVER), "--flag"], "mcp_server")


def test_message_lines_bound_each_message_whatever_the_chunks():
    """MessageLines (the stdio reader): the same messages whatever the chunking; a line over the limit is
    dropped and answered as an error to the request it answered (the next message parses as usual)."""
    from hypothesis import given, settings, strategies as st

    from hybridlm.tools.mcp import MessageLines, _TOO_LARGE

    big = json.dumps({"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "x" * 5000}]}})
    small = json.dumps({"jsonrpc": "2.0", "id": 8, "result": {"content": [{"type": "text", "text": "42"}]}})
    stream = (big + "\n\n" + small + "\n").encode()

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(1, len(stream)), max_size=12))
    def check(cuts):
        lines, out, at = MessageLines(4096), [], 0
        for cut in sorted(cuts) + [len(stream)]:
            out += lines.feed(stream[at:cut])
            at = max(at, cut)
        assert len(out) == 2 and lines.size == 0
        dropped, answered = (m.message for m in out)
        assert dropped.id == 7 and dropped.error.code == _TOO_LARGE and "4,096 bytes" in dropped.error.message
        assert answered.id == 8 and answered.result["content"][0]["text"] == "42"

    check()
