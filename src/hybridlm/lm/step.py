"""A token step of the blocks in compiled code (`hybridlm.lm.kernels`, layer.c).

A token step moves a few rows (one new position per sequence) through every block. Its products
and attention were compiled already; around them PyTorch and Python spent as long again on some
twenty small operations and calls per block (norms, slices, the activation, residual sums). Here
a block's rows go through compiled code in one of three ways, by what watches the block:

- nothing, or only hooks that observe (`hooks.observing`: the recorder's): the block joins a run
  of such blocks, the whole run is one call, and the observers get the states their points see
  afterwards, written out by the kernel, in the order and shapes the parts' own forwards would
  have handed them out (a ragged batch's attention states row by row);
- other hooks on its residual-stream points (`hook_resid_pre`, `hook_attn_out`, `hook_resid_mid`,
  `hook_mlp_out`, `hook_resid_post`), which may replace the state (a control input added to
  it): each sublayer is one call, with those points between them;
- another hook inside a sublayer (a norm's, attention's q … z, the MLP's): the staged path, the
  parts' own forwards, whose norms, activations, products and attention call the same kernels
  one at a time with the hook points between.

The three give the same bits: the same kernels in the same order. A fork of one state (a
hidden-state barrier's candidates) runs whole where nothing watches it. Everything else (a
prefill, another dtype or device, autograd, an affine map that does not say how the kernels read
it (`kernel_product`: `Linear` and `Int4Linear` do)) takes the parts' forwards.

A block's kernel parameters (`kernels.BlockSpec`) hold the addresses of its tensors and copy a
few constants. They are built once and checked on every step against the block's current modules
and tensors (identity and address) and those constants, so a replaced weight or module is seen
before the kernel could read stale memory.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from hybridlm.lm import kernels
from hybridlm.lm.attention import Attention
from hybridlm.lm.direct import member_edits
from hybridlm.lm.mlp import GeGLU, GeluMLP, SwiGLU
from hybridlm.lm.norm import LayerNorm, RMSNorm
from hybridlm.lm.state import ForkedState, KVState, StateBatch, step_rows

_RESIDUAL = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")


class TokenStep:
    """One token step's rows as the compiled blocks see them: the kernel, where each row's keys and
    values lie (`state.step_rows`), the rotary tables, the model's sizes and its blocks' specs;
    `fork`, where the rows are a fork's candidates of one state (`state.ForkedState`)."""

    def __init__(self, kernel: kernels.BlockKernel, table: "SpecTable", rows: torch.Tensor, tables: kernels.Tables,
                 fork: ForkedState | None = None) -> None:
        self.kernel, self.table, self.rows, self.tables, self.fork = kernel, table, rows, tables, fork

    def attention(self, spec: kernels.BlockSpec, h: torch.Tensor) -> torch.Tensor:
        return self.kernel.attention(spec, self.table.sizes, h, self.rows, self.tables)

    def mlp(self, spec: kernels.BlockSpec, h: torch.Tensor) -> torch.Tensor:
        return self.kernel.mlp(spec, self.table.sizes, h)

    def run(self, first: int, count: int, h: torch.Tensor, taps: torch.Tensor | None = None,
            inner: bool = False) -> None:
        """Blocks first … first + count − 1 (each checked by `SpecTable.watch`), h advanced in place;
        taps (None, or `tap_layout` floats per block) receive the states their hook points see. A
        fork's candidates' new rows go to the fork, layer by layer."""
        address = ctypes.addressof(self.table.specs) + first * ctypes.sizeof(kernels.BlockSpec)
        own = None
        if self.fork is not None:
            cfg = self.table.config
            own = h.new_empty(count, 2, h.shape[0], cfg.n_kv_head, cfg.d_head)
        self.kernel.blocks(address, count, self.table.sizes, h, self.rows, self.tables, taps, inner, own)
        if self.fork is not None and own is not None:
            for i in range(count):
                self.fork.write(first + i, own[i, 0], own[i, 1])


def token_step(model, h: torch.Tensor, state, rotary) -> TokenStep | None:
    """The compiled blocks for this forward's rows, or None: they run where the rows are a token
    step's (one position per sequence, float32 on the CPU, outside autograd) against a `KVState`,
    a ragged `StateBatch` or a fork of one state, whose buffers are float32, and the rotary tables
    (if any, the local blocks' too) are too. (The tables live as long as the model: the step keeps
    their addresses.)"""
    kernel = kernels.blocks()
    if kernel is None or h.shape[1] != 1 or not kernel.takes(h):
        return None
    fork = None
    if isinstance(state, StateBatch):
        rows = state.meta()
    elif type(state) is KVState:
        rows = step_rows([state])
    elif type(state) is ForkedState and state.parent.n == state.n:
        fork, rows = state, step_rows([state.parent])
    else:
        return None
    if rows is None or (fork is None and rows.shape[1] != h.shape[0]):
        return None
    tables = kernels.rotary_tables(rotary)
    local = tables if rotary is None or rotary.local is None else kernels.rotary_tables(rotary.local)
    if tables is None or local is None:
        return None
    table = model.__dict__.get("_spec_table")
    if table is None or table.config is not model.config:
        table = model.__dict__["_spec_table"] = SpecTable(model.config)
    return TokenStep(kernel, table, rows, kernels.Tables(*map(kernels.address, tables + local)), fork)


