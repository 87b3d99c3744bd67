"""The MLP sublayer: GELU-tanh (GPT-2), SwiGLU (Llama) and GeGLU (Gemma).

GPT-2: σ_act(R W_fc + 𝟏b_fcᵀ) W_proj + 𝟏b_projᵀ with σ_act the tanh form of GELU,
0.5x(1 + tanh(√(2/π)(x + 0.044715x³))) (docs/theory.md §2).
SwiGLU: (silu(R W_gate) ⊙ R W_up) W_down.
GeGLU: (σ_act(R W_gate) ⊙ R W_up) W_down, the gate through GELU-tanh.

A token step's rows take the compiled activations of `hybridlm.lm.kernels` (layer.c), the ones a
compiled block runs, so a block has the same bits whether it runs compiled or staged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.lm import kernels
from hybridlm.lm.config import ModelConfig
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint
from hybridlm.lm.linear import Linear


class GeluMLP(DirectModule):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_fc = Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.W_proj = Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.W_fc(r))
        kernel = kernels.step_kernel((pre,))
        post = F.gelu(pre, approximate="tanh") if kernel is None else kernel.gelu(pre)
        return self.W_proj(self.hook_post(post))


class SwiGLU(DirectModule):
    """The two input projections are one fused matrix W_gate_up = [W_gate; W_up] (one
    product per step, as W_qkv is for attention); `W_gate` and `W_up` give the per-equation
    views."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.d_mlp = cfg.d_mlp
        self.W_gate_up = Linear(cfg.d_model, 2 * cfg.d_mlp, bias=cfg.mlp_bias)
        self.W_down = Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()
        self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()

    @property
    def W_gate(self) -> torch.Tensor:
        """W_gate ∈ ℝ^{d × d_mlp}, so that the gate is R W_gate."""
        return self.W_gate_up.weight[: self.d_mlp].T

    @property
    def W_up(self) -> torch.Tensor:
        return self.W_gate_up.weight[self.d_mlp :].T

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        gate_up, d = self.W_gate_up(r), self.d_mlp
        gate, up = gate_up[..., :d], gate_up[..., d:]  # (slices: cheaper than Tensor.split's Python wrapper)
        gate, up = self.hook_pre(gate), self.hook_pre_linear(up)
        return self.W_down(self.hook_post(self.gated(gate, up)))

    @staticmethod
    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        kernel = kernels.step_kernel((gate, up))
        return F.silu(gate) * up if kernel is None else kernel.swiglu(gate, up)


class GeGLU(SwiGLU):
    """SwiGLU's parts and hook points with the gate through GELU-tanh (Gemma): GELU-tanh(g), then
    ⊙ u, the two roundings a compiled block makes too."""

    @staticmethod
    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        kernel = kernels.step_kernel((gate,))
        return (F.gelu(gate, approximate="tanh") if kernel is None else kernel.gelu(gate)) * up


def make_mlp(cfg: ModelConfig) -> nn.Module:
    return {"gelu": GeluMLP, "swiglu": SwiGLU, "geglu": GeGLU}[cfg.mlp](cfg)
