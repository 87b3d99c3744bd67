"""The post-norm sphere block (0.39)–(0.41) as a block of the model, and the bridge from a layer's
weights to the flow on the sphere (0.42)–(0.44), checked against scipy's integration of the flow."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridlm import ModelConfig, load_model
from hybridlm.analysis.bridge import bridge, looped_layer, sphere_weights
from hybridlm.analysis.sphere import sphere_field, simulate_sphere
from hybridlm.errors import InputError
from hybridlm.lm.sphere_block import SphereBlock, select_block, to_sphere


def llama_like(**changes):
    cfg = ModelConfig(family="llama", vocab_size=97, n_ctx=64, d_model=32, n_layer=3, n_head=4, n_kv_head=2,
                      norm="rmsnorm", positions="rotary", mlp="swiglu", d_mlp=48, attn_bias=False,
                      attn_out_bias=False, mlp_bias=False, eos_token_id=None, init_std=0.2)
    return load_model(cfg.replace(**changes), seed=3)


def test_the_sphere_block_is_eqs_039_040_by_hand():
    model = select_block(llama_like(), "sphere")
    assert all(isinstance(b, SphereBlock) for b in model.blocks)
    r = math.sqrt(32)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(ids, names=lambda n: "resid" in n)
    pos = torch.arange(9)
    for ell, block in enumerate(model.blocks):
        z = cache["resid_pre", ell]
        y = z + block.attn(z, pos, None, model.rotary)
        y = r * y / y.norm(dim=-1, keepdim=True)  # (0.39)
        assert torch.allclose(cache["resid_mid", ell], y, atol=1e-5)
        out = y + block.mlp(y)
        assert torch.allclose(cache["resid_post", ell], r * out / out.norm(dim=-1, keepdim=True), atol=1e-5)  # (0.40)
        assert torch.allclose(cache["resid_post", ell].norm(dim=-1), torch.full((2, 9), r), atol=1e-4)


def test_a_sphere_model_decodes_as_it_recomputes():
    """The cached decode (blocks' own forwards, not the compiled run) gives the full recompute's logits."""
    model = select_block(llama_like(), "sphere")
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    x = model.init_state(ids[:, :8])
    for t in range(8, 12):
        model.F(x, ids[:, t])
        assert torch.allclose(model.G(x)[0], model(ids[:, : t + 1])[0, -1], atol=1e-4)


def test_an_unknown_block_is_named():
    with pytest.raises(InputError, match="block 'post'.*pre-norm, sphere"):
        select_block(llama_like(), "post")


def test_attention_of_a_layer_is_the_sphere_field_with_its_weights():
    """P_u A(r·u)/r (rotary off, no biases) equals (0.43)'s field with W_U^h = (W_V^h W_O^h)ᵀ and r²·W_P^h."""
    model = llama_like()
    attn = model.blocks[1].attn
    r = math.sqrt(32)
    u = to_sphere(torch.randn(7, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64), 1.0)
    with torch.no_grad():
        a = attn((r * u).float()[None], torch.arange(7), None, None)[0].double() / r
    projected = a - (a * u).sum(-1, keepdim=True) * u
    W_U, W_P, e = sphere_weights(attn)
    field = sphere_field(u.numpy(), W_U, r * r * W_P, e=e)
    assert np.abs(projected.numpy() - field).max() <= 1e-5 * max(1.0, np.abs(field).max())


def test_small_steps_of_the_looped_layer_tend_to_the_flow():
    """E after t/h steps u ← n(u + h·A/r) approaches scipy's E(t) of the flow as h → 0 (first order)."""
    model = llama_like()
    attn = model.blocks[0].attn
    r = math.sqrt(32)
    u0 = to_sphere(torch.randn(6, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64), 1.0)
    W_U, W_P, e = sphere_weights(attn)
    T = 2.0
    E_flow = simulate_sphere(u0.numpy(), W_U, r * r * W_P, t_end=T, n_eval=2, e=e).E[-1]
    errors = [abs(looped_layer(attn, u0.float(), int(T / h), step_size=h, radius=r)[-1] - E_flow) for h in (0.2, 0.05)]
    assert errors[1] < errors[0] / 2 and errors[1] < 0.05 * max(E_flow, 1e-3) + 1e-4, errors


def test_bridge_reports_both_curves_and_refuses_biases():
    model = llama_like()
    out = bridge(model, 1, list(range(5, 13)), steps=4, step_sizes=(1.0, 0.5))
    assert out["t"] == [0, 1, 2, 3, 4] and len(out["E_flow"]) == len(out["E_loop_h1"]) == len(out["E_loop_h0.5"]) == 5
    assert out["E_flow"][0] == pytest.approx(out["E_loop_h1"][0], rel=1e-5) and out["drift"] < 1e-5
    biased = llama_like(attn_bias=True)
    with torch.no_grad():
        biased.blocks[0].attn.W_qkv.bias.fill_(0.1)
    with pytest.raises(InputError, match="biases"):
        bridge(biased, 0, [1, 2, 3])


def test_consensus_runs_on_the_sphere_block(tmp_path, toy_hub):
    import json

    from click.testing import CliRunner

    from hybridlm.cli import cli

    out = tmp_path / "run"
    args = ["consensus", "--model", str(toy_hub[0]), "--block", "sphere", "--attention-only", "--prompts", "2",
            "--prompt-len", "8", "--passes", "2", "--device", "cpu", "--out", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["block"] == "sphere" and summary["layer_steps"] == 4
    r = CliRunner().invoke(cli, [*args[:3], "--block", "post", *args[5:]])
    assert r.exit_code == 2 and "'post'" in r.output


def test_write_bridge_puts_every_curve_in_the_csv_and_a_png(tmp_path):
    import csv

    from hybridlm.analysis.bridge import write_bridge

    out = bridge(llama_like(), 0, list(range(3, 9)), steps=3, step_sizes=(1.0, 0.5))
    csv_path, png = write_bridge(out, tmp_path)
    rows = list(csv.DictReader(open(csv_path)))
    assert [int(r["t"]) for r in rows] == [0, 1, 2, 3] and png.stat().st_size > 0
    for key in ("E_flow", "E_loop_h1", "E_loop_h0.5"):
        assert [float(r[key]) for r in rows] == pytest.approx(out[key], rel=1e-5)
