"""Position encodings: learned absolute rows P W_p (GPT-2) and rotary phases (Llama).

Learned positions add P W_p to the embedding, H⁽⁰⁾ = U(s) W_e + P W_p (docs/theory.md
§2), so every row of the state depends on its absolute position. Rotary positions
instead rotate each (query, key) pair of coordinates by an angle proportional to the
position, θ_j = pos · base^(−2j/d_k), leaving the residual stream position-free.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.lm.config import ModelConfig
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint


class LearnedPositions(DirectModule):
    """P W_p: row `pos` of W_p ∈ ℝ^{T×d}."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_p = nn.Parameter(torch.zeros(cfg.n_ctx, cfg.d_model))
        self.hook_pos_embed = HookPoint()

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.hook_pos_embed(self.W_p[pos])


class Rotary(DirectModule):
    """Rotation of query/key coordinate pairs (j, j + d_k/2) by pos · θ_j.

    x ↦ x cos θ + rot(x) sin θ with rot(x) = (−x_{d_k/2:}, x_{:d_k/2}), written as a swap of
    the two halves of x (one copy) against a sine whose first half carries the sign. A
    forward pass passes one `pos` tensor to every layer, so the phases at `pos` are
    gathered once and reused.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_k = cfg.d_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d_k, 2, dtype=torch.float32) / d_k))
        angles = torch.outer(torch.arange(cfg.n_ctx, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([-angles.sin(), angles.sin()], dim=-1), persistent=False)
        self._phases: tuple = (None, None, None, None)  # (pos, dtype, cos, sin) of the last call

    def phases(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos θ and signed sin θ at positions pos, shaped [n, 1, d_k] to broadcast over heads."""
        last_pos, last_dtype, cos, sin = self._phases
        if pos is not last_pos or dtype != last_dtype:
            cos, sin = self.cos[pos, None].to(dtype), self.sin[pos, None].to(dtype)
            self._phases = (pos, dtype, cos, sin)
        return cos, sin

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [B, n, heads, d_k] at positions pos [n]."""
        cos, sin = self.phases(pos, x.dtype)
        return x * cos + x.reshape(*x.shape[:-1], 2, -1).flip(-2).flatten(-2) * sin
