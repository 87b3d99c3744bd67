"""An MCP server for the tests, written with the `mcp` package's server API (MCPServer).

    python tests/mcp_server.py [--pid-file PATH]              stdio
    python tests/mcp_server.py --http PORT [--pid-file PATH]  streamable HTTP on 127.0.0.1:PORT/mcp

Tools: one that adds, one that always fails, one that hangs, one with a nested-object
schema, one that returns structured content, one that returns a huge text, one that
blocks until it is killed (writing its pid first to the --pid-file, so a test knows when to kill it),
and one that makes the process exit in the middle of the call.
"""

import argparse
import asyncio
import os
import sys

from pydantic import BaseModel

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("hybridlm-test")


class Point(BaseModel):
    x: float
    y: float


class Box(BaseModel):
    low: Point
    high: Point


class Summary(BaseModel):
    mean: float
    count: int


@server.tool(structured_output=False)
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return str(a + b)


@server.tool(structured_output=False)
def env(name: str) -> str:
    """The value of an environment variable in the server's process."""
    return os.environ.get(name, "<unset>")


@server.tool()
def fail(reason: str) -> str:
    """Always fails with the given reason."""
    raise ToolError(f"refused: {reason}")


@server.tool()
async def hang(seconds: float) -> str:
    """Sleep for the given number of seconds."""
    await asyncio.sleep(seconds)
    return "woke up"


@server.tool(structured_output=False)
def box_area(box: Box) -> str:
    """Area of an axis-aligned box given by its low and high corners."""
    return str((box.high.x - box.low.x) * (box.high.y - box.low.y))


@server.tool()
def summary(values: list[float]) -> Summary:
    """Mean and count of a list of numbers (structured result)."""
    return Summary(mean=sum(values) / len(values), count=len(values))


@server.tool(structured_output=False)
def flood(chars: int) -> str:
    """Return a text of the given length."""
    return "x" * chars


@server.tool(structured_output=False)
async def block() -> str:
    """Block until the server is killed."""
    path = ARGS.pid_file
    if path:
        with open(path + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    await asyncio.sleep(3600)
    return "unreachable"


@server.tool(structured_output=False)
def crash() -> str:
    """Exit the server process in the middle of the call."""
    sys.stderr.write("crash: exiting on request\n")
    sys.stderr.flush()
    os._exit(3)


@server.tool(structured_output=False)
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


parser = argparse.ArgumentParser()
parser.add_argument("--http", type=int, default=None, help="serve streamable HTTP on this port of 127.0.0.1")
parser.add_argument("--pid-file", default=None)
ARGS = parser.parse_args() if __name__ == "__main__" else parser.parse_args([])

if __name__ == "__main__":
    if ARGS.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=ARGS.http)
    else:
        server.run()
