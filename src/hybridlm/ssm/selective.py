"""The diagonal selective state-space mixer, in the manner of Mamba (docs/theory.md §5.4, the survey's (S17)).

Per block k and position i, with u = z(k, i) mapped into d_inner channels:

    Δ(z) = softplus(W_Δ(u)),  B(z) = W_B u,  C(z) = W_C u          (input-dependent: "selective")
    Ā = exp(Δ A),  B̄ = Δ B(z)                                       (A diagonal, negative real)
    c(k, i) = Ā(z) ⊙ c(k, i−1) + B̄(z) u(k, i)                        (S17), c(k, 0) = 0
    y(k, i) = C(z) c(k, i) + D ⊙ u(k, i)

Each channel of u carries its own d_state-dimensional memory. The discretisation is the
one Mamba uses: zero-order hold for A (Ā = exp(ΔA), exact for a held input) and the
first-order (Euler) approximation B̄ = ΔB in place of ZOH's (ΔA)⁻¹(exp(ΔA) − I)ΔB.
Because Ā is diagonal, (S17) along positions is the element-wise recurrence of
`hybridlm.ssm.scan`: a parallel scan for prefill, one step per token for decode.

As in Mamba, u first passes a short causal depthwise convolution (its window of the last
d_conv − 1 inputs is part of the fixed-size state) and a SiLU, and the output is gated,
y ⊙ silu(g), before the projection back to d.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint
from hybridlm.lm.linear import Linear
from hybridlm.ssm.config import StackConfig
from hybridlm.ssm.scan import parallel_scan, step


class SelectiveSSM(DirectModule):
    def __init__(self, cfg: StackConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        D, N, R = cfg.d_inner, cfg.d_state, cfg.dt_rank
        assert R is not None  # StackConfig fills in ⌈d/16⌉
        self.sizes = (D, N, R)
        self.W_in = Linear(cfg.d_model, 2 * D, bias=False)  # u and the gate g
        self.conv_weight = nn.Parameter(torch.zeros(D, cfg.d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(D))
        self.W_x = Linear(D, R + 2 * N, bias=False)  # low-rank Δ input, B(z), C(z)
        self.W_dt = Linear(R, D, bias=True)
        self.A_log = nn.Parameter(torch.zeros(D, N))  # A = −exp(A_log)
        self.D = nn.Parameter(torch.ones(D))
        self.W_out = Linear(D, cfg.d_model, bias=False)
        self.hook_delta = HookPoint()  # Δ(z): [B, m, d_inner]
        self.hook_state = HookPoint()  # c(k, i): [B, m, d_inner, d_state]

    @property
    def A(self) -> torch.Tensor:
        """The diagonal state matrix, one negative real entry per (channel, state): [d_inner, d_state]."""
        return -torch.exp(self.A_log)

    def conv(self, u: torch.Tensor, state=None) -> torch.Tensor:
        """Causal depthwise convolution over positions; the window continues from the state."""
        K = self.conv_weight.shape[1]
        past = u.new_zeros(u.shape[0], K - 1, u.shape[2]) if state is None else state.conv[self.layer]
        window = torch.cat([past, u], dim=1)
        if state is not None:
            state.conv[self.layer] = window[:, window.shape[1] - (K - 1):]
        return (window.unfold(1, K, 1) * self.conv_weight).sum(-1) + self.conv_bias

    def discretise(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ā(z), B̄(z)u and C(z) for inputs u [B, m, d_inner]."""
        D, N, R = self.sizes
        dt, B, C = self.W_x(u).split([R, N, N], dim=-1)
        delta = self.hook_delta(F.softplus(self.W_dt(dt)))  # Δ > 0
        a = torch.exp(delta[..., None] * self.A)  # Ā = exp(ΔA): [B, m, D, N]
        b = (delta * u)[..., None] * B[:, :, None, :]  # B̄u = Δ B(z) u
        return a, b, C

    def forward(self, z: torch.Tensor, state=None) -> torch.Tensor:
        u, g = self.W_in(z).chunk(2, dim=-1)
        u = F.silu(self.conv(u, state))
        a, b, C = self.discretise(u)
        c0 = None if state is None else state.c[self.layer]
        if b.shape[1] == 1 and c0 is not None:  # decode: one step of (S17)
            c = step(a, b, c0[:, None])
        else:  # prefill: all positions at once
            c = parallel_scan(a, b, c0)
        c = self.hook_state(c)
        if state is not None:
            state.c[self.layer] = c[:, -1]
        y = (c @ C[..., None]).squeeze(-1) + self.D * u  # C(z) c + D u
        return self.W_out(y * F.silu(g))
