"""Causal multi-head attention with optional key/value grouping (SPEC.md §2, seed 000).

For each head m: Q = Z W_Q + 𝟏b_Qᵀ, K = Z W_K + 𝟏b_Kᵀ, V = Z W_V + 𝟏b_Vᵀ,
S = Q Kᵀ/√d_k + M_n with M_n(i, j) = −∞ for j > i, A = row-softmax(S) (lower-triangular,
row-stochastic), O = A V, and the sublayer output is [O¹ … O^{N_h}] W_O + 𝟏b_Oᵀ.

GPT-Neo changes two things: the scores are not scaled (S = Q Kᵀ + M, `attn_scale` = 1),
and its "local" blocks use a banded mask of width w (`local_window`): M(i, j) = 0 for
i − w < j ≤ i, −∞ otherwise. Where every key lies inside the band (n ≤ w) the band is the
plain causal mask, so the local mask is applied only when it cuts something.

With grouped-query attention (Llama) N_h query heads share N_kv key/value heads, head m
reading key/value head ⌊m / (N_h/N_kv)⌋. The three projections are one fused matrix
W_qkv; `W_Q`, `W_K`, `W_V` give the per-equation views.

When a KV state is passed the new keys and values are written into it and the queries
attend over every position held so far, so a decode step costs O(n), not a recompute.
The explicit scores and pattern are formed only when a hook asks for them; otherwise
PyTorch's fused scaled-dot-product kernel computes the same O.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.config import ModelConfig
from hybridlm.hooks import HookPoint
from hybridlm.linear import Linear
from hybridlm.positions import Rotary
from hybridlm.state import KVState


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.d_head = cfg.n_head, cfg.n_kv_head, cfg.d_head
        width = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.d_head
        self.W_qkv = Linear(cfg.d_model, width, bias=cfg.attn_bias)
        self.W_O = Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=cfg.attn_out_bias)
        self.scale = 1.0 / math.sqrt(cfg.d_head) if cfg.attn_scale is None else cfg.attn_scale
        self.window = cfg.window(layer)  # None: global (causal) mask
        # [B, pos, head, d_k] for q, k, v, z; [B, head, query_pos, key_pos] for scores, pattern
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

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
        state: KVState | None = None,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        B, m, _ = z.shape
        H, H_kv = self.n_head, self.n_kv_head
        heads = self.W_qkv(z).view(B, m, H + 2 * H_kv, self.d_head)  # [B, pos, head, d_k]
        q, k, v = heads.split([H, H_kv, H_kv], dim=2)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if rotary is not None:
            q, k = rotary(q, pos), rotary(k, pos)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, head, pos, d_k]
        if state is not None:
            k, v = state.write(self.layer, k, v)
        window = self.window if self.window is not None and k.shape[2] > self.window else None
        if self.hook_attn_scores.active or self.hook_pattern.active:
            o = self._explicit(q, k, v, pos, window)
        else:
            o = self._fused(q, k, v, pos, window)
        o = self.hook_z(o.transpose(1, 2))
        return self.W_O(o.reshape(B, m, H * self.d_head))

    def _fused(self, q, k, v, pos, window):
        m, n_keys = q.shape[2], k.shape[2]
        gqa = self.n_kv_head != self.n_head
        if m == 1 and window is not None:  # a local decode step reads exactly the last w keys
            k, v = k[:, :, -window:], v[:, :, -window:]
        if m == 1:  # one new query sees every key: no mask
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=gqa)
        if m == n_keys and window is None:  # prefill from the empty state: the plain causal mask M_n
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_mask(pos, n_keys, window), scale=self.scale, enable_gqa=gqa
        )

    def _explicit(self, q, k, v, pos, window):
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~causal_mask(pos, k.shape[2], window), float("-inf"))
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        return pattern @ v


def causal_mask(pos: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """True where query at position i = pos[·] may read key j: [len(pos), n_keys].

    Global: j ≤ i. Local with window w: i − w < j ≤ i.
    """
    i, j = pos[:, None], torch.arange(n_keys, device=pos.device)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)
