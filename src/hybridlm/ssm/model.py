"""Recurrent, selective-SSM and hybrid stacks as two-index (layer, position) systems
(docs/theory.md §5.4, the survey's (S16)–(S17)).

Information moves along two indices: vertically through the blocks k = 1..L and
horizontally along the positions i = 1..n, where block k keeps a memory c(k, i):

    c(k, i) = A(k, z) c(k, i−1) + B(k, z) z(k, i),   z(k+1, i) = C(k, z) c(k, i).

Every block is pre-norm with two residual sublayers, as the transformer's:

    H̃ = H⁽ᵏ⁻¹⁾ + Mixer_k(LN_{k,1}(H⁽ᵏ⁻¹⁾)),   H⁽ᵏ⁾ = H̃ + MLP_k(LN_{k,2}(H̃))

where the mixer is a selective SSM (`S`), an Elman RNN (`R`) or attention (`A`, the
transformer's own `Block`), chosen per block by `StackConfig.layers`. Embedding and
readout are the transformer's without positions: H⁽⁰⁾ = U(s) W_e, Y = LN_f(H⁽ᴸ⁾) W_eᵀ.

`StackLM` has `DecoderLM`'s state-space interface: `init_state(s)`, `F(x, w)`, `G(x)`,
with x an `SSMState`, and its hook points (`blocks.{k}.hook_resid_pre`, ...,
`blocks.{k}.ssm.hook_state` for c(k, i)).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridlm.errors import InputError
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.capture import Recordable
from hybridlm.lm.hooks import HookedModule, HookPoint
from hybridlm.lm.linear import column_major_zeros
from hybridlm.lm.mlp import make_mlp
from hybridlm.lm.model import Block, StateSpaceForm
from hybridlm.lm.norm import make_norm
from hybridlm.ssm.config import StackConfig
from hybridlm.ssm.rnn import ElmanRNN
from hybridlm.ssm.selective import SelectiveSSM
from hybridlm.ssm.state import SSMState

if TYPE_CHECKING:
    from hybridlm.tokenizer import Tokenizer

MIXERS = {"S": ("ssm", SelectiveSSM), "R": ("rnn", ElmanRNN)}


class RecurrentBlock(DirectModule):
    """Block k with a recurrent mixer (S or R): H⁽ᵏ⁻¹⁾ ↦ H⁽ᵏ⁾."""

    def __init__(self, cfg: StackConfig, layer: int, kind: str) -> None:
        super().__init__()
        parts = cfg.parts()
        self.layer, self.kind = layer, kind
        self.mixer_name, mixer = MIXERS[kind]
        self.ln1 = make_norm(parts)
        self.add_module(self.mixer_name, mixer(cfg, layer))
        self.ln2 = make_norm(parts)
        self.mlp = make_mlp(parts)
        self.hook_resid_pre = HookPoint()
        self.hook_mixer_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def mix(self, h: torch.Tensor, state: SSMState | None = None) -> torch.Tensor:
        """The mixer sublayer: H̃ = H + Mixer(LN₁(H))."""
        h = self.hook_resid_pre(h)
        return self.hook_resid_mid(h + self.hook_mixer_out(self.mixer(self.ln1(h), state)))

    def forward(self, h, pos=None, state: SSMState | None = None, rotary=None) -> torch.Tensor:
        h = self.mix(h, state)
        return self.hook_resid_post(h + self.hook_mlp_out(self.mlp(self.ln2(h))))

    def mixer_step(self, h: torch.Tensor, pos=None) -> torch.Tensor:
        """The block without its MLP (the looped runner's `attention_only`, the survey's (0.41))."""
        return self.hook_resid_post(self.mix(h))


class StackLM(StateSpaceForm, HookedModule, Recordable):
    """A language model whose blocks are selective SSMs, RNNs and/or attention: logits = model(ids)."""

    config: StackConfig

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__()
        self.config = cfg
        parts = cfg.parts()
        self.W_e = nn.Parameter(column_major_zeros(cfg.vocab_size, cfg.d_model))  # (as DecoderLM's)
        self.hook_embed = HookPoint()
        attention_index = iter(range(cfg.n_attention))
        self.blocks = nn.ModuleList(
            Block(parts, next(attention_index)) if kind == "A" else RecurrentBlock(cfg, k, kind)
            for k, kind in enumerate(cfg.layers)
        )
        self.ln_final = make_norm(parts)
        self.hook_logits = HookPoint()
        self.rotary = None  # no positions: the recurrences order the tokens (attention blocks: NoPE)
        self.tokenizer: Tokenizer | None = None  # set by the loader
        self.source = "config"
        self.setup_hooks()

    # ------------------------------------------------------------------ pieces
    @property
    def unembedding(self) -> torch.Tensor:
        return self.W_e

    def embed(self, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """H⁽⁰⁾ = U(s) W_e (row lookups; no positional term)."""
        return self.hook_embed(self.W_e[ids])

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Y = LN_f(H⁽ᴸ⁾) W_eᵀ."""
        return self.hook_logits(self.ln_final(h) @ self.W_e.T)

    def reinit(self, seed: int = 0, *, part: nn.Module | None = None) -> "StackLM":
        """Fresh random weights of this family (all, or only `part`, e.g. `self.blocks`)."""
        return init_stack(self, seed, part=part)

    # ------------------------------------------------------------------ the generative map
    def forward(self, ids, state: SSMState | None = None, *, last_only: bool = False,
                layers: int | None = None) -> torch.Tensor:
        """Logits [B, n, V] for ids [B, n] (or [n]); with `state`, continue from it (in place)."""
        ids = self._check_ids(ids)
        start = 0 if state is None else state.n
        m = ids.shape[1]
        if start + m > self.config.n_ctx:
            raise InputError(f"{start + m} positions exceed the context horizon T={self.config.n_ctx}; "
                             "truncate with Π_T first (hybridlm.alphabet.truncate, or use model.F)")
        pos = torch.arange(start, start + m, device=ids.device)
        self.hook_ctx.pos = pos
        if state is not None:
            state.reserve(m)
        h = self.embed(ids, pos)
        for block in self.blocks[:layers]:
            h = block(h, pos, _layer_state(block, state), None)
        if state is not None:
            state.commit(ids)
        return self.readout(h[:, -1:] if last_only else h)

    # ------------------------------------------------------------------ state-space form (init_state, F, G: StateSpaceForm)
    def empty_state(self, batch: int = 1, *, capacity: int = 64) -> SSMState:
        p = self.W_e
        return SSMState(self.config, batch, capacity=capacity, dtype=p.dtype, device=p.device)

    def __repr__(self) -> str:
        c = self.config
        return (f"StackLM(family={c.family}, layers={c.layers!r}, V={c.vocab_size}, d={c.d_model}, "
                f"N={c.d_state}, params={self.num_parameters():,}, source={self.source})")


