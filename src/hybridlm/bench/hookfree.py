"""A build of a model without hook points, as the benchmark's speed reference.

`without_hook_points(model)` runs the model as if it had been written with no hook points
at all: the measure of what the hook points cost when no hook is attached.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
import types
from collections.abc import Iterator

from torch import nn

from hybridlm.lm.hooks import HookPoint


class _DropHookCalls(ast.NodeTransformer):
    """Rewrite `self.<hook point>(expr)` as `expr` for the given hook-point attribute names."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.dropped = names, 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr in self.names and isinstance(f.value, ast.Name)
                and f.value.id == "self" and len(node.args) == 1 and not node.keywords):
            self.dropped += 1
            return node.args[0]
        return node


def _without_hook_calls(fn, names: set[str]):
    """fn recompiled with its calls of the named hook points removed; None if it calls none."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    dropper = _DropHookCalls(names)
    tree = ast.fix_missing_locations(dropper.visit(tree))
    if not dropper.dropped:
        return None
    namespace: dict = {}
    exec(compile(tree, f"<{fn.__qualname__} without hook points>", "exec"), fn.__globals__, namespace)
    return namespace[fn.__name__]


@contextlib.contextmanager
def without_hook_points(model: nn.Module) -> Iterator[None]:
    """Run `model` as if it had been built with no hook points at all (a speed reference).

    Every method that calls one of its module's hook points is recompiled from its source
    with each such call `self.hook_…(x)` replaced by `x`, and bound to the instance for the
    duration of the block. Hooks attached meanwhile see nothing.
    """
    patched: list[tuple[nn.Module, str]] = []
    cache: dict = {}
    try:
        for module in model.modules():
            names = {n for n, child in module.named_children() if isinstance(child, HookPoint)}
            if not names:
                continue
            for cls in type(module).__mro__[:-2]:  # the module's own classes, not nn.Module/object
                for name, fn in vars(cls).items():
                    if not inspect.isfunction(fn) or name.startswith("__") or name in vars(module):
                        continue
                    key = (fn, frozenset(names))
                    if key not in cache:
                        cache[key] = _without_hook_calls(fn, names)
                    if cache[key] is not None:
                        setattr(module, name, types.MethodType(cache[key], module))
                        patched.append((module, name))
        yield
    finally:
        for module, name in patched:
            delattr(module, name)
