"""The built-in tools: an arithmetic calculator, a clock and a lookup over a JSON knowledge base.

The calculator evaluates by walking the expression's AST, each intermediate result bounded
before and after it is computed; the knowledge base is read bounded in size and nesting, and
the lookup's key is one of its keys (the schema's enum), so a constrained call names one that
exists.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hybridlm.errors import InputError
from hybridlm.files import read_text
from hybridlm.tools.registry import Tool, ToolRegistry, tool

_BINARY: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable] = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
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
    def ev(node: ast.AST) -> Any:
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
