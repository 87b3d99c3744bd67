"""Where a tool call runs: a forked worker process that can be stopped, or a thread here.

`in_process` forks the calling process for the one call (Linux: `os.fork`). The child
inherits everything the parent has at that moment (closures, tools defined in a script,
their captured state), so nothing is pickled; it puts itself in its own process group,
takes limits on address space (RLIMIT_AS: what it inherited plus the tool's budget) and
CPU time (RLIMIT_CPU: the timeout, rounded up, plus one second), runs the tool and renders
its result to text inside the same guard, and writes [text, error kind] as JSON to a pipe.
The parent waits for that line until the timeout, then kills the whole process group
(SIGKILL: whatever the tool is doing, a C call holding the interpreter lock, a sleep, an
allocation loop, a subprocess it started) and reaps the child, so no call leaves a process
behind. The child dies with the thread that forked it (PR_SET_PDEATHSIG) should the parent
be killed first.

Why a fork per call rather than a pool of pre-forked workers: a pool forked early does not
have the tools, closures and state created after it, and sending them would mean pickling
closures; a fork per call has them all and costs about a millisecond or two (page tables
are copied, pages only when written; the child freezes the collector so that it does not
walk, and so copy, the parent's heap). The figures are in docs/robustness.md.

A tool that uses PyTorch or another OpenMP library after the parent has used it can hang in
a forked child (the thread pool does not survive fork); such tools, and those that talk to
a live object of this process (an MCP session, a plant), say `runs_in="thread"`: they run
in a daemon thread here and enforce their own timeout (a thread cannot be killed: past the
timeout it is abandoned and the call reports a timeout).
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

Outcome = tuple[str, str | None]  # (observation text, error kind or None)

#: error kinds an observation can carry
KINDS = ("unknown_tool", "invalid_arguments", "exception", "timeout", "memory", "crashed", "unrenderable",
         "too_large")
CAN_FORK = hasattr(os, "fork")
_PR_SET_PDEATHSIG = 1


def one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " …"


def describe(exc: BaseException) -> str:
    """`Type: message`, even for an exception whose __str__ raises."""
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - the message itself is hostile
        message = "(its message cannot be rendered)"
    return one_line(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def render(value: Any) -> str:
    """The observation text of a tool's return value: a string as is, anything else as JSON."""
    if isinstance(value, str):
        return str.__str__(value)
    return json.dumps(value, default=str, ensure_ascii=False)


def outcome(name: str, fn: Callable[..., Any], arguments: dict, max_chars: int) -> Outcome:
    """Run the tool and render its result; every failure, BaseException included, is an error kind."""
    try:
        value = fn(**arguments)
    except MemoryError:
        return f"error: {name} ran out of memory", "memory"
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from a tool are its errors
        return f"error: {name} raised {describe(exc)}", "exception"
    if isinstance(getattr(value, "text", None), str) and hasattr(value, "error"):  # an Observation of its own
        if value.error:
            return value.text, value.error  # (a thread tool that names its failures: MCP, plants)
        value = value.text
    try:
        text = render(value)
    except BaseException as exc:  # noqa: BLE001 - __str__ raising, tuple keys, nesting past the recursion limit
        return f"error: the result of {name} cannot be rendered as text ({describe(exc)})", "unrenderable"
    if len(text) > max_chars:
        return (text[:max_chars] + f" … [error: output of {len(text)} characters cut to {max_chars}]",
                "too_large")
    return text, None


# ====================================================================== a worker process
def in_process(name: str, fn: Callable[..., Any], arguments: dict, *, timeout_s: float, memory_mb: float,
               max_chars: int) -> Outcome:
    """The call in a forked child, killed at `timeout_s` (see the module text)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # or the child would print the parent's buffered text again
        except Exception:  # noqa: BLE001 - a closed stream is no reason not to call the tool
            pass
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read_end)
            _child_setup(parent, memory_mb, timeout_s)
            payload = json.dumps(outcome(name, fn, arguments, max_chars), ensure_ascii=False).encode()
            view = memoryview(payload)
            while view:
                view = view[os.write(write_end, view):]
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)  # also from here, so that a kill right after fork reaches the group
    except OSError:
        pass
    deadline = time.monotonic() + timeout_s
    data, finished = _read_until(read_end, deadline, limit=8 * max_chars + 4096)
    status = _reap(pid, deadline if finished else time.monotonic())
    if not finished:
        return f"error: {name} did not finish within {timeout_s:g} s; it was stopped", "timeout"
    return _decode(name, data, status, memory_mb)


def _child_setup(parent: int, memory_mb: float, timeout_s: float) -> None:
    gc.freeze()  # the parent's objects are never collected here: no walk over (and copy of) its heap
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's timeout still kills the child
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    cpu = math.ceil(timeout_s) + 1
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    inherited = _address_space_bytes()
    if inherited is not None:
        budget = inherited + int(memory_mb * 2**20)
        _limit(resource.RLIMIT_AS, budget, budget)


def _limit(which: int, soft: int, hard: int) -> None:
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass


def _address_space_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _read_until(fd: int, deadline: float, *, limit: int) -> tuple[bytes, bool]:
    """Bytes from the pipe until EOF (True) or the deadline (False); at most `limit` kept."""
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", False
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks), True
            if total < limit:
                chunks.append(chunk[: limit - total])
            total += len(chunk)
    finally:
        os.close(fd)


def _reap(pid: int, deadline: float) -> int:
    """The child's wait status; past the deadline its process group is killed first."""
    pause = 0.0005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # anything the tool left running in its group goes with it
            return status
        if time.monotonic() >= deadline:
            _kill_group(pid)
            return os.waitpid(pid, 0)[1]
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _decode(name: str, data: bytes, status: int, memory_mb: float) -> Outcome:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"error: {name} used up its CPU time", "timeout"
        return f"error: {name} crashed (signal {signal.Signals(sig).name})", "crashed"
    try:
        text, kind = json.loads(data.decode("utf-8"))
        if not isinstance(text, str) or kind not in (None, *KINDS):
            raise ValueError
    except (ValueError, TypeError, UnicodeDecodeError):
        return f"error: {name} ended (exit status {os.waitstatus_to_exitcode(status)}) without a result", "crashed"
    if kind == "memory":
        text = f"{text} (its limit: {memory_mb:g} MB beyond this process's size)"
    return text, kind


# ====================================================================== a thread here
def in_thread(name: str, fn: Callable[..., Any], arguments: dict, *, timeout_s: float, max_chars: int) -> Outcome:
    """The call in a daemon thread of this process; past the timeout it is abandoned, not stopped."""
    result: list[Outcome] = []
    worker = threading.Thread(target=lambda: result.append(outcome(name, fn, arguments, max_chars)),
                              name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive() or not result:
        return f"error: {name} did not finish within {timeout_s:g} s", "timeout"
    return result[0]
