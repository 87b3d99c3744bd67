"""The GPT-2 family against transformers' GPT2LMHeadModel on the same random weights."""

import pytest
import torch

from hybridlm import ModelConfig, load_model, selection_P, selection_U
from hybridlm.lm.config import PRESETS
from hybridlm.weights.hub import save_gpt2_folder
from tests.conftest import make_hub_gpt2, perturb_

TOL = 1e-4


def max_delta(ours, ref, ids):
    with torch.no_grad():
        a = ours(ids)
        b = ref(ids).logits
    assert a.shape == b.shape == (*ids.shape, ours.config.vocab_size)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("n", [1, 17, 1024])
def test_toy_parity(toy_hub, toy_model, n):
    _, ref = toy_hub
    ids = torch.randint(0, 50257, (2, n), generator=torch.Generator().manual_seed(n))
    assert max_delta(toy_model, ref, ids) <= TOL


@pytest.fixture(scope="module")
def full_gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2_random")
    ref = make_hub_gpt2(folder, n_layer=12, n_embd=768, n_head=12, seed=2)
    return load_model(folder), ref


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 17, 1024])
def test_full_gpt2_config_parity(full_gpt2, n):
    ours, ref = full_gpt2
    assert ours.config == PRESETS["gpt2"].replace(init_std=ours.config.init_std)
    ids = torch.randint(0, 50257, (1, n), generator=torch.Generator().manual_seed(n))
    delta = max_delta(ours, ref, ids)
    print(f"gpt2 (random weights) n={n}: max |Δlogit| = {delta:.2e}")
    assert delta <= TOL


def test_our_layout_reads_back_in_transformers(tmp_path):
    """hybridlm's own random init, written in the hub layout, is read by transformers identically."""
    from transformers import GPT2LMHeadModel

    cfg = ModelConfig(vocab_size=50257, n_ctx=64, d_model=48, n_layer=3, n_head=3)
    ours = load_model(cfg, seed=5)
    perturb_(ours)  # give biases and gains non-trivial values too
    save_gpt2_folder(ours, tmp_path)
    ref = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 50257, (3, 40))
    assert max_delta(ours, ref, ids) <= TOL


def test_selection_matrices(toy_model):
    """U(s) W_e equals the embedding lookup, and U(s) W_e + P W_p equals H⁽⁰⁾."""
    s = [464, 3139, 286, 4881, 318, 6342, 13]
    U = selection_U(s, 50257)
    assert U.shape == (len(s), 50257) and torch.equal(U.sum(1), torch.ones(len(s)))
    assert torch.equal(U @ toy_model.W_e, toy_model.W_e[torch.tensor(s)])
    P = selection_P(len(s), toy_model.config.n_ctx)
    assert torch.equal(P.argmax(1), torch.arange(len(s)))
    pos = torch.arange(len(s))
    assert torch.allclose(toy_model.embed_explicit(s), toy_model.embed(torch.tensor([s]), pos)[0], atol=0, rtol=0)


def test_random_init_scheme():
    """GPT-2's init: N(0, 0.02²); residual projections N(0, (0.02/√(2L))²); seeded."""
    cfg = ModelConfig(vocab_size=1000, n_ctx=128, d_model=256, n_layer=8, n_head=8)
    a, b = load_model(cfg, seed=3), load_model(cfg, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.W_e, load_model(cfg, seed=4).W_e)
    assert a.W_e.std().item() == pytest.approx(0.02, rel=0.02)
    w_o = torch.cat([blk.attn.W_O.weight.flatten() for blk in a.blocks])
    assert w_o.std().item() == pytest.approx(0.02 / 4.0, rel=0.03)
    assert torch.all(a.blocks[0].ln1.weight == 1) and torch.all(a.blocks[0].attn.W_qkv.bias == 0)


def test_equation_views(toy_model):
    """Q = Z W_Q + b_Q with W_Q ∈ ℝ^{d×d}: the fused projection splits into the equation's matrices."""
    attn = toy_model.blocks[0].attn
    d = toy_model.config.d_model
    assert attn.W_Q.shape == attn.W_K.shape == attn.W_V.shape == (d, d)
    z = torch.randn(5, d)
    qkv = attn.W_qkv(z)
    assert torch.allclose(qkv[:, :d], z @ attn.W_Q + attn.W_qkv.bias[:d], atol=1e-5)
    assert torch.allclose(qkv[:, 2 * d :], z @ attn.W_V + attn.W_qkv.bias[2 * d :], atol=1e-5)
