"""Tools: what runs in the external mode q_E (docs/theory.md §4).

A tool is a typed Python function with a JSON schema for its arguments. `@tool` derives
the schema from the signature (str, int, float, bool parameters; those without a default
are required) and the description from the docstring. `ToolRegistry.call` validates the
arguments with `jsonschema`, runs the function where it can be stopped (`runs_in="process"`,
the default: a forked worker process with memory and CPU limits, killed at the timeout;
`runs_in="thread"`: a thread here, for tools that enforce their own timeout; see
`hybridlm.tools.sandbox`), renders the result to text inside the same guard, caps its size,
and turns every failure into an error observation of a named kind (unknown_tool,
invalid_arguments, exception, timeout, memory, crashed, unrenderable, too_large): the arc
never crashes on a tool.
"""

from __future__ import annotations

import inspect
import math
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import referencing
import referencing.exceptions

from hybridlm.tools import sandbox
from hybridlm.errors import InputError

RUNS_IN = ("process", "thread")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]
    timeout_s: float = 5.0
    # Where the call runs: "process" (a worker process, stopped at the timeout whatever it does)
    # or "thread" (in this process: tools that talk to a live object here, an MCP session or a
    # plant, and enforce their own timeout).
    runs_in: str = "process"
    server: str | None = None  # the tool server that offers it (an MCP server), for the trace
    memory_mb: float = 1024.0  # address space a process tool may add to what its worker inherits

    def __post_init__(self) -> None:
        if self.runs_in not in RUNS_IN:
            raise InputError(f"tool {self.name}: runs_in={self.runs_in!r}: expected one of {RUNS_IN}")
        for name in ("timeout_s", "memory_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InputError(f"tool {self.name}: {name}={value!r}: expected a finite number > 0")

    def signature_text(self) -> str:
        props = self.parameters.get("properties", {})
        args = ", ".join(f"{k}: {v['type']}" for k, v in props.items())
        return f"{self.name}({args}): {self.description}"

    def schema(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def offered(self) -> dict:
        """The tool as a conversation offers it: its schema, and the server that runs it where there is one."""
        return {**self.schema(), **({"server": self.server} if self.server else {})}


def tool(fn: Callable | None = None, *, name: str | None = None, timeout_s: float = 5.0,
         properties: dict[str, dict] | None = None, runs_in: str = "process", memory_mb: float = 1024.0):
    """Turn a typed function into a `Tool` (usable as `@tool` or `@tool(name=..., timeout_s=...)`).

    `properties` adds JSON-schema keywords to parameters, e.g. {"x": {"pattern": "^[0-9]+$"}}.
    """

    def wrap(f: Callable) -> Tool:
        sig = inspect.signature(f)
        hints = typing.get_type_hints(f)
        props, required = {}, []
        for p in sig.parameters.values():
            kind = hints.get(p.name)
            if kind not in _JSON_TYPES:
                raise InputError(
                    f"tool {f.__name__}: parameter {p.name!r} has type {kind!r}; "
                    f"expected one of {[t.__name__ for t in _JSON_TYPES]}"
                )
            props[p.name] = {"type": _JSON_TYPES[kind], **(properties or {}).get(p.name, {})}
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        doc = inspect.getdoc(f) or ""
        return Tool(name or f.__name__, doc.split("\n")[0], schema, f, timeout_s, runs_in=runs_in,
                    memory_mb=memory_mb)

    return wrap(fn) if fn is not None else wrap


@dataclass
class Observation:
    """What a tool call returns to the context: y, or an error in its place."""

    text: str
    # kind of failure: one of sandbox.KINDS, or one a thread tool names itself (an MCP server's
    # tool_error, server_disconnected, ...)
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


_NO_FETCH = referencing.Registry()  # a remote $ref is unresolvable: never fetched


def validate_arguments(arguments: dict, schema: dict) -> None:
    """jsonschema's check of a call's arguments, without fetching a remote $ref (jsonschema's
    default would download whatever URL a tool server's schema names)."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    cls(schema, registry=_NO_FETCH).validate(arguments)


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)
    max_output_chars: int = 2000

    def register(self, t: Tool) -> Tool:
        self.tools[t.name] = t
        return t

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __iter__(self):
        return iter(self.tools.values())

    def call(self, name: str, arguments: Any) -> Observation:
        start = time.perf_counter()
        obs = self._call(name, arguments)
        obs.duration_s = time.perf_counter() - start
        return obs

    def _call(self, name: str, arguments: Any) -> Observation:
        t = self.tools.get(name)
        if t is None:
            return Observation(f"error: unknown tool {name!r}; tools: {sorted(self.tools)}", "unknown_tool")
        if not isinstance(arguments, dict):
            return Observation(f"error: invalid arguments for {name}: expected a JSON object, got "
                               f"{type(arguments).__name__}", "invalid_arguments")
        try:
            validate_arguments(arguments, t.parameters)
        except jsonschema.ValidationError as exc:
            return Observation(f"error: invalid arguments for {name}: {sandbox.one_line(exc.message)}",
                               "invalid_arguments")
        except (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError) as exc:
            return Observation(f"error: the arguments for {name} cannot be checked ({sandbox.describe(exc)})",
                               "invalid_arguments")
        if t.runs_in == "process" and sandbox.CAN_FORK:
            text, error = sandbox.in_process(name, t.fn, arguments, timeout_s=t.timeout_s, memory_mb=t.memory_mb,
                                             max_chars=self.max_output_chars)
        else:
            text, error = sandbox.in_thread(name, t.fn, arguments, timeout_s=t.timeout_s,
                                            max_chars=self.max_output_chars)
        return Observation(text, error)
