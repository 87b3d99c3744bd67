"""The cheap bounds of a request body, and a reader that checks a big body in a process of its own.

A JSON object of a few MB can hold a million small values; reading it takes Python's JSON reader a
large fraction of a second, during which it holds the interpreter lock and every other request, the
event loop's `/health` included, waits. The bounds below (counts of messages, calls, tools, `logit_bias`
entries, and of JSON values in all) make the work of an accepted body small; a body too big to read
quickly in the server is first read here, in a child process, which answers with the first bound it
breaks or with "within bounds", and only then does the server read it itself.

This module imports nothing but the standard library, so the child is a bare interpreter running this
file (`python -I bounds.py`), and the server's own checks (`hybridlm.server.wire`) call the same
`check_counts`: one implementation of each bound.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

MAX_MESSAGES = 2048  # messages of one conversation (OpenAI's limit)
MAX_TOOLS = 128  # tools offered by one request (OpenAI's limit)
MAX_CALLS = 128  # tool calls of one assistant message
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
# JSON values (objects, arrays, strings, numbers...) of one body: 2048 messages with tool calls and 128
# tools with their schemas stay far below it; reading this many takes the server tens of milliseconds.
MAX_VALUES = 100_000
SCREEN_BYTES = 256 * 1024  # bodies from this size on are read in the child first


class OutOfBounds(Exception):
    """A body past one of the bounds: `message` says which and by how much, `param` where."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def check_counts(data: dict) -> None:
    """The cheap bounds, on the JSON object before it is validated (validation walks the whole of it): a body of
    85,000 tool calls or 10,000 messages is refused after a count, not after seconds of work."""
    messages, tools, bias = data.get("messages"), data.get("tools"), data.get("logit_bias")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise OutOfBounds(f"{len(messages):,} messages: at most {MAX_MESSAGES}", "messages")
        calls = 0
        for i, m in enumerate(messages):
            listed = m.get("tool_calls") if isinstance(m, dict) else None
            if isinstance(listed, list):
                if len(listed) > MAX_CALLS:
                    raise OutOfBounds(f"messages[{i}] has {len(listed):,} tool calls: at most {MAX_CALLS}",
                                      f"messages[{i}].tool_calls")
                calls += len(listed)
        if calls > MAX_MESSAGES:  # (each call is answered by a message of its own)
            raise OutOfBounds(f"{calls:,} tool calls in the conversation: at most {MAX_MESSAGES}", "messages")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise OutOfBounds(f"{len(tools):,} tools: at most {MAX_TOOLS}", "tools")
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise OutOfBounds(f"logit_bias has {len(bias):,} entries: at most {MAX_LOGIT_BIAS}", "logit_bias")
    values = count_values(data, MAX_VALUES + 1)
    if values > MAX_VALUES:
        raise OutOfBounds(f"the request body holds more than {MAX_VALUES:,} JSON values (objects, arrays, strings, "
                          "numbers): too many to be a request")


def count_values(data, limit: int) -> int:
    """The JSON values in `data` (itself included), counted up to `limit`."""
    seen, stack = 0, [data]
    while stack and seen < limit:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            seen += len(node)  # (the keys)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return min(seen, limit)


def verdict(raw: bytes) -> dict:
    """What the child answers about one body: {"ok": true}, {"bound": message, "param": ...},
    {"not_json": detail} or {"too_deep": true}."""
    try:
        data = json.loads(raw)
    except RecursionError:
        return {"too_deep": True}
    except (ValueError, UnicodeDecodeError) as exc:
        return {"not_json": str(exc)[:120]}
    if isinstance(data, dict):
        try:
            check_counts({k: v for k, v in data.items() if v is not None})
        except OutOfBounds as exc:
            return {"bound": exc.message, "param": exc.param}
        except RecursionError:
            return {"too_deep": True}
    return {"ok": True}


class Screen:
    """The child that reads big bodies first. One body at a time (a lock); started on first use, and
    started again if it died. The child ends when the server does (its standard input closes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.child: subprocess.Popen | None = None

    def check(self, raw: bytes) -> dict:
        """The child's verdict on `raw` (a call that blocks on pipes, not on the interpreter lock: run it
        in a worker thread)."""
        with self.lock:
            for _attempt in (1, 2):
                child = self._child()
                try:
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write(struct.pack("<Q", len(raw)) + raw)
                    child.stdin.flush()
                    line = child.stdout.readline()
                    if line:
                        return json.loads(line)
                except (OSError, ValueError):
                    pass
                self.close()  # (it died, perhaps of the body: one more try with a fresh one)
            return {"ok": True}  # (no verdict: the server reads the body itself, as it does small ones)

    def _child(self) -> subprocess.Popen:
        if self.child is None or self.child.poll() is not None:
            self.child = subprocess.Popen([sys.executable, "-I", str(Path(__file__).resolve())],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self.child

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            self.child = None


def main() -> None:
    """The child: length-prefixed bodies on standard input, one line of verdict each on standard output."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        (size,) = struct.unpack("<Q", head)
        stdout.write(json.dumps(verdict(stdin.read(size))).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()
