"""Tools: what runs in the external mode q_E (SPEC.md §4, seed 000).

A tool is a typed Python function with a JSON schema for its arguments. `@tool` derives
the schema from the signature (str, int, float, bool parameters; those without a default
are required) and the description from the docstring. `ToolRegistry.call` validates the
arguments with `jsonschema`, runs the function in a worker thread with a timeout, caps
the size of its output, and turns every failure (unknown tool, invalid arguments, an
exception, a timeout, an oversized output) into an error observation: the arc never
crashes on a tool.

A tool that hangs cannot be killed from Python; its worker thread is abandoned (daemon)
and the run goes on with a timeout observation.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema

from hybridlm.errors import InputError

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

    def signature_text(self) -> str:
        props = self.parameters.get("properties", {})
        args = ", ".join(f"{k}: {v['type']}" for k, v in props.items())
        return f"{self.name}({args}): {self.description}"

    def schema(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def tool(fn: Callable | None = None, *, name: str | None = None, timeout_s: float = 5.0,
         properties: dict[str, dict] | None = None):
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
        return Tool(name or f.__name__, doc.split("\n")[0], schema, f, timeout_s)

    return wrap(fn) if fn is not None else wrap


@dataclass
class Observation:
    """What a tool call returns to the context: y, or an error in its place."""

    text: str
    error: str | None = None  # kind of failure: unknown_tool, invalid_arguments, exception, timeout, too_large
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


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
        try:
            jsonschema.validate(arguments, t.parameters)
        except jsonschema.ValidationError as exc:
            return Observation(f"error: invalid arguments for {name}: {exc.message}", "invalid_arguments")
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["value"] = t.fn(**arguments)
            except Exception as exc:  # noqa: BLE001 - a tool's failure becomes an observation
                result["error"] = f"{type(exc).__name__}: {exc}"

        worker = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
        worker.start()
        worker.join(t.timeout_s)
        if worker.is_alive():
            return Observation(f"error: {name} did not finish within {t.timeout_s:g} s", "timeout")
        if "error" in result:
            return Observation(f"error: {name} raised {result['error']}", "exception")
        value = result.get("value")
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > self.max_output_chars:
            return Observation(
                text[: self.max_output_chars] + f" … [error: output of {len(text)} characters cut to "
                f"{self.max_output_chars}]",
                "too_large",
            )
        return Observation(text)


# ====================================================================== built-in tools
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
_MAX_POWER = 10_000
_MAX_DIGITS = 4_000


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate +, −, ×, /, //, %, ** and sqrt/abs/round/min/max over numbers, by walking the AST."""
    text = expression.replace("×", "*").replace("÷", "/").replace("^", "**").replace(",", "")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
                raise ValueError(f"exponent {right} is too large (limit {_MAX_POWER})")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
                raise ValueError("result has too many digits")
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return _FUNCTIONS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"unsupported element {ast.dump(node)[:40]} in {expression!r}")

    value = ev(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


@tool(properties={"expression": {"pattern": r"^[0-9+*/(). -]+$"}})
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "12 * (3 + 4)"."""
    value = evaluate_arithmetic(expression)
    return repr(round(value, 10)) if isinstance(value, float) else str(value)


@tool
def clock() -> str:
    """The current date and time (UTC, ISO 8601)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def lookup_tool(kb_path: str | Path) -> Tool:
    """`lookup(key)` over a local JSON knowledge base {key: value}."""
    path = Path(kb_path)
    try:
        kb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"knowledge base {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(kb, dict):
        raise InputError(f"knowledge base {path}: expected a JSON object {{key: value}}")
    folded = {str(k).strip().lower(): v for k, v in kb.items()}

    def lookup(key: str) -> str:
        """Look up a key in the knowledge base."""
        hit = folded.get(key.strip().lower())
        if hit is None:
            raise KeyError(f"{key!r} not in the knowledge base; keys include {sorted(kb)[:8]}")
        return hit if isinstance(hit, str) else json.dumps(hit)

    # The key is one of the knowledge base's keys: the schema says so, and a constrained call
    # can then only name a key that exists.
    return tool(lookup, properties={"key": {"enum": [str(k) for k in kb]}})


def registry(names: list[str], *, kb: str | Path | None = None) -> ToolRegistry:
    """A registry with the named built-ins (calculator, clock, lookup)."""
    reg = ToolRegistry()
    for name in names:
        if name == "calculator":
            reg.register(calculator)
        elif name == "clock":
            reg.register(clock)
        elif name == "lookup":
            if kb is None:
                raise InputError("the lookup tool needs a knowledge base: --kb FILE (a JSON object)")
            reg.register(lookup_tool(kb))
        else:
            raise InputError(f"unknown tool {name!r}: built-ins are calculator, clock, lookup")
    return reg
