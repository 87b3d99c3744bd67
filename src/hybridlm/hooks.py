"""Named hook points: observe or replace any state of the trajectory.

Every intermediate state of the generative map passes through a `HookPoint` whose
dotted name follows TransformerLens (`blocks.3.hook_resid_pre`,
`blocks.3.attn.hook_pattern`, ...). A hook point with no hook attached returns its input
at the cost of one Python call, so observability is off by default and costs nothing
measurable when off. A hook is `fn(x, hook) -> Tensor | None`; returning a tensor
replaces the state, which is how inputs are injected into the residual stream.

`hook.ctx` is shared by all hook points of a model and says where the current call sits
in the trajectory: `ctx.pos` holds the positions (in the context) of the rows being
computed, so a hook can tell prefill (many rows) from a decode step (one row).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], Optional[torch.Tensor]]


@dataclass
class HookContext:
    """Where the current forward call sits: positions of the rows being computed."""

    pos: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class HookPoint(nn.Module):
    """Identity map with optional hooks; registered as a submodule to get its dotted name."""

    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []
        self.name: str = ""
        self.ctx: HookContext = HookContext()

    # A plain __call__ bypasses nn.Module's dispatch: the off path is one attribute test.
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fns:
            return x
        for fn in self.fns:
            out = fn(x, self)
            if out is not None:
                x = out
        return x

    @property
    def active(self) -> bool:
        return bool(self.fns)

    def extra_repr(self) -> str:
        return self.name


class _MemberTable(dict):
    """A module's table of submodules, parameters or buffers that keeps a copy of each
    entry in the module's instance dict.

    `nn.Module` keeps its members only in these tables, so every `self.W_qkv` or
    `self.weight` inside a forward misses the instance dict and runs `nn.Module.__getattr__`,
    a Python function: some 1000 calls per decode step of a 30-layer model. With the entry
    also in the instance dict the lookup is a plain attribute read. Every change goes
    through the table (assignment, `del`, `.to()`, `load_state_dict(assign=True)`,
    `torch.func.functional_call`'s swaps), so the copy cannot go stale.
    """

    __slots__ = ("owner",)

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        owner = getattr(self, "owner", None)  # (unset while pickle or deepcopy refills the table)
        if owner is not None:
            owner.__dict__[name] = value

    def __delitem__(self, name):
        super().__delitem__(name)
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner.__dict__.pop(name, None)

    def pop(self, name, *default):
        if name in self:
            value = self[name]
            del self[name]
            return value
        return super().pop(name, *default)

    def _unsupported(self, *args, **kwargs):
        raise TypeError("change a module's members one at a time (setattr, del, or table[name] = value)")

    update = setdefault = popitem = clear = __ior__ = _unsupported


def _mirror_members(module: nn.Module) -> None:
    """Replace the module's member tables by `_MemberTable`s holding the same entries."""
    for table in ("_modules", "_parameters", "_buffers"):
        mirrored = _MemberTable()
        mirrored.owner = module
        for name, value in module.__dict__[table].items():
            mirrored[name] = value
        module.__dict__[table] = mirrored


class DirectModule(nn.Module):
    """A part of the generative map (block, attention, norm, MLP, affine map, ...), called
    straight into its `forward`.

    `nn.Module.__call__` spends two Python frames and a dozen checks for PyTorch's module
    hooks on every call; a decode step makes some 300 such calls, each after a
    matrix-vector product has pushed the interpreter's state out of the caches. hybridlm
    observes and intervenes through its hook points instead, so these modules refuse
    PyTorch's module hooks with an error that says so, rather than silently skipping them.
    (PyTorch's global module hooks are not called for them either.) Their submodules,
    parameters and buffers are also plain attributes (see `_MemberTable`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _mirror_members(self)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            f"{type(self).__name__} is called without PyTorch's module hooks; attach a function to a "
            "hook point instead, e.g. model.hooks({'blocks.0.hook_resid_post': fn}) (see model.hook_points)"
        )

    register_forward_hook = register_forward_pre_hook = _refuse
    register_full_backward_hook = register_full_backward_pre_hook = register_backward_hook = _refuse


class HookedModule(nn.Module):
    """Mixin for a model whose hook points are addressed by name."""

    def setup_hooks(self) -> None:
        """Name every hook point after its place in the module tree; share one context."""
        self.hook_ctx = HookContext()
        self._hook_points: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                module.ctx = self.hook_ctx
                self._hook_points[name] = module

    @property
    def hook_points(self) -> dict[str, HookPoint]:
        return self._hook_points

    def hook_point(self, name: str) -> HookPoint:
        try:
            return self._hook_points[name]
        except KeyError:
            close = [n for n in self._hook_points if n.endswith(name.split(".")[-1])][:5]
            raise KeyError(f"no hook point named {name!r}; e.g. {close or list(self._hook_points)[:5]}") from None

    def _select(self, names: str | list[str] | Callable[[str], bool]) -> list[str]:
        if callable(names):
            return [n for n in self._hook_points if names(n)]
        if isinstance(names, str):
            names = [names]
        for n in names:
            self.hook_point(n)
        return list(names)

    @contextlib.contextmanager
    def hooks(self, fwd: dict[str, HookFn] | list[tuple[str, HookFn]]) -> Iterator[None]:
        """Attach hooks for the duration of a `with` block: {name: fn} or [(name, fn), ...]."""
        pairs = list(fwd.items()) if isinstance(fwd, dict) else list(fwd)
        attached: list[tuple[HookPoint, HookFn]] = []
        try:
            for name, fn in pairs:
                point = self.hook_point(name)
                point.fns.append(fn)
                attached.append((point, fn))
            yield
        finally:
            for point, fn in attached:
                point.fns.remove(fn)

    def reset_hooks(self) -> None:
        for point in self._hook_points.values():
            point.fns.clear()

    def run_with_cache(
        self, *args, names: str | list[str] | Callable[[str], bool] = lambda n: True, **kwargs
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the model and return its output and the states at the selected hook points."""
        cache: dict[str, torch.Tensor] = {}

        def save(x: torch.Tensor, hook: HookPoint) -> None:
            cache[hook.name] = x.detach()

        with self.hooks([(n, save) for n in self._select(names)]):
            out = self(*args, **kwargs)
        return out, cache


# ---------------------------------------------------------------------- a build without hook points
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
