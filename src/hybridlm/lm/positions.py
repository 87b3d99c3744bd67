"""Position encodings: learned absolute rows P W_p (GPT-2) and rotary phases (Llama).

Learned positions add P W_p to the embedding, H⁽⁰⁾ = U(s) W_e + P W_p (docs/theory.md
§2), so every row of the state depends on its absolute position. Rotary positions
instead rotate each (query, key) pair of coordinates by an angle proportional to the
position, pos · θ_j with θ_j = base^(−2j/d_k) / f_j, leaving the residual stream
position-free. The divisors f_j (`ModelConfig.rope_freq_factors`) carry every rescaling of
the frequencies a family applies (Llama 3's, linear, Phi-3's long-context factors); a family
whose local blocks rotate with another base (Gemma 3) has a second table, `Rotary.local`.

The pairs are (j, j + d_k/2), the halves of each head (GPT-NeoX's layout, which transformers
uses for every family); llama.cpp stores Llama's W_Q and W_K with the pairs interleaved, and
its loader restores the halves (hybridlm.weights.families).
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


_FIRST_ROWS = 2048  # the rotary tables' first length (`Rotary.reach` doubles it as positions need)


class Rotary(DirectModule):
    """Rotation of query/key coordinate pairs (j, j + d_k/2) by pos · θ_j.

    x ↦ x cos θ + rot(x) sin θ with rot(x) = (−x_{d_k/2:}, x_{:d_k/2}), written as a swap of
    the two halves of x (one copy) against a sine whose first half carries the sign. A
    forward pass passes one `pos` tensor to every layer, so the phases at `pos` are
    gathered once and reused.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, *, local: bool = False) -> None:
        super().__init__()
        d_k = cfg.d_head
        base, factors = cfg.rope_theta, cfg.rope_freq_factors
        if local and cfg.rope_local_theta is not None:
            base, factors = cfg.rope_local_theta, None
        # On the CPU even inside `torch.device("meta")` (a model's skeleton): PyTorch's meta `arange`
        # imports its symbolic-shape machinery (sympy), some 80 MB of resident memory for good.
        inv_freq = 1.0 / (base ** (torch.arange(0, d_k, 2, dtype=torch.float32, device="cpu") / d_k))
        if factors is not None:
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
        self._inv_freq, self._factor, self._horizon = inv_freq, 1.0 if local else cfg.rope_attn_factor, cfg.n_ctx
        # The tables hold the positions reached so far (`reach`), not the whole horizon T: a row's
        # entries do not depend on the table's length, and at T = 32768 and d_k = 256 the two
        # tables of both bases would be 128 MB, a third of a small model's file.
        cos, sin = self._table(min(cfg.n_ctx, _FIRST_ROWS))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._phases: tuple = (None, None, None, None)  # (pos, dtype, cos, sin) of the last call
        # the local blocks' table, where their base differs (their `Attention` picks it)
        self.local = Rotary(cfg, local=True) if cfg.rope_local_theta is not None and not local else None

    def _table(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(torch.arange(rows, dtype=torch.float32, device=self._inv_freq.device), self._inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if self._factor != 1.0:
            cos, sin = cos * self._factor, sin * self._factor
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def reach(self, n: int) -> None:
        """Make the tables hold positions 0 … n − 1 (at most T): doubled when they fall short."""
        if n > self.cos.shape[0] and self.cos.shape[0] < self._horizon:
            cos, sin = self._table(min(self._horizon, max(n, 2 * self.cos.shape[0])))
            self.cos = cos.to(self.cos.device, self.cos.dtype)
            self.sin = sin.to(self.sin.device, self.sin.dtype)
            self._phases = (None, None, None, None)
        if self.local is not None:
            self.local.reach(n)

    def phases(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos θ and signed sin θ at positions pos, shaped [n, 1, d_k] to broadcast over heads."""
        last_pos, last_dtype, cos, sin = self._phases
        if pos is not last_pos or dtype != last_dtype:
            if pos.numel():
                self.reach(int(pos.max()) + 1)
            cos, sin = self.cos[pos, None].to(dtype), self.sin[pos, None].to(dtype)
            self._phases = (pos, dtype, cos, sin)
        return cos, sin

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [B, n, heads, d_k] at positions pos [n]."""
        cos, sin = self.phases(pos, x.dtype)
        return x * cos + x.reshape(*x.shape[:-1], 2, -1).flip(-2).flatten(-2) * sin
