"""The fast paths keep their promises: reduced precision agrees, batching changes nothing,
the explicit attention equals the fused one, a build without hook points equals the model.
No wall-clock time is asserted here; `hybridlm bench` measures speed."""

import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import Kernel, ModelConfig, load_model, token_clock
from hybridlm.lm import attention, linear
from hybridlm.engine.clock import generate_batch
from hybridlm.bench.run import _text_ids
from hybridlm.cli import cli
from hybridlm.errors import InputError
from hybridlm.bench.hookfree import without_hook_points
from hybridlm.lm.linear import Linear
from hybridlm.lm.quantize import Int8Linear, agreement, set_precision


def tiny(**changes):
    cfg = ModelConfig(vocab_size=300, n_ctx=512, d_model=64, n_layer=2, n_head=4, eos_token_id=None).replace(**changes)
    return load_model(cfg, seed=5)


# ---------------------------------------------------------------------- reduced precision
def test_int8_linear_is_the_closed_form():
    g = torch.Generator().manual_seed(0)
    W, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    lin = Int8Linear(W, b)
    s = W.abs().amax(1) / 127
    Q = torch.round(W / s[:, None])
    assert torch.equal(lin.Q.float(), Q)
    expected = (x.bfloat16().float() @ Q.T) * lin.scale.float() + b
    assert torch.allclose(lin(x), expected, rtol=2e-2, atol=2e-2)
    # half a step per channel, plus the rounding of the scale to bfloat16 (what the kernel reads)
    bound = s / 2 + 127 * (lin.scale.float() - s).abs() + 1e-6
    assert ((lin.weight - W).abs() <= bound[:, None]).all()


def test_reduced_precision_agrees_with_the_exact_path(smollm2):
    """Teacher-forced greedy agreement over a 200-token text (the issue's measure)."""
    ids = _text_ids(smollm2.tokenizer, smollm2.config.vocab_size, 200)
    int4 = set_precision(load_model(), "int4")
    assert agreement(int4, smollm2, ids)["agreement"] >= 0.98
    assert int4(torch.tensor([ids[:8]])).dtype == torch.float32  # the stream stays float32
    bf16 = set_precision(load_model(), "bfloat16")
    assert agreement(bf16, smollm2, ids)["agreement"] >= 0.93


def test_unknown_precision_is_an_input_error():
    with pytest.raises(InputError, match="precision 'fp8'"):
        set_precision(tiny(), "fp8")


# ---------------------------------------------------------------------- batching
def test_batched_generation_equals_unbatched_runs():
    m = tiny()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 7, 7, 12, 12)]
    seeds = [11, 12, 13, 14, 15]
    kernel = Kernel(temperature=0.9, top_k=50)
    stop = {7, 42, 99}  # some runs stop early, on their own
    batched = generate_batch(m, prompts, kernel=kernel, max_new_tokens=24, seeds=seeds, stop_ids=stop)
    for p, s, run in zip(prompts, seeds, batched):
        alone = list(token_clock(m, p, kernel=kernel, max_new_tokens=24, seed=s, stop_ids=stop))
        assert run.generated_ids == [x.token for x in alone]
        assert [round(x.logprob, 4) for x in run.steps] == [round(x.logprob, 4) for x in alone]
    assert len({len(r.steps) for r in batched}) > 1 or all(r.stop_reason == "token_budget" for r in batched)


def test_batched_generation_rejects_bad_input():
    m = tiny()
    with pytest.raises(InputError, match="one seed per prompt"):
        generate_batch(m, [[1, 2]], seeds=[1, 2])
    with pytest.raises(InputError, match="prompt 1 is empty"):
        generate_batch(m, [[1, 2], []])


# ---------------------------------------------------------------------- explicit attention
@settings(max_examples=10, deadline=None)
@given(n=st.integers(130, 300), start=st.integers(0, 40), window=st.sampled_from([None, 50]),
       kv=st.sampled_from([4, 2, 1]), one_block=st.sampled_from([0, 512]))
def test_explicit_attention_equals_fused(n, start, window, kv, one_block):
    """The explicit path (hooks on the pattern), in row blocks or as one block, and SDPA
    give the same logits."""
    m = tiny(n_kv_head=kv, attention_layers=["global", "local"], local_window=window or 512)
    ids = torch.randint(0, 300, (1, start + n), generator=torch.Generator().manual_seed(n))
    x = m.init_state(ids[:, :start]) if start else None
    ref = m(ids[:, start:], x.clone() if x is not None else None)
    seen = {}
    saved, attention._ONE_BLOCK = attention._ONE_BLOCK, one_block
    try:
        with m.hooks({"blocks.1.attn.hook_pattern": lambda a, h: seen.setdefault("A", a)}):
            out = m(ids[:, start:], x.clone() if x is not None else None)
    finally:
        attention._ONE_BLOCK = saved
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    A = seen["A"]
    assert torch.allclose(A.sum(-1), torch.ones(()), atol=1e-5)
    keys = torch.arange(start + n)
    assert (A[..., keys[None, :] > torch.arange(start, start + n)[:, None]] == 0).all()


def test_a_replaced_pattern_drives_the_output():
    m = tiny()
    ids = torch.randint(0, 300, (1, 140), generator=torch.Generator().manual_seed(0))
    def uniform(a, h):
        return torch.tril(torch.ones_like(a)) / torch.tril(torch.ones_like(a)).sum(-1, keepdim=True)

    with m.hooks({"blocks.0.attn.hook_pattern": uniform}):
        out = m(ids)
    assert not torch.allclose(out, m(ids))


