"""The MLP-question grid: each run is the looped model of its (size, σ, block), E as (0.45) computes it by hand."""

import math

import pytest
import torch

from hybridlm.analysis.mlp_question import one_run
from hybridlm.lm.config import preset
from hybridlm.lm.sphere_block import select_block
from hybridlm.weights.loading import load_model


def by_hand(z):
    u = z / z.norm(dim=-1, keepdim=True)
    return float((1 - (u[:, :1] * u).sum(-1)).mean())  # 1 − (1/n) Σ_i cos(z_1, z_i), averaged over prompts


def test_one_run_is_the_sphere_blocks_applied_pass_after_pass():
    E = one_run("tiny (L=4, d=256)", 0.2, "sphere", passes=2, prompts=2, prompt_len=6, seed=0)
    assert len(E) == 1 + 2 * 4
    model = select_block(load_model(preset("gpt2").replace(n_layer=4, d_model=256, n_head=4, n_kv_head=4, init_std=0.2),
                                    seed=0), "sphere")
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)
    with torch.no_grad():
        z = model.embed(ids, pos)
        expected = [by_hand(z)]
        for _ in range(2):
            for block in model.blocks:
                y = z + block.attn(z, pos, None, None)
                y = math.sqrt(256) * y / y.norm(dim=-1, keepdim=True)
                z = y + block.mlp(y)
                z = math.sqrt(256) * z / z.norm(dim=-1, keepdim=True)
                expected.append(by_hand(z))
    assert E == pytest.approx(expected, abs=1e-5)