def _layer_state(block: nn.Module, state: SSMState | None):
    """What a block reads and updates: the whole SSMState, or its KVState for attention."""
    if state is None:
        return None
    return state.attn if isinstance(block, Block) else state


def init_stack(model: StackLM, seed: int = 0, *, part: nn.Module | None = None) -> StackLM:
    """Random weights for a stack, seeded.

    GPT-2's rule for the shared parts (N(0, σ²), residual output maps σ/√(2L), norms 1,
    biases 0); for S blocks the S4D-real / Mamba choices: A = −(1, 2, …, N) per channel,
    D = 1, Δ's bias so that softplus gives Δ log-uniform in [10⁻³, 10⁻¹], convolution
    N(0, 1/d_conv); for R blocks A(k) ~ N(0, 0.9²/d_rnn) (spectral radius ≈ 0.9) and
    B(k) ~ N(0, 1/d).
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    std = cfg.init_std
    residual = std / math.sqrt(2 * cfg.n_layer)

    def normal(shape, s):
        return torch.randn(shape, generator=g) * s

    with torch.no_grad():
        for name, p in (model if part is None else part).named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.fill_(1.0)
            elif leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, p.shape[1] + 1, dtype=p.dtype)).expand_as(p))
            elif leaf == "D":
                p.fill_(1.0)
            elif owner == "W_dt" and leaf == "bias":
                dt = torch.exp(torch.rand(p.shape, generator=g) * math.log(100.0) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(Δ)
            elif leaf == "conv_weight":
                p.copy_(normal(p.shape, 1 / math.sqrt(p.shape[1])))
            elif owner == "W_A":
                p.copy_(normal(p.shape, 0.9 / math.sqrt(p.shape[1])))
            elif owner == "W_B" and leaf == "weight":
                p.copy_(normal(p.shape, 1 / math.sqrt(p.shape[1])))
            elif leaf == "bias" or leaf == "conv_bias":
                p.zero_()
            elif owner in ("W_O", "W_proj", "W_down", "W_out", "W_C"):
                p.copy_(normal(p.shape, residual))
            else:
                p.copy_(normal(p.shape, std))
    return model


def random_stack(cfg: StackConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> StackLM:
    """A stack with random weights (`init_stack`), in eval mode, GPT-2's tokenizer when V = 50257."""
    model = init_stack(StackLM(cfg), seed).to(dtype)
    model.source = f"random-{cfg.family}(seed={seed})"
    if cfg.vocab_size == 50257:
        from hybridlm.tokenizer import gpt2_tokenizer

        model.tokenizer = gpt2_tokenizer()
    return model.eval()
