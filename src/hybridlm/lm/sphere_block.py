"""The post-norm block on the sphere: the block the survey's consensus theory is about
(docs/theory.md §5.3, the survey's (0.39)–(0.41)).

    y_i    = n(z_i + A_i(Z))            (0.39)   attention, then the normalisation
    z_i⁺   = n(y_i + MLP(y_i))          (0.40)   the MLP, then the normalisation
    z_i⁺   = n(z_i + A_i(Z))            (0.41)   attention only

with n(x) = r·x/‖x‖ the projection onto the sphere of radius r. The sublayers read the tokens as
they are (no norm before them: the tokens already lie on the sphere). r = √d by default, the
radius on which a pre-LN model's sublayers read their inputs (an RMSNorm without its gain), so
the same weights see inputs of the size they were made for; E of (0.45), a cosine, does not
depend on r.

`use_sphere_blocks(model)` makes every block of a model (pretrained or random) this block, in
place, keeping its attention and MLP and the names of its residual-stream hook points
(`blocks.{layer}.hook_resid_pre`, `hook_attn_out`, `hook_resid_mid`, `hook_mlp_out`,
`hook_resid_post`; resid_mid is y, on the sphere). The compiled token step does not compute it, so
its blocks take their own forward.
"""

from __future__ import annotations

import math

import torch

from hybridlm.errors import InputError
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.hooks import HookPoint

BLOCKS = ("pre-norm", "sphere")


def to_sphere(x: torch.Tensor, radius: float) -> torch.Tensor:
    """n(x) = r·x/‖x‖ over the last axis."""
    return x * (radius / x.norm(dim=-1, keepdim=True))


class SphereBlock(DirectModule):
    """Block ℓ as (0.39)–(0.40): attention and MLP each followed by n, no norm before them."""

    def __init__(self, attn, mlp, layer: int, radius: float) -> None:
        super().__init__()
        self.layer, self.radius = layer, radius
        self.attn, self.mlp = attn, mlp
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, h, pos, state=None, rotary=None, step=None):
        h = self.hook_resid_pre(h)
        h = self.hook_resid_mid(to_sphere(h + self.hook_attn_out(self.attn(h, pos, state, rotary)), self.radius))
        return self.hook_resid_post(to_sphere(h + self.hook_mlp_out(self.mlp(h)), self.radius))

    def attention_only_step(self, h, pos, rotary=None):
        """(0.41): z⁺ = n(z + A(Z)), the MLP left out (the looped model's attention-only layer-step)."""
        h = self.hook_resid_pre(h)
        return self.hook_resid_post(to_sphere(h + self.hook_attn_out(self.attn(h, pos, None, rotary)), self.radius))


def use_sphere_blocks(model, radius: float | None = None):
    """Every block of `model` becomes a `SphereBlock` with its own attention and MLP, in place; returns
    the model. radius: r of n (default √d)."""
    from hybridlm.lm.model import Block

    r = math.sqrt(model.config.d_model) if radius is None else float(radius)
    if not (math.isfinite(r) and r > 0):
        raise InputError(f"radius {radius!r}: expected a positive number")
    for i, block in enumerate(model.blocks):
        if isinstance(block, SphereBlock):
            block.radius = r
            continue
        if not isinstance(block, Block):
            raise InputError(f"block {i} is a {type(block).__name__}: the sphere block replaces a transformer block")
        model.blocks[i] = SphereBlock(block.attn, block.mlp, block.layer, r)
    model.setup_hooks()
    return model


def select_block(model, kind: str):
    """The model with blocks of `kind` (`BLOCKS`): "pre-norm" leaves it as loaded, "sphere" makes every
    block the post-norm sphere block."""
    if kind not in BLOCKS:
        raise InputError(f"block {kind!r}: expected one of {', '.join(BLOCKS)}")
    return use_sphere_blocks(model) if kind == "sphere" else model
