"""Model Context Protocol tool servers in the external mode q_E.

An MCP server offers tools with JSON schemas; each becomes a `Tool` of the registry
(runs_in="thread", server=<the server's name>), so a call is a jump like any other and
the trace names the server. Servers are reached over stdio (a command we start and stop)
or streamable HTTP (a URL); the specification of a server is one string:

    "python server.py --flag"          stdio: the command and its arguments (shell-split)
    "http://127.0.0.1:8000/mcp"        streamable HTTP

The `mcp` client is asyncio; `ToolRegistry.call` is blocking and runs each call in a
worker thread. `MCPServers` owns one event loop on a background thread: every session
lives in one task of that loop (entered and left in the same task, as anyio's cancel
scopes require), and a call from any thread is a coroutine submitted to the loop and
waited for with a timeout. Every failure is an error observation, named:

    tool_error            the server ran the tool and reported `isError`
    timeout               no result within the timeout (the request is cancelled)
    server_disconnected   the server exited, was killed or closed the connection
    server_error          the server answered the request with a protocol error
    too_large             the result exceeds the registry's output cap, or (stdio) one message
                          from the server exceeds `max_message_bytes`: it is dropped as it arrives,
                          never held whole, and the session goes on

A structured result (`structuredContent`) is injected as its JSON text, otherwise the
text of the content blocks. `close()` leaves the sessions, which closes the stdio
servers' input and ends their processes, then stops the loop and joins its thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hybridlm.tools.registry import Observation, Tool, ToolRegistry
from hybridlm.errors import InputError

DEFAULT_TIMEOUT_S = 30.0  # a tool call
CONNECT_TIMEOUT_S = 30.0  # starting a server, the handshake and listing its tools
_GRACE_S = 2.0  # the registry's own guard waits this much longer than our timeout
MAX_BACKOFF_S = 30.0  # the longest wait between reconnection attempts to a broken server
MAX_MESSAGE_BYTES = 4 * 2**20  # one JSON-RPC message from a stdio server (a bigger one is dropped as it streams)
_TOO_LARGE = -32090  # the error code of the answer that stands in for a dropped message (JSON-RPC's server range)
# A stdio server is started through this: the kernel sends it SIGTERM when the thread that started it
# (ours) dies, however this process ends (a kill -9 included); execvp keeps the request (Linux only).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
                    "os.execvp(sys.argv[1], sys.argv[1:])")


@dataclass
class ServerSpec:
    """One `--mcp` value: a stdio command or a streamable-HTTP URL."""

    text: str
    url: str | None = None
    command: str | None = None
    args: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> "ServerSpec":
        if not isinstance(text, str) or not text.strip():
            raise InputError("--mcp: empty server; expected a command (\"python server.py\") or an http(s) URL")
        text = text.strip()
        if text.startswith(("http://", "https://")):
            parts = urlsplit(text)
            if not parts.hostname:
                raise InputError(f"--mcp {text!r}: the URL has no host; expected e.g. http://127.0.0.1:8000/mcp")
            return cls(text, url=text)
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise InputError(f"--mcp {text!r}: cannot split the command ({exc})") from None
        if shutil.which(words[0]) is None:
            raise InputError(f"--mcp {text!r}: command {words[0]!r} not found")
        return cls(text, command=words[0], args=words[1:])

    @property
    def label(self) -> str:
        """A name for the server before it names itself."""
        if self.url:
            parts = urlsplit(self.url)
            return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
        script = next((a for a in self.args if not a.startswith("-")), None)
        return Path(script or self.command or self.text).stem


@dataclass
class _Connection:
    spec: ServerSpec
    name: str = ""
    client: Any = None
    listed: list = field(default_factory=list)
    stop: asyncio.Event | None = None
    holder: concurrent.futures.Future | None = None
    task: asyncio.Task | None = None  # the holder's task on the loop
    errlog: Any = None  # the stdio server's stderr, kept to say why it died
    dead: str | None = None  # why calls can no longer reach it (until a reconnection succeeds)
    retry_at: float = 0.0  # monotonic time of the next reconnection attempt
    backoff_s: float = 0.0  # the wait after the last failed attempt (doubling, at most MAX_BACKOFF_S)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stderr_tail(self, chars: int = 300) -> str:
        if self.errlog is None:
            return ""
        try:
            self.errlog.flush()
            self.errlog.seek(0)
            text = self.errlog.read()
        except (OSError, ValueError):
            return ""
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return lines[-1][-chars:] if lines else ""


class MCPServers:
    """Sessions with MCP servers on a background event loop, and their tools as `Tool`s."""

    def __init__(self, specs: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        check_timeout(timeout_s, "MCP timeout")
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.max_message_bytes = int(max_message_bytes)
        self.connections = [_Connection(ServerSpec.parse(s)) for s in specs]
        self.tools: list[Tool] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-loop", daemon=True)
        self._thread.start()
        try:
            for conn in self.connections:
                self._connect(conn)
            self._build_tools()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ sessions
    def _connect(self, conn: _Connection) -> None:
        ready: concurrent.futures.Future = concurrent.futures.Future()
        conn.holder = asyncio.run_coroutine_threadsafe(self._hold(conn, ready), self._loop)
        try:
            ready.result(self.connect_timeout_s)
        except concurrent.futures.TimeoutError:
            raise InputError(f"MCP server {conn.spec.text!r}: no handshake within {self.connect_timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 - any failure to start is one line for the user
            tail = conn.stderr_tail()
            raise InputError(f"MCP server {conn.spec.text!r}: cannot connect ({_reason(exc)})"
                             + (f"; its stderr: {tail}" if tail else "")) from None

    async def _hold(self, conn: _Connection, ready: concurrent.futures.Future) -> None:
        """The task that owns one session from connection to close."""
        from mcp import Client

        conn.stop = asyncio.Event()
        conn.task = me = asyncio.current_task()
        try:
            async with Client(self._transport(conn), read_timeout_seconds=self.connect_timeout_s) as client:
                conn.client = client
                info = client.server_info
                conn.name = (info.name if info is not None and info.name else "") or conn.spec.label
                cursor = None
                while True:  # every page of the listing
                    page = await client.list_tools(cursor=cursor)
                    conn.listed.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
                ready.set_result(None)
                await conn.stop.wait()
        except BaseException as exc:
            if conn.task is me:  # (a session replaced by a reconnection says nothing of the new one)
                conn.dead = conn.dead or f"the session ended ({_reason(exc)})"
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if conn.task is me:
                conn.dead = conn.dead or "the session was closed"

    def _transport(self, conn: _Connection):
        from mcp.client.streamable_http import streamable_http_client

        if conn.spec.url:
            return streamable_http_client(conn.spec.url)
        conn.errlog = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        # the server gets the user's environment, as a command run from the shell does (the SDK's
        # default passes only HOME, PATH and a few others: tokens, PYTHONPATH, a venv were lost)
        command, args = str(conn.spec.command), list(conn.spec.args)
        if sys.platform.startswith("linux"):
            command, args = sys.executable, ["-c", _DIE_WITH_PARENT, command, *args]
        return bounded_stdio(command, args, env=dict(os.environ), errlog=conn.errlog, max_bytes=self.max_message_bytes)

    # ------------------------------------------------------------------ tools
    def _build_tools(self) -> None:
        counts = collections.Counter(c.name for c in self.connections)
        for i, conn in enumerate(self.connections):  # two servers of one name: number them
            if counts[conn.name] > 1:
                conn.name = f"{conn.name}#{i + 1}"
        taken: set[str] = set()
        for conn in self.connections:
            for listed in conn.listed:
                name = listed.name if listed.name not in taken else f"{conn.name}.{listed.name}"
                taken.add(name)
                schema = dict(listed.input_schema or {"type": "object"})
                schema.setdefault("type", "object")
                self.tools.append(Tool(
                    name=name, description=_description(listed.description),
                    parameters=schema, fn=self._caller(conn, listed.name),
                    timeout_s=self.timeout_s + _GRACE_S, runs_in="thread", server=conn.name))

    def _caller(self, conn: _Connection, remote_name: str):
        def call(**arguments) -> Observation:
            return self.call(conn, remote_name, arguments)

        return call

    def call(self, conn: _Connection, name: str, arguments: dict) -> Observation:
        """One tools/call on the loop, waited for from this (worker) thread."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        where = f"{conn.name}/{name}"
        # (a session being reset in the background has no client yet: _revive waits for it under the lock)
        if (conn.dead or conn.client is None) and (not self._revive(conn) or conn.client is None):
            why = conn.dead or "reconnecting"
            return Observation(f"error: MCP server {conn.name} cannot be reached ({why})", "server_disconnected")
        future = asyncio.run_coroutine_threadsafe(
            conn.client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s), self._loop)
        try:
            result = future.result(self.timeout_s + _GRACE_S / 2)
        except concurrent.futures.TimeoutError:
            future.cancel()  # (the SDK cancels the request; the session goes on)
            return _timeout(where, self.timeout_s)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                return _timeout(where, self.timeout_s)
            if exc.code == CONNECTION_CLOSED:
                return self._disconnected(conn, where, exc)
            if exc.code == _TOO_LARGE:
                return Observation(f"error: {where}: {exc.message}", "too_large")
            return Observation(f"error: {where}: the server answered with error {exc.code}: {exc.message}",
                               "server_error")
        except Exception as exc:  # noqa: BLE001 - a broken transport (HTTP refused, reset, ...)
            return self._disconnected(conn, where, exc)
        return observation_of(result, where)

    def _disconnected(self, conn: _Connection, where: str, exc: BaseException) -> Observation:
        tail = conn.stderr_tail()
        why = f"disconnected during a call to {where} ({_reason(exc)})" + (f"; its stderr: {tail}" if tail else "")
        conn.dead = why  # (read back from `why`: the reconnection below may clear it at once)
        # reconnected in the background at once (a later call finds the new session, or waits for it)
        threading.Thread(target=self._revive, args=(conn,), name="mcp-reconnect", daemon=True).start()
        return Observation(f"error: MCP server {conn.name} {why}", "server_disconnected")

    def _revive(self, conn: _Connection) -> bool:
        """A broken session reset and connected anew (the process restarted for stdio), at most once per
        backoff interval (1 s, doubling to MAX_BACKOFF_S after each failure). True when it is back."""
        with conn.lock:
            if not conn.dead:
                return True
            if time.monotonic() < conn.retry_at or self._loop.is_closed():
                return False
            self._leave(conn, wait_s=5.0)
            name, why = conn.name, conn.dead
            conn.listed, conn.client, conn.dead, conn.stop, conn.task = [], None, None, None, None
            try:
                self._connect(conn)
            except InputError as exc:
                conn.backoff_s = min(MAX_BACKOFF_S, 2 * conn.backoff_s or 1.0)
                conn.retry_at = time.monotonic() + conn.backoff_s
                conn.dead = f"{why}; reconnecting failed ({exc}), next attempt in {conn.backoff_s:g} s"
                conn.name = name
                return False
            conn.name, conn.backoff_s = name, 0.0
            return True

    def _leave(self, conn: _Connection, wait_s: float) -> None:
        """End a session's task: asked to stop, cancelled if it does not within wait_s (a session stuck
        reading a huge message)."""
        if conn.stop is not None:
            self._loop.call_soon_threadsafe(conn.stop.set)
        if conn.holder is not None:
            try:
                conn.holder.result(wait_s)
            except concurrent.futures.TimeoutError:
                if conn.task is not None:
                    self._loop.call_soon_threadsafe(conn.task.cancel)
                with contextlib.suppress(BaseException):
                    conn.holder.result(wait_s)
            except BaseException:  # noqa: BLE001 - the old session's end is no concern of the new one
                pass
        if conn.errlog is not None:
            with contextlib.suppress(OSError):
                conn.errlog.close()
            conn.errlog = None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Leave every session (stdio servers exit or are terminated), stop the loop, join its thread."""
        if self._loop.is_closed():
            return
        for conn in self.connections:
            if conn.stop is not None:
                self._loop.call_soon_threadsafe(conn.stop.set)
        for conn in self.connections:
            if conn.holder is not None and conn.client is not None:
                with contextlib.suppress(BaseException):
                    conn.holder.result(10.0)  # stdio shutdown: stdin closed, 2 s grace, then terminate/kill
        stuck = [c.task for c in self.connections
                 if c.task is not None and c.holder is not None and not c.holder.done()]
        if stuck:  # (a server that never finished its handshake): cancelled, and its shutdown awaited
            with contextlib.suppress(BaseException):
                asyncio.run_coroutine_threadsafe(_cancel(stuck), self._loop).result(15.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()
        for conn in self.connections:
            if conn.errlog is not None:
                conn.errlog.close()

    def __enter__(self) -> "MCPServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------- stdio, one message at most so many bytes
class MessageLines:
    """Newline-delimited JSON-RPC messages cut from a byte stream, each at most `max_bytes`: the bytes of a
    longer line are dropped as they arrive (never joined), and its end yields an error answer to the request
    it answered (its id read from the line's head), so the call fails at once and the session goes on."""

    HEAD = 4096  # bytes of a dropped line kept to find its id

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.parts: list[bytes] = []
        self.size = 0
        self.dropped: bytes | None = None  # the head of the line being dropped

    def feed(self, chunk: bytes) -> list:
        """The messages (SessionMessage) and parse errors (Exception) that `chunk` completes."""
        out: list = []
        while chunk:
            cut = chunk.find(b"\n")
            piece, chunk = (chunk, b"") if cut < 0 else (chunk[:cut], chunk[cut + 1:])
            if self.dropped is None:
                self.parts.append(piece)
                self.size += len(piece)
                if self.size > self.max_bytes:
                    self.dropped = b"".join(self.parts)[: self.HEAD]
                    self.parts, self.size = [], 0
            if cut < 0:
                continue
            if self.dropped is not None:
                out.append(self._refusal(self.dropped))
                self.dropped = None
            else:
                line = b"".join(self.parts)
                self.parts, self.size = [], 0
                if line.strip():
                    out.append(_message(line))
        return out

    def _refusal(self, head: bytes):
        import re

        from mcp.shared.message import SessionMessage
        from mcp_types import jsonrpc_message_adapter

        ends = [i for i in (head.find(b'"result"'), head.find(b'"error"')) if i >= 0]
        found = re.search(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")', head[: min(ends, default=len(head))])
        why = f"the server's answer is over the limit of {self.max_bytes:,} bytes for one message (it was dropped)"
        if found is None:  # (not an answer we can name: the call it answered runs into its timeout)
            return ValueError(why)
        answer = {"jsonrpc": "2.0", "id": json.loads(found.group(1)), "error": {"code": _TOO_LARGE, "message": why}}
        return SessionMessage(jsonrpc_message_adapter.validate_python(answer, by_name=False))


def _message(line: bytes):
    from mcp.shared.message import SessionMessage
    from mcp_types import jsonrpc_message_adapter

    try:
        return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


@contextlib.asynccontextmanager
async def bounded_stdio(command: str, args: list[str], *, env: dict[str, str], errlog, max_bytes: int):
    """The stdio transport of an MCP server (a process in its own process group, newline-delimited JSON-RPC
    on its stdin and stdout), reading each message with a byte limit (`MessageLines`); the SDK's reader
    joins a line's chunks as they come, so a 100 MB answer held the session for minutes. Shutdown as the
    protocol asks: stdin closed, a grace period, then the process group terminated."""
    import anyio
    from mcp.os.posix.utilities import terminate_posix_process_tree

    process = await anyio.open_process([command, *args], env=env, stderr=errlog, start_new_session=True)
    stdin, stdout = process.stdin, process.stdout
    assert stdin is not None and stdout is not None  # (opened with pipes)
    to_session, from_server = anyio.create_memory_object_stream[Any](0)  # messages and parse errors
    to_server, from_session = anyio.create_memory_object_stream[Any](0)
    closed = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)

    async def read() -> None:
        lines = MessageLines(max_bytes)
        async with to_session:
            with contextlib.suppress(*closed):
                async for chunk in stdout:
                    for item in lines.feed(chunk):
                        await to_session.send(item)

    async def write() -> None:
        try:
            async with from_session:
                async for sent in from_session:
                    text = sent.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stdin.send((text + "\n").encode())
        except closed:
            await to_session.aclose()  # the session sees the connection end rather than waiting for ever

    async def stop() -> None:
        with contextlib.suppress(*closed):
            await stdin.aclose()
        with anyio.move_on_after(2.0):
            while process.returncode is None:
                await anyio.sleep(0.02)
        if process.returncode is None:
            await terminate_posix_process_tree(process, 2.0)
        with contextlib.suppress(*closed):
            await stdout.aclose()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(read)
        tasks.start_soon(write)
        try:
            yield from_server, to_server
        finally:
            with anyio.CancelScope(shield=True):
                await stop()
            tasks.cancel_scope.cancel()


def check_timeout(timeout_s: float, what: str) -> None:
    if not 0 < timeout_s < math.inf:
        raise InputError(f"{what} {timeout_s}: expected a positive, finite number of seconds")


MAX_DESCRIPTION = 1000  # characters of a tool's description shown to the model


def _description(text: str | None) -> str:
    """The whole description (a docstring's Args: block says what each parameter means), its
    lines' indentation removed, cut at MAX_DESCRIPTION characters."""
    text = "\n".join(line.strip() for line in (text or "").strip().splitlines())
    return text if len(text) <= MAX_DESCRIPTION else text[: MAX_DESCRIPTION - 1].rstrip() + "…"


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks and wait for them: the SDK's stdio shutdown (kill the server's process
    tree) runs shielded inside a cancelled task, but only while the loop still runs."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=12.0)