def run_blocks(blocks, h: torch.Tensor, pos: torch.Tensor, state, rotary, step: TokenStep | None) -> torch.Tensor:
    """H⁽ℓ⁾ after the given blocks, in order: runs of blocks in one call each where `step` allows
    (no hook on them but hooks that observe, which get the run's states afterwards; a fork's only
    where nothing watches), every other block through its own forward (compiled sublayers where
    it allows)."""
    if step is None:
        for block in blocks:
            h = block(h, pos, state, rotary)
        return h
    blocks = list(blocks)
    i, owned = 0, False
    while i < len(blocks):
        j, watched = i, 0
        while j < len(blocks):
            level = step.table.watch(blocks[j])
            if level is None or (level and step.fork is not None):
                break
            watched, j = max(watched, level), j + 1
        if j > i and _consecutive(blocks, i, j):
            if not owned:  # (the run advances h in place: never a tensor a hook may have kept)
                h, owned = h.contiguous().clone(), True
            if watched:
                layout = tap_layout(step.table.config, [int(n) for n in step.rows[2]])
                taps = h.new_empty((j - i) * layout[-1])
                step.run(blocks[i].layer, j - i, h, taps, inner=watched == 2)
                for block, tap in zip(blocks[i:j], taps.view(j - i, -1)):
                    _replay(block, tap, layout, watched == 2, pos, isinstance(state, StateBatch))
            else:
                step.run(blocks[i].layer, j - i, h)
            i = j
        else:
            h, owned = blocks[i](h, pos, state, rotary, None if step.fork is not None else step), False
            i += 1
    return h


def _consecutive(blocks, i: int, j: int) -> bool:
    return all(blocks[k].layer == blocks[i].layer + (k - i) for k in range(i, j))


# The states a block's hook points see, in the order they see them, as layer.c lays them out in a
# block's taps (its tap_offsets).
_TAPS = ("resid_pre", "xhat1", "heads", "scores", "pattern", "z", "attn_out", "resid_mid", "xhat2", "pre", "post",
         "mlp_out", "resid_post")


def tap_layout(cfg, n: list[int]) -> list[int]:
    """Offsets (floats) of each state of `_TAPS` in a block's taps, and the end, for rows at lengths n."""
    R, D, H, H_kv, d = len(n), cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_head
    keys = sum(H * (n_b + 1) for n_b in n)
    up = (1 if cfg.mlp == "gelu" else 2) * cfg.d_mlp
    sizes = [R * D, R * D, R * (H + 2 * H_kv) * d, keys, keys, R * H * d, R * D, R * D, R * D, R * up,
             R * cfg.d_mlp, R * D, R * D]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def _replay(block, tap: torch.Tensor, layout: list[int], inner: bool, pos: torch.Tensor, ragged: bool) -> None:
    """Hand a compiled block's states to its observers, in the order and shapes its own forward
    would (a ragged batch's attention states row by row, with `ctx.pos` and `ctx.rows` that row's)."""
    attn = block.attn
    part = dict(zip(_TAPS, (tap[a:b] for a, b in zip(layout, layout[1:]))))
    D = block.ln1.weight.shape[0]
    R = part["resid_pre"].numel() // D

    def rows(name: str, *shape: int) -> torch.Tensor:
        return part[name].view(R, 1, *shape)

    block.hook_resid_pre(rows("resid_pre", D))
    if inner:
        block.ln1.hook_normalized(rows("xhat1", D))
        H, H_kv, d = attn.n_head, attn.n_kv_head, attn.d_head
        heads, z = rows("heads", H + 2 * H_kv, d), rows("z", H, d)
        if ragged:
            ctx = attn.hook_z.ctx
            outer_pos, outer_rows = ctx.pos, ctx.rows
            start = 0
            try:
                for b in range(R):
                    ctx.pos, ctx.rows = pos[b], None if outer_rows is None else [outer_rows[b]]
                    keys = int(pos[b, -1]) + 1
                    S, A = (part[name][start : start + H * keys].view(1, H, 1, keys) for name in ("scores", "pattern"))
                    _attention_states(attn, heads[b : b + 1], S, A, z[b : b + 1])
                    start += H * keys
            finally:
                ctx.pos, ctx.rows = outer_pos, outer_rows
        else:
            keys = part["scores"].numel() // (R * H)
            S, A = (part[name].view(R, H, 1, keys) for name in ("scores", "pattern"))
            _attention_states(attn, heads, S, A, z)
        if attn.hook_result.fns:  # (once for all rows, after them, as the attention's forward hands it out)
            attn.hook_result(attn.head_results(z))
    block.hook_attn_out(rows("attn_out", D))
    block.hook_resid_mid(rows("resid_mid", D))
    if inner:
        mlp = block.mlp
        block.ln2.hook_normalized(rows("xhat2", D))
        pre = part["pre"].view(R, 1, -1)
        if isinstance(mlp, SwiGLU):  # (GeGLU too)
            mlp.hook_pre(pre[..., : mlp.d_mlp])
            mlp.hook_pre_linear(pre[..., mlp.d_mlp :])
        else:
            mlp.hook_pre(pre)
        mlp.hook_post(part["post"].view(R, 1, -1))
    block.hook_mlp_out(rows("mlp_out", D))
    block.hook_resid_post(rows("resid_post", D))


