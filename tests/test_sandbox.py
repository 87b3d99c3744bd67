"""Tools in the external mode run where they can be stopped: a worker process per call, with limits
on memory and CPU time, killed at its timeout whatever it is doing; every failure, rendering
included, is a named error observation.

Times are compared with the tool's own timeout and with a reference measured in the same test
(a trivial call through the same worker process, i.e. what forking costs on this machine now):
a stopped call must come back within 1.5x its timeout, beyond that reference.
"""

import ctypes
import json
import os
import threading
import time

import pytest

from hybridlm.tools import (Tool, ToolRegistry, evaluate_arithmetic, lookup_tool, registry,
                                  tool)
from hybridlm.errors import InputError

TIMEOUT = 2.0


def reg_of(*tools, **kw) -> ToolRegistry:
    reg = ToolRegistry(**kw)
    for t in tools:
        reg.register(t)
    return reg


@tool(timeout_s=TIMEOUT)
def busy_in_c(n: int) -> str:
    """Holds the interpreter lock inside one C call (a huge integer power)."""
    return str(len(str(7 ** n)))


@tool(timeout_s=TIMEOUT)
def sleeps(seconds: float) -> str:
    """Sleeps in C (nanosleep via ctypes), not in Python's time.sleep."""
    ctypes.CDLL(None).sleep(int(seconds))
    return "woke"


@tool(timeout_s=TIMEOUT)
def allocates(mb: int) -> str:
    """Allocates without bound."""
    chunks = []
    while True:
        chunks.append(bytearray(mb << 20))


@tool(timeout_s=TIMEOUT)
def spins() -> str:
    """A pure-Python busy loop."""
    while True:
        pass


def stopped_within(reg, name, arguments, kinds):
    reg.register(Tool("trivial", "Nothing.", {"type": "object"}, lambda: "ok"))
    t0 = time.perf_counter()
    reg.call("trivial", {})
    reference = time.perf_counter() - t0
    t0 = time.perf_counter()
    obs = reg.call(name, arguments)
    elapsed = time.perf_counter() - t0
    assert obs.error in kinds, obs
    assert elapsed - reference <= 1.5 * TIMEOUT, (f"{name} came back after {elapsed:.2f} s, timeout {TIMEOUT} s, "
                                                  f"a trivial call {reference:.2f} s")
    assert "\n" not in obs.text
    return obs, elapsed


@pytest.mark.parametrize("name, arguments, kinds", [
    ("busy_in_c", {"n": 10**9}, {"timeout"}),
    ("sleeps", {"seconds": 60}, {"timeout"}),
    ("allocates", {"mb": 64}, {"memory", "timeout"}),
    ("spins", {}, {"timeout"}),
])
def test_hanging_tools_are_stopped_and_the_run_continues(name, arguments, kinds):
    reg = reg_of(busy_in_c, sleeps, allocates, spins, registry(["calculator"]).tools["calculator"])
    obs, elapsed = stopped_within(reg, name, arguments, kinds)
    print(f"{name}: {obs.error} after {elapsed:.3f} s (timeout {TIMEOUT} s)")
    after = reg.call("calculator", {"expression": "6 * 7"})
    assert (after.text, after.error) == ("42", None)
    assert threading.active_count() < 20


def test_no_child_is_left_behind():
    import psutil

    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    reg = reg_of(sleeps, spins)
    for _ in range(3):
        reg.call("sleeps", {"seconds": 60})
        reg.call("spins", {})
    assert {c.pid for c in me.children(recursive=True)} == before


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for you")

    __repr__ = __str__


def deep_list(depth):
    out = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("runs_in", ["process", "thread"])
@pytest.mark.parametrize("value", [Unprintable(), {(1, 2): "tuple key"}, deep_list(100_000), {"x": Unprintable()}],
                         ids=["__str__ raises", "tuple keys", "100000 deep", "nested unprintable"])
def test_unrenderable_results_are_error_observations(value, runs_in):
    t = Tool("give", "Return a value.", {"type": "object", "properties": {}}, lambda: value, runs_in=runs_in)
    obs = reg_of(t).call("give", {})
    assert obs.error == "unrenderable" and obs.text.startswith("error:") and "\n" not in obs.text


@pytest.mark.parametrize("runs_in", ["process", "thread"])
@pytest.mark.parametrize("exc", [SystemExit(3), SystemExit(), KeyboardInterrupt(), GeneratorExit()])
def test_base_exceptions_are_errors_not_null(exc, runs_in):
    def raises():
        raise exc

    t = Tool("quit", "Quit.", {"type": "object", "properties": {}}, raises, runs_in=runs_in)
    obs = reg_of(t).call("quit", {})
    assert obs.error == "exception" and type(exc).__name__ in obs.text and obs.text != "null"


