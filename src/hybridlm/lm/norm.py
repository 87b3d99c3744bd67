"""Normalisations: LayerNorm (GPT-2) and RMSNorm (Llama), one interface.

LN_{γ,β}(h) = γ ⊙ (h − μ(h)𝟏)/σ(h) + β with σ = sqrt(mean (h_j − μ)² + ε) (docs/theory.md
§2). Before the affine part it maps onto the sphere {x : Σx_j = 0, ‖x‖ = √d}.
RMSNorm drops the centring and the bias: γ ⊙ h / sqrt(mean h_j² + ε).

`hook_normalized` sees the state before the affine part (the point on the sphere).
A token step's rows (float32 on the CPU, one position per sequence) take the compiled norm of
`hybridlm.lm.kernels` (layer.c), the one that a compiled block runs, so that a block gives the
same bits whether it runs compiled or staged between hook points; with a hook attached, the
kernel forms x̂ and γ (and β) follow after the hook point, the same roundings. Elsewhere, with
no hook attached LayerNorm runs PyTorch's fused kernel. RMSNorm's written-out form takes
the mean square in float32, as `transformers` does, and gives its bits in float32 and
bfloat16; on a float32 state the fused `rms_norm` runs instead, one call that gives the same
bits (with a hook, without γ, which multiplies after the hook point; in bfloat16 it rounds
differently, so there the written-out form always runs). Attaching a hook to RMSNorm never
changes the numbers, nor to LayerNorm in a token step; in a prefill, LayerNorm's fused kernel
rounds x̂ γ + β its own way, and with a hook attached the last bit may differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.lm import kernels
from hybridlm.lm.config import ModelConfig
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint


class LayerNorm(DirectModule):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.hook_normalized = HookPoint()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kernel = kernels.step_kernel((h,), (self.weight, self.bias))
        if kernel is not None:
            if not self.hook_normalized.active:
                return kernel.norm(h, False, self.eps, self.weight, self.bias)
            return self.hook_normalized(kernel.norm(h, False, self.eps, None, None)) * self.weight + self.bias
        if not self.hook_normalized.active:
            return F.layer_norm(h, h.shape[-1:], self.weight, self.bias, self.eps)
        x = self.hook_normalized(F.layer_norm(h, h.shape[-1:], None, None, self.eps))
        return x * self.weight + self.bias


class RMSNorm(DirectModule):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.hook_normalized = HookPoint()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kernel = kernels.step_kernel((h,), (self.weight,))
        if kernel is not None:
            return self.compiled(kernel, h)
        if h.dtype == torch.float32:  # fused, the same bits; hooked: γ applied after the hook point
            if not self.hook_normalized.active:
                return F.rms_norm(h, h.shape[-1:], self.weight, self.eps)
            return self.weight * self.hook_normalized(F.rms_norm(h, h.shape[-1:], None, self.eps))
        h32 = h.float()  # (as transformers does: the mean square in float32 whatever the dtype)
        inv_rms = (h32 * h32).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * self.hook_normalized((h32 * inv_rms).to(h.dtype))

    def compiled(self, kernel: kernels.BlockKernel, h: torch.Tensor) -> torch.Tensor:
        """The norm of each row of h (its last axis) through the compiled kernel: x̂ ⊙ γ in one call,
        or x̂, the hook point, then γ (the same two roundings)."""
        if not self.hook_normalized.active:
            return kernel.norm(h, True, self.eps, self.weight, None)
        return self.weight * self.hook_normalized(kernel.norm(h, True, self.eps, None, None))


def make_norm(cfg: ModelConfig) -> nn.Module:
    return {"layernorm": LayerNorm, "rmsnorm": RMSNorm}[cfg.norm](cfg.d_model, cfg.norm_eps)
