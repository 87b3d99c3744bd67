"""Position encodings: learned absolute rows P W_p (GPT-2) and rotary phases (Llama).

Learned positions add P W_p to the embedding, H⁽⁰⁾ = U(s) W_e + P W_p (SPEC.md §2,
seed 000), so every row of the state depends on its absolute position. Rotary positions
instead rotate each (query, key) pair of coordinates by an angle proportional to the
position, θ_j = pos · base^(−2j/d_k), leaving the residual stream position-free.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.config import ModelConfig
from hybridlm.hooks import HookPoint


class LearnedPositions(nn.Module):
    """P W_p: row `pos` of W_p ∈ ℝ^{T×d}."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_p = nn.Parameter(torch.zeros(cfg.n_ctx, cfg.d_model))
        self.hook_pos_embed = HookPoint()

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.hook_pos_embed(self.W_p[pos])


class Rotary(nn.Module):
    """Rotation of query/key coordinate pairs (j, j + d_k/2) by pos · θ_j."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_k = cfg.d_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d_k, 2, dtype=torch.float32) / d_k))
        angles = torch.outer(torch.arange(cfg.n_ctx, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [B, heads, n, d_k] at positions pos [n]."""
        cos = self.cos[pos].to(x.dtype)
        sin = self.sin[pos].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
