"""Named hook points: observe or replace any state of the trajectory.

Every intermediate state of the generative map passes through a `HookPoint` whose
dotted name follows TransformerLens (`blocks.3.hook_resid_pre`,
`blocks.3.attn.hook_pattern`, ...). A hook point with no hook attached returns its input
at the cost of one Python call, so observability is off by default and costs nothing
measurable when off. A hook is `fn(x, hook) -> Tensor | None`; returning a tensor
replaces the state, which is how inputs are injected into the residual stream.

`hook.ctx` is shared by all hook points of a model and says where the current call sits
in the trajectory: `ctx.pos` holds the positions (in the context) of the rows being
computed, so a hook can tell prefill (many rows) from a decode step (one row), and
`ctx.rows` which sequence each row of an engine step belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional, TypeVar

import torch
from torch import nn

from hybridlm.errors import InputError

HookFn = Callable[[torch.Tensor, "HookPoint"], Optional[torch.Tensor]]
_Hook = TypeVar("_Hook", bound=Callable[..., object])  # a hook, or a method that becomes one


def observing(fn: _Hook) -> _Hook:
    """Mark a hook as one that only looks: it returns None and changes nothing the model reads.
    Where only such hooks watch a block in a token step, the compiled blocks run whole and hand
    them the states afterwards, in the order and shapes the hook points would have, with the
    same bits and `hook.ctx` (hybridlm.lm.step); an unmarked hook sends the block through its
    sublayers or parts, since it may replace the state. (A marked hook that returned a tensor
    would find it ignored there.)"""
    fn.__dict__["observes"] = True  # (a function's attribute; mypy types none on callables)
    return fn


@dataclass
class HookContext:
    """Where the current forward call sits.

    `pos`: the positions of the rows being computed, [m] when every sequence of the batch
    has them (a prefill, a rectangular decode step), [B, m] when each row has its own (the
    engine's ragged batch: row b at position n_b). `rows`: while the engine steps a batch,
    the sequence (its `ArcState`) of each batch row, else None.
    """

    pos: torch.Tensor | None = None
    rows: list | None = None
    extra: dict = field(default_factory=dict)


class UnknownHookPoint(InputError, KeyError):
    """A hook point name the model does not have (a KeyError too, as a dict lookup would raise)."""

    __str__ = Exception.__str__  # (KeyError's would quote the message)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


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
                if not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype):
                    where = self.name or "a hook point"
                    raise InputError(f"hook on {where} returned {_described(out)}: expected None or a tensor of "
                                     f"shape {tuple(x.shape)} and dtype {x.dtype}, as it was given")
                x = out
        return x

    @property
    def active(self) -> bool:
        return bool(self.fns)

    @property
    def observed(self) -> bool:
        """Whether hooks are attached and every one of them only observes (see `observing`)."""
        return bool(self.fns) and all(getattr(fn, "observes", False) for fn in self.fns)

    def extra_repr(self) -> str:
        return self.name


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
            close = [n for n in self._hook_points if n.endswith(str(name).split(".")[-1])][:5]
            raise UnknownHookPoint(f"no hook point named {name!r}; e.g. {close or list(self._hook_points)[:5]}") from None

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
                if not callable(fn):
                    raise InputError(f"hook for {name}: expected a function fn(tensor, hook), got {_described(fn)}")
                point.fns.append(fn)
                attached.append((point, fn))
            yield
        finally:
            for point, fn in attached:
                point.fns.remove(fn)

    def reset_hooks(self) -> None:
        for point in self._hook_points.values():
            point.fns.clear()