def observation_of(result, where: str) -> Observation:
    """y from a CallToolResult: structured content as JSON text, else the text of the blocks."""
    text = "\n".join(_block_text(b) for b in result.content)
    if result.is_error:
        return Observation(f"error: {where}: {text or 'the tool reported an error'}", "tool_error")
    if result.structured_content is not None:
        return Observation(json.dumps(result.structured_content, ensure_ascii=False))
    return Observation(text)


def _block_text(block) -> str:
    kind = getattr(block, "type", "")
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        return f"[{kind} {block.mime_type}, {len(block.data)} base64 characters]"
    if kind == "resource_link":
        return f"[resource {block.uri}]"
    if kind == "resource":
        res = block.resource
        return getattr(res, "text", None) or f"[resource {res.uri}, binary]"
    return f"[{kind or type(block).__name__} content]"


def _timeout(where: str, seconds: float) -> Observation:
    return Observation(f"error: {where} did not finish within {seconds:g} s (the request was cancelled)", "timeout")


def _reason(exc: BaseException) -> str:
    """The innermost message of an exception (anyio wraps transport failures in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def mcp_tools(specs: Sequence[str], *, into: ToolRegistry | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[ToolRegistry]:
    """A registry with the tools of the given MCP servers, open for the `with` block.

        with mcp_tools(["python server.py", "http://127.0.0.1:8000/mcp"]) as reg:
            HybridAgent(model, reg).run("...")
    """
    reg = into if into is not None else ToolRegistry()
    with MCPServers(specs, timeout_s=timeout_s) as servers:
        for t in servers.tools:
            if t.name in reg:  # a built-in's name: the server's tool is qualified by its server
                t = dataclasses.replace(t, name=f"{t.server}.{t.name}")
            if t.name in reg:
                raise InputError(f"MCP tool {t.name!r} of server {t.server} has the name of a tool already offered")
            reg.register(t)
        yield reg
