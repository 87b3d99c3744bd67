"""Tools: what runs in the external mode q_E (SPEC.md §4, seed 000).

A tool is a typed Python function with a JSON schema for its arguments. `@tool` derives
the schema from the signature (str, int, float, bool parameters; those without a default
are required) and the description from the docstring. `ToolRegistry.call` validates the
arguments with `jsonschema`, runs the function where it can be stopped (`runs_in="process"`,
the default: a forked worker process with memory and CPU limits, killed at the timeout;
`runs_in="thread"`: a thread here, for tools that enforce their own timeout; see
`hybridlm.agent.sandbox`), renders the result to text inside the same guard, caps its size,
and turns every failure into an error observation of a named kind (unknown_tool,
invalid_arguments, exception, timeout, memory, crashed, unrenderable, too_large): the arc
never crashes on a tool.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import referencing.exceptions

from hybridlm.agent import sandbox
from hybridlm.errors import InputError
from hybridlm.files import read_text

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


# ====================================================================== built-in tools
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
_MAX_BITS = 13_300  # every intermediate integer: about 4,000 decimal digits
_MAX_EXPRESSION = 10_000  # characters
_MAX_NODES = 2_000  # operators, numbers and calls in one expression


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate +, −, ×, /, //, %, ** and sqrt/abs/round/min/max over numbers, by walking the AST.

    Every intermediate result is bounded before it is computed (an integer power's size is
    |exponent| × the base's bits, known in advance) and after (integers to about 4,000 digits,
    floats finite); only finite real numbers come back. Every failure is a ValueError.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expected an expression as text, got {type(expression).__name__}")
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression of {len(expression)} characters; the limit is {_MAX_EXPRESSION}")
    text = expression.replace("×", "*").replace("÷", "/").replace("^", "**").replace(",", "")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        raise ValueError(f"not an arithmetic expression: {expression[:80]!r}") from None
    if sum(1 for _ in ast.walk(tree)) > _MAX_NODES:
        raise ValueError(f"expression with more than {_MAX_NODES} parts")
    try:
        value = _evaluate(tree, expression)
    except (ArithmeticError, TypeError, RecursionError) as exc:  # 1/0, sqrt(10**400), min(), ...
        raise ValueError(f"{type(exc).__name__} in {expression[:80]!r}: {exc}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _evaluate(node: ast.AST, expression: str) -> int | float:
    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return checked(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                power_bound(left, right)
            return checked(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return checked(_UNARY[type(node.op)](ev(node.operand)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return checked(_FUNCTIONS[node.func.id](*[ev(a) for a in node.args]))
        raise ValueError(f"unsupported element {ast.dump(node)[:40]} in {expression[:80]!r}")

    return ev(node)


def power_bound(base, exponent) -> None:
    """Refuse x ** y whose result would exceed the size bound, before computing it."""
    if isinstance(base, int) and isinstance(exponent, int):
        if exponent > 0 and abs(base) > 1 and exponent * (abs(base).bit_length() - 1) > _MAX_BITS:
            raise ValueError(f"the power {_short(base)} ** {_short(exponent)} is too large "
                             f"(more than {_MAX_BITS} bits)")
        if exponent < 0 and abs(exponent) > _MAX_BITS:
            raise ValueError(f"the exponent {_short(exponent)} is too large")


def checked(value):
    """A finite real number within the size bound, or a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the result {_short(value)} is not a real number")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError(f"a result is too large (more than {_MAX_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a result is not finite ({value})")
    return value


def _short(value) -> str:
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    return repr(value)


@tool(properties={"expression": {"pattern": r"^[0-9+*/(). -]+$"}})
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "12 * (3 + 4)"."""
    value = evaluate_arithmetic(expression)
    return repr(round(value, 10)) if isinstance(value, float) else str(value)


@tool
def clock() -> str:
    """The current date and time (UTC, ISO 8601)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


MAX_KB_BYTES = 32 << 20  # a knowledge base is read whole into memory
MAX_KB_DEPTH = 64  # nesting of objects and arrays


def read_knowledge_base(path: str | Path) -> dict:
    """A JSON object {key: value} from a file, its size, encoding and nesting bounded."""
    text = read_text(path, "knowledge base", max_bytes=MAX_KB_BYTES)
    try:
        kb = json.loads(text)
    except RecursionError:
        raise InputError(f"knowledge base {path}: nested too deep (the limit is {MAX_KB_DEPTH} levels)") from None
    except ValueError as exc:
        raise InputError(f"knowledge base {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(kb, dict):
        raise InputError(f"knowledge base {path}: expected a JSON object {{key: value}}, got a JSON "
                         f"{type(kb).__name__}")
    if _depth(kb) > MAX_KB_DEPTH:
        raise InputError(f"knowledge base {path}: nested too deep (the limit is {MAX_KB_DEPTH} levels)")
    return kb


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_KB_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def lookup_tool(kb_path: str | Path) -> Tool:
    """`lookup(key)` over a local JSON knowledge base {key: value}; a null value is "null", not missing."""
    kb = read_knowledge_base(kb_path)
    folded = {str(k).strip().lower(): v for k, v in kb.items()}

    def lookup(key: str) -> str:
        """Look up a key in the knowledge base."""
        folded_key = key.strip().lower()
        if folded_key not in folded:
            raise KeyError(f"{key!r} not in the knowledge base; keys include {sorted(kb)[:8]}")
        hit = folded[folded_key]
        return hit if isinstance(hit, str) else json.dumps(hit, ensure_ascii=False)

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