def test_closures_and_script_tools_run_in_the_worker():
    secret = {"value": 41}

    def add_secret(x: int) -> str:
        """Adds a captured value."""
        return str(x + secret["value"])

    reg = reg_of(tool(add_secret))
    assert reg.call("add_secret", {"x": 1}).text == "42"
    secret["value"] = 99  # the worker sees the state at the time of the call
    assert reg.call("add_secret", {"x": 1}).text == "100"


def test_process_tools_run_in_another_process_thread_tools_here():
    pid = Tool("pid", "PID.", {"type": "object", "properties": {}}, os.getpid)
    here = Tool("here", "PID.", {"type": "object", "properties": {}}, os.getpid, runs_in="thread")
    reg = reg_of(pid, here)
    assert int(reg.call("pid", {}).text) != os.getpid()
    assert int(reg.call("here", {}).text) == os.getpid()


def test_output_cap_and_kinds():
    @tool
    def flood(n: int) -> str:
        """Return a lot."""
        return "x" * n

    reg = reg_of(flood, max_output_chars=100)
    obs = reg.call("flood", {"n": 10**7})
    assert obs.error == "too_large" and len(obs.text) < 300
    assert reg.call("nope", {}).error == "unknown_tool"
    assert reg.call("flood", {"n": "many"}).error == "invalid_arguments"
    assert reg.call("flood", [1, 2]).error == "invalid_arguments"


def test_tool_fields_are_checked():
    with pytest.raises(InputError, match="runs_in"):
        Tool("a", "b", {"type": "object"}, print, runs_in="cloud")
    with pytest.raises(InputError, match="timeout"):
        Tool("a", "b", {"type": "object"}, print, timeout_s=float("nan"))


# ====================================================================== the calculator
@pytest.mark.parametrize("expression", [
    "(10**4000)**10000", "(10**4000)**(10**4)", "((2**9999)**2)**2", "9**9**9", "10**4000 * 10**4000 * 10**4000",
    "(-8) ** 0.5", "1e308 * 10", "1e308 * 10 - 1e308 * 10", "sqrt(-1)", "10**4000 / 1", "round(1e308 * 10)", "sqrt(10**4000)",
    "1 / 0", "min()", "0 ** -1", "-" * 100_000 + "1", "(" * 10_000 + "1" + ")" * 10_000, "1" + "+1" * 100_000,
    "9" * 5000, "1e999",
])
def test_calculator_refuses_at_once(expression):
    t0 = time.perf_counter()
    reference = time.perf_counter()
    evaluate_arithmetic("123456 * 789")
    one_call = time.perf_counter() - reference
    with pytest.raises(ValueError):
        evaluate_arithmetic(expression)
    assert time.perf_counter() - t0 < max(1.0, 1000 * one_call)


def test_calculator_through_the_registry_is_refused_not_timed_out():
    obs = registry(["calculator"]).call("calculator", {"expression": "(10**4000)**10000"})
    assert obs.error == "exception" and "too large" in obs.text
    assert obs.duration_s < registry(["calculator"]).tools["calculator"].timeout_s


def test_calculator_returns_finite_reals_only():
    assert evaluate_arithmetic("2 ** 0.5") == pytest.approx(2 ** 0.5)
    assert evaluate_arithmetic("2 ** 100") == 2 ** 100
    assert evaluate_arithmetic("-2 ** 2") == -4
    assert evaluate_arithmetic("7 / 2") == 3.5


# ====================================================================== the knowledge base
def test_kb_null_value_is_null_not_missing(tmp_path):
    kb = tmp_path / "kb.json"
    kb.write_text(json.dumps({"nothing": None, "zero": 0, "empty": ""}))
    reg = registry(["lookup"], kb=kb)
    assert reg.call("lookup", {"key": "nothing"}) .text == "null"
    assert reg.call("lookup", {"key": "zero"}).text == "0"
    assert reg.call("lookup", {"key": "empty"}).text == ""
    # the key's schema is the enum of the file's keys, so a key it lacks is an invalid argument
    absent = reg.call("lookup", {"key": "absent"})
    assert absent.error == "invalid_arguments" and "absent" in absent.text


@pytest.mark.parametrize("text, fragment", [
    ("[" * 100_000 + "]" * 100_000, "deep"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "deep"),
    ('{"a": ' + "[" * 200 + "]" * 200 + "}", "deep"),
])
def test_kb_nesting_is_bounded(tmp_path, text, fragment):
    kb = tmp_path / "kb.json"
    kb.write_text(text)
    with pytest.raises(InputError, match=fragment) as info:
        lookup_tool(kb)
    assert "\n" not in str(info.value)


def test_kb_size_is_capped(tmp_path):
    from hybridlm.tools import builtins

    kb = tmp_path / "kb.json"
    kb.write_text(json.dumps({"k": "x" * (builtins.MAX_KB_BYTES + 10)}))
    with pytest.raises(InputError, match="bytes"):
        lookup_tool(kb)
    kb.write_bytes(b'{"k": "\xff"}')
    with pytest.raises(InputError, match="UTF-8"):
        lookup_tool(kb)