# ---------------------------------------------------------------------- hook points
def test_a_build_without_hook_points_is_the_same_map():
    m = tiny()
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = m(ids)
    fired = []
    with without_hook_points(m):
        with m.hooks({"blocks.0.hook_resid_pre": lambda x, h: fired.append(1)}):
            out = m(ids)
    assert torch.equal(out, ref) and not fired
    with m.hooks({"blocks.0.hook_resid_pre": lambda x, h: fired.append(1)}):
        m(ids)
    assert fired  # restored


# ---------------------------------------------------------------------- the benchmark command
def test_bench_command_writes_its_figures(tmp_path, toy_hub):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", "--model", str(toy_hub[0]), "--quick", "--no-references", "--threads", "1",
                                 "--precisions", "bfloat16,int8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    for sec in ("decode", "prefill", "latency@16", "latency@64", "batch", "agreement", "memory", "hooks"):
        assert sec in report, sec
    assert set(report["agreement"]) == {"bfloat16", "int8"}
    assert report["decode"]["figures"]["hybridlm (float32)"]["median"] > 0
    assert report["memory"]["kv_bytes"]["hybridlm (float32)"] == 2 * 2 * 4 * 16 * 64 * 4  # 2·L·N_kv·d_k·n·4


def test_bench_command_rejects_bad_options():
    r = CliRunner().invoke(cli, ["bench", "--precisions", "fp8", "--no-references"])
    assert r.exit_code == 2 and "precision 'fp8'" in r.output
    r = CliRunner().invoke(cli, ["bench", "--contexts", "64,x"])
    assert r.exit_code == 2 and "contexts" in r.output


@pytest.mark.parametrize("kv", [4, 2])
def test_a_hooked_decode_step_equals_the_fused_one(kv):
    """One query row against the state (the decode step's explicit path) matches SDPA."""
    m = tiny(n_kv_head=kv)
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(kv))
    x = m.init_state(ids[:, :29])
    ref = m(ids[:, 29:], x.clone())
    seen = []
    with m.hooks({"blocks.1.attn.hook_pattern": lambda a, h: seen.append(a)}):
        out = m(ids[:, 29:], x.clone())
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert seen[0].shape == (2, 4, 1, 30) and torch.allclose(seen[0].sum(-1), torch.ones(()), atol=1e-6)


# ---------------------------------------------------------------------- the decode path
@pytest.mark.parametrize("kv", [4, 2, 1])
def test_decode_steps_equal_the_recomputed_map(kv):
    """A decode step (the g query heads of a key/value group read as g rows of one SDPA call)
    gives the logits of the full forward on the whole string."""
    m = tiny(n_kv_head=kv)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(kv))
    x = m.init_state(ids[:, :30])
    for i in range(30, 40):
        m.F(x, ids[:, i])
        assert torch.allclose(m.G(x), m(ids[:, : i + 1])[:, -1], atol=1e-5, rtol=1e-5)


def test_a_step_in_inference_mode_leaves_ordinary_tensors():
    """F runs in inference mode, yet its state and readout can be updated and differentiated later."""
    m = tiny()
    x = m.init_state(torch.arange(1, 12))
    m.F(x, [5])
    assert not x.kv.is_inference() and not x.tokens.is_inference() and not m.G(x).is_inference()
    m.G(x).add_(1.0)  # in place, outside inference mode
    with torch.no_grad():
        m(torch.tensor([[7]]), x)  # the state's buffers are written outside inference mode
    assert x.n == 13
    prefix = torch.zeros(2, m.config.d_model, requires_grad=True)
    m(torch.tensor([[7, 8]]), prefix=prefix).sum().backward()  # and autograd still works afterwards
    assert prefix.grad is not None and torch.isfinite(prefix.grad).all()


def test_column_major_weights_are_the_same_map():
    m = tiny()
    for module in m.modules():  # every affine map's W is loaded column-major, with no second copy
        if isinstance(module, Linear):
            W = module.weight
            assert W.stride() == (1, W.shape[0]) and W.t().is_contiguous()
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = m(ids)
    for module in m.modules():
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.contiguous()
    assert torch.allclose(m(ids), ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- a token step's products
_column_blocks = linear._column_blocks  # (the real one, under the spy below)


def test_a_long_block_in_column_blocks_is_the_one_product(monkeypatch):
    """Many rows: the product taken BLOCK_COLUMNS columns at a time gives the one product's
    numbers, for both weight layouts, with and without a bias; autograd keeps the one call."""
    blocks = []
    monkeypatch.setattr(linear, "_column_blocks", lambda *a: blocks.append(1) or _column_blocks(*a))
    g = torch.Generator().manual_seed(5)
    cols = 2 * linear.BLOCK_COLUMNS + 100  # two whole blocks and a part
    x = torch.randn(2, linear.STEP_ROWS, 64, generator=g)
    W, b = torch.randn(cols, 64, generator=g), torch.randn(cols, generator=g)
    with torch.no_grad():
        for weight in (W, W.t().contiguous().t()):
            for bias in (None, b):
                assert torch.equal(linear.affine(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
        assert len(blocks) == 4
        linear.affine(x[:, :1], W)  # few rows, or few columns: one product
        linear.affine(x, W[: linear.BLOCK_COLUMNS])
    assert len(blocks) == 4
    Wg = torch.nn.Parameter(W.clone())
    linear.affine(x, Wg, b).sum().backward()
    assert len(blocks) == 4 and torch.allclose(Wg.grad, x.reshape(-1, 64).sum(0).expand(cols, 64))