def _attention_states(attn, heads, S, A, z) -> None:
    H, H_kv = attn.n_head, attn.n_kv_head
    attn.hook_q(heads[:, :, :H])
    attn.hook_k(heads[:, :, H : H + H_kv])
    attn.hook_v(heads[:, :, H + H_kv :])
    attn.hook_attn_scores(S)
    attn.hook_pattern(A)
    attn.hook_z(z)


class _Built(NamedTuple):
    """What a block's spec was built from, to tell whether it still holds."""

    block: object
    edits: int  # member_edits() then
    parts: list  # `_parts`: modules, residual hook points, tensors
    tensors: list
    addresses: tuple  # the tensors' addresses
    inner: tuple  # the hook points inside the sublayers the taps serve
    staged: tuple  # hook points the taps do not serve (QK-norm's, the post-norms'): attached, the block is staged
    constants: tuple  # `_constants`

    @property
    def residual(self) -> tuple:
        """The block's residual-stream hook points (in `parts`, after its eight modules)."""
        return tuple(self.parts[8 : 8 + len(_RESIDUAL)])


class SpecTable:
    """The kernel parameters of a model's blocks, one slot per layer, each built from the block's
    modules and tensors and rebuilt when any of them changes."""

    def __init__(self, cfg) -> None:
        self.config = cfg
        self.sizes = kernels.Sizes(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_head, cfg.d_mlp)
        self.specs = (kernels.BlockSpec * cfg.n_layer)()
        self.built: list[_Built | None] = [None] * cfg.n_layer

    def spec(self, block) -> kernels.BlockSpec | None:
        """The block's spec, or None where its sublayers cannot run compiled: a hook point inside
        them attached, or a part the kernels do not compute (then its own forward runs)."""
        built = self._entry(block)
        if built is None or any(point.fns for point in built.inner + built.staged):
            return None
        return self.specs[block.layer]

    def watch(self, block) -> int | None:
        """How a run of whole blocks may take this one: None where it cannot (a part the kernels do
        not compute, or a hook attached that may replace a state), 0 where nothing watches it, 1
        where hooks that observe watch its residual stream only, 2 where they watch inside too."""
        built = self._entry(block)
        if built is None or any(point.fns for point in built.staged):
            return None
        level = 0
        for points, deep in ((built.residual, 1), (built.inner, 2)):
            for point in points:
                if point.fns:
                    if not point.observed:
                        return None
                    level = deep
        return level

    def _entry(self, block) -> _Built | None:
        layer = block.layer
        built = self.built[layer]
        if built is None or not self._still(built, block):
            parts = _parts(block)
            made = None if parts is None else _build(parts)
            if parts is None or made is None:
                self.built[layer] = None
                return None
            tensors = _tensors(parts)
            spec, inner, staged = made
            self.specs[layer] = spec
            built = self.built[layer] = _Built(block, member_edits(), parts, tensors, _addresses(tensors), inner, staged,
                                               _constants(parts))
        if torch.is_grad_enabled() and any(t.requires_grad for t in built.tensors):
            return None
        return built

    @staticmethod
    def _still(built: _Built, block) -> bool:
        """Whether the block still has the parts its spec was built from, each tensor where it was and
        each constant as it was. No member of a direct-call module set since (`member_edits`) means
        the same modules and tensor objects; a tensor's storage may still have been swapped
        (`.data =`, `.to()`), and a constant reassigned."""
        if built.block is not block:
            return False
        if built.edits != member_edits():
            parts = _parts(block)
            if parts is None or len(parts) != len(built.parts) or any(a is not b for a, b in zip(parts, built.parts)):
                return False
        return _addresses(built.tensors) == built.addresses and _constants(built.parts) == built.constants


