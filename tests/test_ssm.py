"""Recurrent and selective state-space stacks (docs/theory.md §5.4, the survey's (S16)–(S17)): scan, state,
decode, consensus, training."""

import csv
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.analysis import consensus as C
from hybridlm.analysis import runner as R
from hybridlm.errors import ConfigError, InputError
from hybridlm.ssm import SSMState, StackConfig, StackLM, parallel_scan, random_stack, recurrence
from hybridlm.ssm.train import latest_key_batch, train_demo

torch.set_num_threads(1)


def tiny(layers="SSSS", **changes):
    cfg = StackConfig(layers=layers, vocab_size=120, n_ctx=256, d_model=32, n_head=4, d_state=4,
                      eos_token_id=None).replace(**changes)
    return random_stack(cfg, seed=3)


def naive_scan(a, b, c0):
    """Independent reference: the recursion c_i = a_i c_{i−1} + b_i written out index by index."""
    out = torch.empty_like(b)
    for batch in range(b.shape[0]):
        c = c0[batch].clone()
        for i in range(b.shape[1]):
            c = a[batch, i] * c + b[batch, i]
            out[batch, i] = c
    return out


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 70), width=st.integers(1, 6), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float64]), with_c0=st.booleans())
def test_parallel_scan_equals_recurrence(n, width, seed, dtype, with_c0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(2, n, width, 3, generator=g, dtype=dtype)  # Ā = exp(ΔA) ∈ (0, 1)
    b = torch.randn(2, n, width, 3, generator=g, dtype=dtype)
    c0 = torch.randn(2, width, 3, generator=g, dtype=dtype) if with_c0 else None
    scan = parallel_scan(a, b, c0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert (scan - recurrence(a, b, c0)).abs().max() <= tol
    ref = naive_scan(a, b, c0 if with_c0 else torch.zeros_like(b[:, 0]))
    assert (scan - ref).abs().max() <= tol


def test_scan_inside_the_model_equals_stepwise_decode_of_the_state():
    """hook_state of a prefill (parallel scan) equals c(k, i) reached token by token (recurrence)."""
    m = tiny("SS")
    ids = torch.randint(0, 120, (2, 40))
    _, cache = m.run_with_cache(ids, names="blocks.1.ssm.hook_state")
    x = m.init_state(ids[:, :1])
    states = [x.c[1].clone()]
    for i in range(1, 40):
        m.F(x, ids[:, i])
        states.append(x.c[1].clone())
    assert (cache["blocks.1.ssm.hook_state"] - torch.stack(states, 1)).abs().max() <= 1e-5


@pytest.mark.parametrize("layers", ["SSS", "RRR", "SARA", "ASSA"])
def test_decode_equals_full_forward(layers):
    """Cached == recomputed: F/G token by token, and a prefill continued by a block, match forward."""
    m = tiny(layers)
    ids = torch.randint(0, 120, (3, 24))
    full = m(ids)
    x = m.init_state(ids[:, :6])
    logits = [m.G(x)]
    for i in range(6, 18):
        m.F(x, ids[:, i])
        logits.append(m.G(x))
    m.F(x, ids[:, 18:])  # a multi-token block continues the state (prefill from a non-empty state)
    logits.append(m.G(x))
    expect = torch.cat([full[:, 5:18], full[:, -1:]], dim=1)
    assert torch.allclose(torch.stack(logits, 1), expect, atol=1e-5)
    assert x.n == 24 and torch.equal(x.tokens, ids)


def test_state_size_is_flat_in_context_length():
    m = tiny("SSRS")
    short, long = m.init_state(torch.randint(0, 120, (1, 10))), m.init_state(torch.randint(0, 120, (1, 200)))
    assert short.nbytes() == long.nbytes() > 0 and short.dim == long.dim
    h = tiny("SSAS")  # a hybrid's attention blocks still grow with n
    assert h.init_state(torch.randint(0, 120, (1, 200))).nbytes() > h.init_state(torch.randint(0, 120, (1, 10))).nbytes()


def test_clone_is_independent_and_horizon_rebuilds():
    m = tiny("SA", n_ctx=16)
    ids = torch.randint(0, 120, (1, 20))
    x = m.init_state(ids[:, :10])
    y = x.clone()
    m.F(x, ids[:, 10])
    assert y.n == 10 and not torch.equal(x.c[0], y.c[0])
    for i in range(11, 20):
        m.F(x, ids[:, i])
    assert x.rebuilds >= 1 and x.n == 16
    assert torch.allclose(m.G(x), m(ids[:, -16:])[:, -1], atol=1e-5)  # == recompute of Π_T(s)


@pytest.mark.parametrize("layers", ["SS", "RS", "SA"])
def test_batched_equals_unbatched(layers):
    m = tiny(layers)
    ids = torch.randint(0, 120, (3, 15))
    batched = m(ids)
    for b in range(3):
        assert torch.allclose(batched[b], m(ids[b])[0], atol=1e-5)


def test_hook_points_follow_the_transformer_names():
    m = tiny("SRA")
    for name in ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.0.ssm.hook_state",
                 "blocks.1.rnn.hook_state", "blocks.2.attn.hook_pattern", "hook_embed", "hook_logits"]:
        m.hook_point(name)
    ids = torch.randint(0, 120, (2, 9))
    _, cache = m.run_with_cache(ids, names=["blocks.0.ssm.hook_state", "blocks.1.rnn.hook_state"])
    assert cache["blocks.0.ssm.hook_state"].shape == (2, 9, 64, 4)
    assert cache["blocks.1.rnn.hook_state"].shape == (2, 9, 32)


@pytest.mark.parametrize("layers", ["SSS", "SSA"])
def test_consensus_runner_on_stacks(tmp_path, monkeypatch, layers):
    model = tiny(layers)
    monkeypatch.setattr(R, "prepare_model", lambda cfg, device: model)
    cfg = R.ConsensusConfig(model=layers, weights="random-redrawn", prompts=2, prompt_len=8, passes=2, seed=1)
    summary = R.run_consensus(cfg, tmp_path / layers, progress=False)
    rows = list(csv.DictReader(open(tmp_path / layers / "consensus.csv")))
    assert list(rows[0]) == R.COLUMNS and len(rows) == 1 + 2 * 3
    E = [float(r["E_mean"]) for r in rows]
    assert all(math.isfinite(e) and 0 <= e <= 2 for e in E)
    assert summary["shape"]["family"] == ("ssm" if layers == "SSS" else "hybrid")
    steps = list(C.looped(model, C.embed(model, torch.randint(0, 120, (1, 6))), passes=1, attention_only=True))
    assert len(steps) == 4 and all(math.isfinite(float(s.E)) for s, _ in steps)
    png = R.plot_compare({"a": tmp_path / layers, "b": tmp_path / layers}, tmp_path / "cmp.png")
    assert png.stat().st_size > 1000


def test_first_pass_is_the_forward_map():
    m = tiny("SRA")
    ids = torch.randint(0, 120, (2, 10))
    _, cache = m.run_with_cache(ids, names=lambda n: n.endswith("hook_resid_post"))
    for step, h in list(C.looped(m, C.embed(m, ids), passes=1))[1:]:
        assert torch.allclose(h, cache[f"blocks.{step.layer}.hook_resid_post"], atol=1e-6)


def test_redraw_uses_the_stack_initialisation():
    m = tiny("SA")
    C.redraw(m, 5)
    a = m.blocks[0].ssm.W_in.weight.clone()
    assert torch.allclose(m.blocks[0].ssm.A[0], -torch.arange(1, 5.0))  # S4D-real A = −(1..N)
    C.redraw(m, 6)
    assert not torch.equal(a, m.blocks[0].ssm.W_in.weight)
    C.redraw(m, 5)
    assert torch.equal(a, m.blocks[0].ssm.W_in.weight)


def test_training_demo_learns_the_latest_key():
    ids, target = latest_key_batch(2, 12, generator=torch.Generator().manual_seed(0))
    assert (ids[:, 0] < 8).all() and ((target < 8) & ((ids >= 8) | (ids == target))).all()
    r = train_demo(steps=120, batch=8, n=32, eval_batch=32, seed=0)
    assert r.initial_loss > 0.8 * r.chance
    assert r.final_loss < 0.25 * r.chance  # chance: ln 8 ≈ 2.08


def test_bad_input_raises_named_errors():
    m = tiny("SS")
    with pytest.raises(InputError, match="empty"):
        m(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InputError, match="120"):
        m(torch.tensor([[1, 120]]))
    with pytest.raises(InputError, match="-1"):
        m.init_state([3, -1])
    with pytest.raises(InputError, match="empty"):
        m.G(m.empty_state())
    with pytest.raises(ConfigError, match="'X'"):
        StackConfig(layers="SXA")
    with pytest.raises(ConfigError, match="layers"):
        StackConfig(layers="")


def test_load_model_specs():
    from hybridlm.errors import ModelNotFoundError
    from hybridlm.weights.loading import _random_stack

    with pytest.raises(ModelNotFoundError, match="huge"):
        _random_stack("random-ssm:huge", seed=0, dtype=torch.float32)
    assert isinstance(SSMState, type) and issubclass(StackLM, torch.nn.Module)


def test_state_norm_plot(tmp_path):
    from hybridlm.ssm.plots import plot_state_norms, state_norms

    m = tiny("SRA")
    ids = torch.randint(0, 120, (2, 16))
    norms = state_norms(m, ids)
    assert sorted(norms) == [0, 1] and norms[0].shape == (16,) and (norms[0] > 0).all()
    assert plot_state_norms(m, ids, tmp_path / "norms.png").stat().st_size > 1000
