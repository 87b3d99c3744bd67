"""Causal multi-head attention with optional key/value grouping (docs/theory.md §2).

For each head m: Q = Z W_Q + 𝟏b_Qᵀ, K = Z W_K + 𝟏b_Kᵀ, V = Z W_V + 𝟏b_Vᵀ,
S = Q Kᵀ/√d_k + M_n with M_n(i, j) = −∞ for j > i, A = row-softmax(S) (lower-triangular,
row-stochastic), O = A V, and the sublayer output is [O¹ … O^{N_h}] W_O + 𝟏b_Oᵀ.

GPT-Neo changes two things: the scores are not scaled (S = Q Kᵀ + M, `attn_scale` = 1),
and its "local" blocks use a banded mask of width w (`local_window`): M(i, j) = 0 for
i − w < j ≤ i, −∞ otherwise. Where every key lies inside the band (n ≤ w) the band is the
plain causal mask, so the local mask is applied only when it cuts something.

`hook_result` sees each head's own write into the residual stream, O^m W_O^m, [B, pos, head, d]
(TransformerLens's name and layout); their sum over the heads plus b_O is the sublayer's output.
It is formed only while a hook is attached; a hook that replaces it makes the output Σ_m of
what it handed back, plus b_O.

Other families add parts, each off by default (`ModelConfig`): a head size d_k apart from
d / N_h; the RMSNorm of each head's q and k before the rotation (`q_norm`, `k_norm`: Qwen3,
Gemma 3), whose output is what `hook_q` and `hook_k` see; the scores capped, S ↦ c·tanh(S/c)
before the mask (Gemma 2: `attn_softcap`), with `hook_attn_scores` seeing the capped S; and
a local block's own rotary table (`Rotary.local`, Gemma 3). Capped scores are always formed
explicitly (PyTorch's fused kernel and the compiled decode step do not cap).

With grouped-query attention (Llama) N_h query heads share N_kv key/value heads, head m
reading key/value head ⌊m / (N_h/N_kv)⌋. The three projections are one fused matrix
W_qkv; `W_Q`, `W_K`, `W_V` give the per-equation views.

When a KV state is passed the new keys and values are written into it and the queries
attend over every position held so far, so a decode step costs O(n), not a recompute.
The explicit scores and pattern are formed only when a hook asks for them; otherwise
PyTorch's fused scaled-dot-product kernel computes the same O. A decode step (one new row
per sequence, float32 on the CPU) runs through the compiled kernel of `hybridlm.lm.kernels`
where it is built: rotation, state rows and attention in one call, or, with a hook on q, k,
v, S, A or z, in three calls with the hook points between them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridlm.lm import kernels
from hybridlm.lm.config import ModelConfig
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint
from hybridlm.lm.linear import Linear
from hybridlm.lm.norm import RMSNorm
from hybridlm.lm.positions import Rotary
from hybridlm.lm.state import ForkedState, KVState, StateBatch


class Attention(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.d_head = cfg.n_head, cfg.n_kv_head, cfg.d_head
        width = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.d_head
        self.W_qkv = Linear(cfg.d_model, width, bias=cfg.attn_bias)
        self.W_O = Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=cfg.attn_out_bias)
        self.scale = 1.0 / math.sqrt(cfg.d_head) if cfg.attn_scale is None else cfg.attn_scale
        self.window = cfg.window(layer)  # None: global (causal) mask
        self.softcap = cfg.attn_softcap  # None: scores uncapped
        self.local_rope = cfg.rope_local_theta is not None and self.window is not None  # reads `Rotary.local`
        self.q_norm = RMSNorm(cfg.d_head, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.d_head, cfg.norm_eps) if cfg.qk_norm else None
        # [B, pos, head, d_k] for q, k, v, z; [B, head, query_pos, key_pos] for scores, pattern
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()
        # [B, pos, head, d]: each head's contribution O^m W_O^m to the residual stream (formed only when attached)
        self.hook_result = HookPoint()

    # ------------------------------------------------------------------ equation views
    def _rows(self, which: int) -> slice:
        q, kv = self.n_head * self.d_head, self.n_kv_head * self.d_head
        return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][which]

    @property
    def W_Q(self) -> torch.Tensor:
        """W_Q ∈ ℝ^{d × N_h d_k}, so that Q = Z W_Q (+ b_Q)."""
        return self.W_qkv.weight[self._rows(0)].T

    @property
    def W_K(self) -> torch.Tensor:
        return self.W_qkv.weight[self._rows(1)].T

    @property
    def W_V(self) -> torch.Tensor:
        return self.W_qkv.weight[self._rows(2)].T

    # ------------------------------------------------------------------ the map
    def forward(
        self,
        z: torch.Tensor,
        pos: torch.Tensor,
        state: KVState | StateBatch | None = None,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        B, m, _ = z.shape
        heads = self.W_qkv(z).view(B, m, self.n_head + 2 * self.n_kv_head, self.d_head)  # [B, pos, head, d_k]
        if self.q_norm is not None:
            heads = self._normed(heads)
        if rotary is not None and self.local_rope:
            rotary = rotary.local
        if isinstance(state, StateBatch):
            o = self._ragged(heads, pos, state, rotary)
        elif isinstance(state, ForkedState):
            o = self._forked(heads, pos, state, rotary)
        else:
            o = self._attend(heads, pos, state, rotary)
        out = self.W_O(o.reshape(B, m, self.n_head * self.d_head))
        return out if not self.hook_result.fns else self._by_head(o, out)

    def head_results(self, z: torch.Tensor) -> torch.Tensor:
        """Each head's write into the residual stream, O^m W_O^m with W_O^m the rows of W_O that
        read head m: [B, pos, head, d] from z = [O¹ … O^{N_h}] ([B, pos, head, d_k]). Summed over
        the heads, plus b_O, they are the sublayer's output."""
        W = self.W_O.weight.unflatten(1, (self.n_head, self.d_head))  # [d, head, d_k]
        return torch.einsum("bphk,dhk->bphd", z, W.to(z.dtype))

    def _by_head(self, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The output through `hook_result`: as computed where the hooks only looked (the same
        bits as with no hook), else Σ_m result^m + b_O of what they handed back."""
        result = self.head_results(z)
        hooked = self.hook_result(result)
        if hooked is result:
            return out
        b = self.W_O.bias
        return hooked.sum(2) if b is None else hooked.sum(2) + b

    def _normed(self, heads):
        """q and k of every head through their RMSNorms (v as it is). A token step's rows take the
        compiled norm over each head's d_k entries, the one a compiled block runs (layer.c)."""
        H, H_kv = self.n_head, self.n_kv_head
        q, k, v = heads[:, :, :H], heads[:, :, H : H + H_kv], heads[:, :, H + H_kv :]
        assert self.q_norm is not None and self.k_norm is not None
        params = (self.q_norm.weight, self.k_norm.weight)
        kernel = kernels.step_kernel((heads[:, :, 0],), params) if heads.shape[1] == 1 else None
        if kernel is None:
            return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=2)
        return torch.cat([self.q_norm.compiled(kernel, q), self.k_norm.compiled(kernel, k), v], dim=2)

    def _attend(self, heads, pos, state, rotary):
        """O = A V of every head, [B, m, H, d_k] (after hook_z), from the fused projections."""
        B, m = heads.shape[:2]
        H, H_kv = self.n_head, self.n_kv_head
        if (m == 1 and state is not None and self.softcap is None and heads.dtype == torch.float32 and heads.is_cpu
                and not (heads.requires_grad and torch.is_grad_enabled())):  # (C keeps no graph)
            o = self._decode_step(heads, state, rotary)  # O [B, 1, H, d]
            if o is not None:
                return o
        q, k, v = heads[:, :, :H], heads[:, :, H : H + H_kv], heads[:, :, H + H_kv :]
        q_in, k_in, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if rotary is not None:  # q and k lie side by side in `heads`: one rotation for both
            qk = heads[:, :, : H + H_kv] if q_in is q and k_in is k else torch.cat([q_in, k_in], dim=2)
            qk = rotary(qk, pos)
            q_in, k_in = qk[:, :, :H], qk[:, :, H:]
        q, k, v = q_in.transpose(1, 2), k_in.transpose(1, 2), v.transpose(1, 2)  # [B, head, pos, d_k]
        if state is not None:
            k, v = state.write(self.layer, k, v)
        window = self.window if self.window is not None and k.shape[2] > self.window else None
        if self.hook_attn_scores.active or self.hook_pattern.active or self.softcap is not None:
            o = self._explicit(q, k, v, pos, window)
        else:
            o = self._fused(q, k, v, pos, window)
        return self.hook_z(o.transpose(1, 2))

    def _ragged(self, heads, pos, batch: StateBatch, rotary):
        """A ragged batch (one new row per sequence, each against its own state): in one compiled
        call when nothing watches, else row by row, each row exactly as if it were alone (its
        hooks see that row, with `ctx.pos` its position)."""
        if not self._watched() and heads.dtype == torch.float32 and heads.is_cpu and self.softcap is None:
            o = self._batch_step(heads, batch, rotary)
            if o is not None:
                return o
        ctx = self.hook_z.ctx
        outer_pos, outer_rows = ctx.pos, ctx.rows
        rows = []
        try:
            for b, x in enumerate(batch.states):
                ctx.pos, ctx.rows = pos[b], None if outer_rows is None else [outer_rows[b]]
                rows.append(self._attend(heads[b : b + 1], pos[b], x, rotary))
        finally:
            ctx.pos, ctx.rows = outer_pos, outer_rows
        return torch.cat(rows)

    def _forked(self, heads, pos, fork: ForkedState, rotary):
        """k candidates' new rows against one shared state: each query reads the parent's keys
        0..n−1 (shared, one product for all k) and its own key n; S and A are formed explicitly,
        [k, H, 1, n + 1], so every hook point sees them as in any decode step."""
        k_rows, H, H_kv, d = heads.shape[0], self.n_head, self.n_kv_head, self.d_head
        if not self._watched() and heads.dtype == torch.float32 and heads.is_cpu and self.softcap is None:
            o = self._fork_step(heads, fork, rotary)
            if o is not None:
                return o
        q, k, v = heads[:, :, :H], heads[:, :, H : H + H_kv], heads[:, :, H + H_kv :]
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if rotary is not None:
            qk = rotary(torch.cat([q, k], dim=2), pos)
            q, k = qk[:, :, :H], qk[:, :, H:]
        n = fork.n
        fork.write(self.layer, k[:, 0], v[:, 0])
        first = self._first_key(n)
        K = fork.parent.keys(self.layer)[0, :, first:]  # [H_kv, n − first, d]
        V = fork.parent.values(self.layer)[0, :, first:]
        g = H // H_kv
        q = q[:, 0].reshape(k_rows, H_kv, g, d)  # [k, H_kv, g, d]
        shared = torch.einsum("bjgd,jtd->bjgt", q, K)  # [k, H_kv, g, n − first]
        own = (q * k[:, 0, :, None, :]).sum(-1, keepdim=True)  # [k, H_kv, g, 1]
        scores = self._capped(torch.cat([shared, own], dim=-1).reshape(k_rows, H, 1, -1) * self.scale)
        if first:
            scores = torch.cat([scores.new_full((k_rows, H, 1, first), float("-inf")), scores], dim=-1)
        S = self.hook_attn_scores(scores)
        A = self.hook_pattern(torch.softmax(S, dim=-1))
        a = A[..., first:].reshape(k_rows, H_kv, g, -1)
        o = torch.einsum("bjgt,jtd->bjgd", a[..., :-1], V) + a[..., -1:] * v[:, 0, :, None, :]
        return self.hook_z(o.reshape(k_rows, 1, H, d))

    def _fork_step(self, heads, fork: ForkedState, rotary):
        """The fork in one compiled call: each candidate's rows and output with the bits the
        one-sequence decode step gives its successor state (None where the kernel cannot run)."""
        K, V = fork.parent.layer_buffers(self.layer)
        compiled = self._compiled(rotary, K, V)
        if compiled is None:
            return None
        step, cos, sin = compiled
        n = fork.n
        o, k, v = step.fork(heads.contiguous(), K, V, n, self._first_key(n), cos, sin, self.scale, self.n_kv_head)
        fork.write(self.layer, k, v)
        return o

    def _batch_step(self, heads, batch: StateBatch, rotary):
        compiled, meta = self._compiled(rotary), batch.meta()
        if compiled is None or meta is None:
            return None
        step, cos, sin = compiled
        return step.batch(heads.contiguous(), meta, self.layer, self.window, cos, sin, self.scale, self.n_kv_head)

    def _compiled(self, rotary, K=None, V=None):
        """(the compiled decode attention, cos, sin), or None where it cannot run: the library
        missing, or a state's buffers K, V or the rotary tables not contiguous float32 on the CPU."""
        step = kernels.decode_attention()
        if step is None or (K is not None and (K.dtype != torch.float32
                                               or not (K.is_cpu and K.is_contiguous() and V.is_contiguous()))):
            return None
        tables = kernels.rotary_tables(rotary)
        return None if tables is None else (step, *tables)

    def _first_key(self, n: int) -> int:
        """The first key the query at position n reads: 0, or n + 1 − w in a local layer of window w."""
        return n + 1 - self.window if self.window is not None and n + 1 > self.window else 0

    def _watched(self) -> bool:
        """Whether a hook watches or replaces q, k, v, S, A or z (then every state is formed)."""
        return any(point.active for point in (self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores,
                                               self.hook_pattern, self.hook_z))

    def _decode_step(self, heads, state, rotary):
        """One new row per sequence through the compiled decode step (hybridlm.lm.kernels): the
        same rotation, state rows and attention as the PyTorch path, in one call; with a hook
        on q, k, v, S, A or z, in stages with the hook points between them (observing hooks
        change no bit). None where the library is missing or the state's buffer or the
        rotary tables are not plain contiguous float32."""
        K, V = state.layer_buffers(self.layer)
        compiled = self._compiled(rotary, K, V)
        if compiled is None:
            return None
        step, cos, sin = compiled
        n = state.n
        start = self._first_key(n)
        if not self._watched():
            return step(heads.contiguous(), K, V, n, start, cos, sin, self.scale, self.n_kv_head)
        B, H, H_kv, d = heads.shape[0], self.n_head, self.n_kv_head, self.d_head
        q0, k0, v0 = heads[:, :, :H], heads[:, :, H : H + H_kv], heads[:, :, H + H_kv :]
        q = _handed_back(self.hook_q(q0), q0, (B, 1, H, d), "q (from hook_q)")
        k = _handed_back(self.hook_k(k0), k0, (B, 1, H_kv, d), "k (from hook_k)")
        v = _handed_back(self.hook_v(v0), v0, (B, 1, H_kv, d), "v (from hook_v)")
        scores = step.scores(q, k, v, K, V, n, start, cos, sin, self.scale)
        S = self.hook_attn_scores(scores)
        first = start if S is scores else 0  # a replaced S or A may weigh any key
        pattern = step.pattern(_handed_back(S, scores, scores.shape, "S (from hook_attn_scores)"), first)
        A = self.hook_pattern(pattern)
        first = first if A is pattern else 0
        A = _handed_back(A, pattern, scores.shape, "A (from hook_pattern)")
        return self.hook_z(step.output(A, V, n, first))

    def _fused(self, q, k, v, pos, window):
        m, n_keys = q.shape[2], k.shape[2]
        gqa = self.n_kv_head != self.n_head
        if m == 1 and window is not None:  # a local decode step reads exactly the last w keys
            k, v = k[:, :, -window:], v[:, :, -window:]
        if m == 1:  # one new query sees every key: no mask, and the g heads of a group are g rows
            B, H, _, d = q.shape
            o = F.scaled_dot_product_attention(q.view(B, self.n_kv_head, H // self.n_kv_head, d), k, v, scale=self.scale)
            return o.view(B, H, 1, d)
        if m == n_keys and window is None:  # prefill from the empty state: the plain causal mask M_n
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_mask(pos, n_keys, window), scale=self.scale, enable_gqa=gqa
        )

    def _explicit(self, q, k, v, pos, window):
        """S, A and O = A V formed explicitly (for the scores and pattern hooks).

        Beyond `_ONE_BLOCK` stacked rows (g·m, see below) the queries are taken in blocks of
        rows, and each block reads only the keys up to its last position: the entries above
        the diagonal are −∞ in S and 0 in A without being computed, which halves the work of
        a long prefill. The g = N_h/N_kv query heads that share a key/value head are stacked
        as g·m query rows against that head's keys, so K and V are never repeated. A hook
        that replaces S or A gets A or O recomputed from it.
        """
        B, H, m, d = q.shape
        n_keys, H_kv = k.shape[2], self.n_kv_head
        if m * (H // H_kv) <= _ONE_BLOCK:  # few rows: one block, S, A and O formed in place, no copies
            scores = (q.reshape(B, H_kv, -1, d) @ k.transpose(-1, -2)).view(B, H, m, n_keys).mul_(self.scale)
            scores = self._capped(scores)
            if m > 1 or window is not None:  # (a decode step's one query row sees every key)
                scores.masked_fill_(~causal_mask(pos, n_keys, window), float("-inf"))
            pattern = torch.softmax(scores, dim=-1)
            o = (pattern.view(B, H_kv, -1, n_keys) @ v).view(B, H, m, d)
            return self._hooked(scores, pattern, o, v)
        scores, pattern, o = q.new_empty((B, H, m, n_keys)), q.new_empty((B, H, m, n_keys)), q.new_empty((B, H, m, d))
        for r0 in range(0, m, _ROW_BLOCK):
            r1 = min(m, r0 + _ROW_BLOCK)
            reach = int(pos[r1 - 1]) + 1  # positions increase along the rows
            s = (q[:, :, r0:r1].reshape(B, H_kv, -1, d) @ k[:, :, :reach].transpose(-1, -2)).view(B, H, -1, reach)
            s = self._capped(s.mul_(self.scale)).masked_fill_(~causal_mask(pos[r0:r1], reach, window), float("-inf"))
            a = torch.softmax(s, dim=-1)
            scores[:, :, r0:r1, :reach] = s
            scores[:, :, r0:r1, reach:] = float("-inf")
            pattern[:, :, r0:r1, :reach] = a
            pattern[:, :, r0:r1, reach:] = 0.0
            o[:, :, r0:r1] = (a.view(B, H_kv, -1, reach) @ v[:, :, :reach]).view(B, H, -1, d)
        return self._hooked(scores, pattern, o, v)

    def _capped(self, scores):
        """S ↦ c·tanh(S/c) where the family caps its scores (before the mask, so a masked −∞ stays −∞)."""
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def _hooked(self, scores, pattern, o, v):
        """Pass S and A through their hooks; a replaced S or A gets A and O recomputed from it."""
        hooked = self.hook_attn_scores(scores)
        if hooked is not scores:
            pattern = torch.softmax(hooked, dim=-1)
        hooked_pattern = self.hook_pattern(pattern)
        if hooked_pattern is not pattern or hooked is not scores:
            B, H, m, n_keys = hooked_pattern.shape
            o = (hooked_pattern.view(B, self.n_kv_head, -1, n_keys) @ v).view(B, H, m, -1)
        return o


def _handed_back(t: torch.Tensor, produced: torch.Tensor, shape, what: str) -> torch.Tensor:
    """What a hook point handed back, ready for the compiled stages: the tensor produced
    (contiguous), or a replacement checked against its shape and made contiguous float32."""
    return produced.contiguous() if t is produced else kernels.plain(t, tuple(shape), what)


_ROW_BLOCK = 128  # query rows per block of the explicit attention
# Up to this many stacked query rows per key/value head (g·m) the explicit attention is one
# block: computing the −∞ half of S costs less than copying the blocks into S and A. Beyond
# it the blocks win. Recording every activation of a 512-token prefill, against hooks off:
# GPT-2 small (g = 1, 512 rows) 1.08× as one block, 1.12× in blocks; SmolLM2-135M (g = 3,
# 1536 rows) 1.26× as one block, 1.13× in blocks (interleaved, 8 rounds each).
_ONE_BLOCK = 512


def causal_mask(pos: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """True where query at position i = pos[·] may read key j: [len(pos), n_keys].

    Global: j ≤ i. Local with window w: i − w < j ≤ i.
    """
    i, j = pos[:, None], torch.arange(n_keys, device=pos.device)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)