def _parts(block) -> list | None:
    """What a block's spec is built from: its modules and tensors in a fixed order: the eight
    modules, the residual hook points, the four optional norms (QK-norm's, the post-norms'; None
    where absent), then the tensors. None where a part is not of a kind the kernels compute
    (capped scores: Gemma 2; such a block takes its parts' forwards)."""
    ln1, attn, ln2, mlp = (block.__dict__.get(name) for name in ("ln1", "attn", "ln2", "mlp"))
    if type(attn) is not Attention or type(mlp) not in (SwiGLU, GeGLU, GeluMLP) or attn.softcap is not None:
        return None
    up, down = (mlp.W_gate_up, mlp.W_down) if isinstance(mlp, SwiGLU) else (mlp.W_fc, mlp.W_proj)
    extra = [attn.q_norm, attn.k_norm, block.__dict__.get("ln1_post"), block.__dict__.get("ln2_post")]
    parts = [ln1, attn, ln2, mlp, attn.W_qkv, attn.W_O, up, down, *(getattr(block, name) for name in _RESIDUAL), *extra]
    for norm in (ln1, ln2):
        if type(norm) is LayerNorm:
            parts += [norm.weight, norm.bias]
        elif type(norm) is RMSNorm:
            parts += [norm.weight]
        else:
            return None
    for norm in extra:
        if type(norm) is RMSNorm:
            parts += [norm.weight]
        elif norm is not None:
            return None
    for lin in (attn.W_qkv, attn.W_O, up, down):
        tensors = getattr(lin, "kernel_tensors", None)
        tensors = None if tensors is None else tensors()
        if tensors is None:
            return None
        parts += tensors
    return parts


def _constants(parts: list) -> tuple:
    """The plain numbers a spec copies: the norms' ε, the attention's scale, window and table."""
    ln1, attn, ln2 = parts[0], parts[1], parts[2]
    extra = tuple(None if norm is None else norm.eps for norm in parts[_EXTRA : _EXTRA + 4])
    return ln1.eps, ln2.eps, attn.scale, attn.window, attn.layer, attn.local_rope, extra


def _tensors(parts: list) -> list:
    return [t for t in parts if isinstance(t, torch.Tensor)]


def _addresses(tensors: list) -> tuple:
    return tuple(map(torch.Tensor.data_ptr, tensors))


def _build(parts: list):
    """(the spec, the block's inner hook points, its staged ones), or None where a tensor is not one
    the kernels read or the norms differ in ε (the spec holds one)."""
    ln1, attn, ln2, mlp, qkv, out, up, down = parts[:8]
    q_norm, k_norm, post1, post2 = parts[_EXTRA : _EXTRA + 4]
    extra = [norm for norm in (q_norm, k_norm, post1, post2) if norm is not None]
    if type(ln2) is not type(ln1) or any(norm.eps != ln1.eps for norm in (ln2, *extra)):
        return None
    D, d = ln1.weight.shape[0], attn.d_head
    norms = [ln1.weight, getattr(ln1, "bias", None), ln2.weight, getattr(ln2, "bias", None)]
    heads = [None if norm is None else norm.weight for norm in (q_norm, k_norm)]
    posts = [None if norm is None else norm.weight for norm in (post1, post2)]
    if (not all(kernels.plain_vector(t, D) for t in norms + posts) or not all(kernels.plain_vector(t, d) for t in heads)
            or (heads[0] is None) != (heads[1] is None)):
        return None
    products = [lin.kernel_product() for lin in (qkv, out, up, down)]
    if any(p is None for p in products):
        return None
    mlp_kind = "geglu" if type(mlp) is GeGLU else "swiglu" if type(mlp) is SwiGLU else "gelu"
    spec = kernels.BlockSpec(rms=int(type(ln1) is RMSNorm), mlp=kernels.MLP_KINDS[mlp_kind], layer=attn.layer,
                             window=attn.window or 0, eps=ln1.eps, scale=attn.scale, local=int(attn.local_rope))
    spec.g1, spec.b1, spec.g2, spec.b2 = map(kernels.address, norms)
    spec.gq, spec.gk, spec.p1, spec.p2 = map(kernels.address, heads + posts)
    spec.qkv, spec.out, spec.up, spec.down = products
    inner = (ln1.hook_normalized, ln2.hook_normalized, attn.hook_q, attn.hook_k, attn.hook_v,
             attn.hook_attn_scores, attn.hook_pattern, attn.hook_z, attn.hook_result, *_mlp_points(mlp))
    return spec, inner, tuple(norm.hook_normalized for norm in extra)


_EXTRA = 8 + len(_RESIDUAL)  # where the optional norms stand in a block's parts


def _mlp_points(mlp) -> tuple:
    if isinstance(mlp, SwiGLU):  # (GeGLU too)
        return mlp.hook_pre, mlp.hook_pre_linear, mlp.hook_post
    return mlp.hook_pre, mlp.hook_post
