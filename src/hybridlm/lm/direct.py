"""The direct-call machinery of the map's parts: modules called straight into `forward`,
with their members as plain attributes.

`nn.Module.__call__` and `nn.Module.__getattr__` are Python functions that run on every call
and every member read; a decode step of a 30-layer model makes some 300 calls and 1000
reads. hybridlm observes and intervenes through its hook points (`hybridlm.lm.hooks`), not
PyTorch's module hooks, so its parts skip both (see `DirectModule`).
"""

from __future__ import annotations

from torch import nn


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
    owner: nn.Module
    edits = 0  # changes to any table so far (what the compiled blocks built from may have been replaced)

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        _MemberTable.edits += 1
        owner = getattr(self, "owner", None)  # (unset while pickle or deepcopy refills the table)
        if owner is not None:
            owner.__dict__[name] = value

    def __delitem__(self, name):
        super().__delitem__(name)
        _MemberTable.edits += 1
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


def member_edits() -> int:
    """How many times a member of any direct-call module was set or removed (a counter: unchanged
    means every such module still has the submodules, parameters and buffers it had)."""
    return _MemberTable.edits


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
