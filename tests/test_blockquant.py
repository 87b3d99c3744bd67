"""Affine maps on GGUF's block grids (hybridlm.lm.blockquant, kernels/blockquant.c) against gguf-py.

The reference is gguf-py's own dequantiser (`gguf.quants.dequantize`, the one llama.cpp's Python
tools use): the map's weights must be its bits, and its product the float64 product on them within
a bound from the arithmetic:

- float32 accumulation: (K + 64)·2⁻²⁴ Σ_k |x_k| (|Ŵ_k| + 2|M_k|), M the unit's minimum (the kernel
  forms D(c − z) x and M·X separately, each at most |Ŵ| + |M| in size; K + 64 roundings is more
  than any output's chain: the units' lanes, the sums X, the scales' products and the final sums);
- a token step's rows (≤ STEP_ROWS) take x in 16 bits per group of 32: |x̂ s − x| ≤ s/2 with
  s = max|x_g| / 32767, carried by the codes' part |Ŵ − M| only (the minima see the float sums),
  so Σ_k |Ŵ_k − M_k| s/2; and the kernel uses the unrounded D c + M where gguf-py rounds it,
  2⁻²⁴|Ŵ| each.

16 bits rather than float32: measured in docs/speed.md (the float32 input made the decode kernel
slower than memory). Relative to the product's size the input's part is about 2⁻¹⁶ of a group's
largest entry, against float32's 2⁻²⁴ of each entry.
"""

import copy
import pickle

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.errors import InputError
from hybridlm.lm import kernels
from hybridlm.lm.blockquant import BLOCKS, BlockQuantLinear, Rows, file_grid_linear
from hybridlm.lm.kernels import build
from hybridlm.lm.linear import Linear

F64 = torch.float64
EPS = 2.0**-24
TYPES = [T[name] for name in BLOCKS]
requires_kernel = pytest.mark.skipif(kernels.library() is None, reason=f"kernels unavailable: {kernels.status()}")

# Where each type keeps its half floats (scales, minima) and its codes, read off gguf-py's
# dequantisers; the codes of the types with a minimum are zeroed to read M alone.
HALVES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
          T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
CODES = {T.Q4_1: (4, 20), T.Q5_1: (4, 24), T.Q2_K: (16, 80), T.Q4_K: (16, 144), T.Q5_K: (16, 176)}
UNIT = {kind: 16 if kind in (T.Q2_K, T.Q3_K, T.Q6_K) else 32 for kind in TYPES}


def random_blocks(kind, N, K, seed, scale=0.02):
    """N rows of random valid blocks: random codes, scales and minima (every byte), half floats
    finite: normal numbers of mixed signs and sizes, and some zeros and subnormals."""
    rng = np.random.default_rng(seed)
    qk, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(N, K // qk, size), dtype=np.uint8)
    for at in HALVES[kind]:
        h = rng.standard_normal(raw.shape[:2]) * scale * np.exp(rng.uniform(-3, 1, raw.shape[:2]))
        h[rng.random(raw.shape[:2]) < 0.03] = 0.0
        h[rng.random(raw.shape[:2]) < 0.03] = 3e-6  # a subnormal half
        raw[:, :, at : at + 2] = h.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(N, -1)


def dequantized(raw, kind) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32))


def minima(raw, kind) -> torch.Tensor:
    """M of each weight's unit (0 for the types without one): gguf-py on the blocks with zero codes."""
    qk, size = gguf.GGML_QUANT_SIZES[kind]
    if kind not in CODES:
        return torch.zeros(raw.shape[0], raw.shape[1] // size * qk)
    blocks = raw.reshape(raw.shape[0], -1, size).copy()
    blocks[:, :, CODES[kind][0] : CODES[kind][1]] = 0
    return dequantized(blocks.reshape(raw.shape), kind)


def bound(W, M, x, b, step: bool) -> torch.Tensor:
    """|y − y_ref| allowed for rows x [R, K] against Ŵ [N, K] with minima M (see the module). Sums
    of magnitudes only, so float32 with 1 % to spare is exact enough."""
    K = W.shape[1]
    s = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1) / 32767  # [R, K]
    xs = x.abs() + (s / 2 if step else 0)
    out = (K + 64) * EPS * (xs @ (W.abs() + 2 * M.abs()).T)
    if step:
        out += (s / 2) @ ((W - M).abs() + EPS * W.abs()).T + EPS * (x.abs() @ W.abs().T)
    if b is not None:
        out += 2 * EPS * b.abs()
    return out.to(F64) * 1.01 + 1e-35


def sixteen_bits(R: int) -> bool:
    """Whether a product of R rows takes x in 16 bits (a token step's kernel, or the compiled
    prefill product), rather than the BLAS on dequantised blocks."""
    return R <= kernels.STEP_ROWS or (kernels.blockquant() is not None and kernels.blockquant().many_rows)


def inputs(R, K, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(R, K, generator=g) * torch.exp(torch.randn(R, 1, generator=g))
    x[:, torch.randint(0, K, (max(1, K // 50),), generator=g)] *= 30  # outlier features, as in LLM activations
    if K > 64:
        x[:, 32:64] = 0.0  # a group of zeros (s = 0)
    return x


# ---------------------------------------------------------------------- the weights
@requires_kernel
@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_the_weights_are_gguf_pys_bits(kind):
    """Ŵ from the compiled dequantiser (weight, rows) has gguf-py's bits, zeros' signs included."""
    qk = gguf.GGML_QUANT_SIZES[kind][0]
    for seed, (N, K) in enumerate([(1, qk), (7, 3 * qk), (64, 512 if qk == 256 else 96 * 4)]):
        raw = random_blocks(kind, N, K, seed)
        lin = BlockQuantLinear([(raw, kind, (N, K))])
        ref = dequantized(raw, kind)
        assert torch.equal(lin.weight.view(torch.int32), ref.view(torch.int32))
        ids = torch.tensor([[N - 1, 0], [N // 2, N - 1]])
        assert torch.equal(lin.rows(ids).view(torch.int32), ref[ids].view(torch.int32))


# ---------------------------------------------------------------------- the product
def check_product(kind, N, blocks, R, bias, seed):
    qk = gguf.GGML_QUANT_SIZES[kind][0]
    K = qk * blocks
    raw = random_blocks(kind, N, K, seed)
    b = torch.randn(N, generator=torch.Generator().manual_seed(seed)) if bias else None
    lin = BlockQuantLinear([(raw, kind, (N, K))], b)
    W = dequantized(raw, kind)
    x = inputs(R, K, seed)
    ref = x.to(F64) @ W.to(F64).T + (b.to(F64) if bias else 0)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (R, N)
    err = (y.to(F64) - ref).abs()
    allowed = bound(W, minima(raw, kind), x, b, sixteen_bits(R))
    assert (err <= allowed).all(), f"{kind.name}: worst {float((err / allowed).max()):.3g} of the bound"


@requires_kernel
@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_product_is_the_float_product_on_gguf_pys_weights(kind, data):
    """300 random shapes per type: N outputs, K = QK · blocks inputs, R rows (a token step's few,
    and a prefill's many), with and without bias."""
    qk = gguf.GGML_QUANT_SIZES[kind][0]
    check_product(kind, N=data.draw(st.integers(1, 70), "N"),
                  blocks=data.draw(st.integers(1, 3 if qk == 256 else 20), "blocks"),
                  R=data.draw(st.one_of(st.integers(1, 40), st.integers(41, 90)), "R"),
                  bias=data.draw(st.booleans(), "bias"), seed=data.draw(st.integers(0, 10**6), "seed"))


@requires_kernel
@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_the_product_is_batch_invariant(kind):
    """A row's bits do not depend on the rows beside it: alone, in any batch of a token step's size,
    at any place in it; and in a prefill's many rows, whatever the others."""
    qk = gguf.GGML_QUANT_SIZES[kind][0]
    K, N = 2 * qk if qk == 256 else 11 * qk, 45
    lin = BlockQuantLinear([(random_blocks(kind, N, K, 1), kind, (N, K))], torch.randn(N))
    x = inputs(kernels.STEP_ROWS, K, 2)
    alone = torch.cat([lin(x[r : r + 1]) for r in range(len(x))])
    for R in (2, 3, 5, 17, kernels.STEP_ROWS):
        perm = torch.randperm(kernels.STEP_ROWS, generator=torch.Generator().manual_seed(R))[:R]
        assert torch.equal(lin(x[perm]), alone[perm])
    assert torch.equal(lin(x.view(4, -1, 1, K)), alone.view(4, -1, 1, N))  # leading dimensions kept
    many = inputs(100, K, 3)
    first = lin(many[:70])
    assert torch.equal(lin(many)[:70], first) and torch.equal(lin(many.flip(0))[-70:], first.flip(0))


@requires_kernel
def test_nan_and_infinity_in_the_input_give_nan_where_they_reach():
    kind, K = T.Q5_0, 96
    lin = BlockQuantLinear([(random_blocks(kind, 8, K, 3), kind, (8, K))])
    x = inputs(3, K, 0)
    x[0, 40], x[1, 70] = float("nan"), float("inf")
    y = lin(x)
    assert y[:2].isnan().all() and y[2].isfinite().all()


# ---------------------------------------------------------------------- stacks, orders, the loader's entry
def test_a_stack_of_segments_of_different_types_is_one_map():
    """W_qkv stacked from three grids, one of them row-permuted at load: its weight is the segments'
    Ŵ in order, and its product their products side by side."""
    K = 512
    parts = [(random_blocks(T.Q4_K, 24, K, 0), T.Q4_K, (24, K), torch.arange(24).flip(0)),
             (random_blocks(T.Q5_0, 8, K, 1), T.Q5_0, (8, K)),
             (random_blocks(T.Q6_K, 8, K, 2), T.Q6_K, (8, K))]
    b = torch.randn(40)
    lin = file_grid_linear(parts, b)
    assert isinstance(lin, BlockQuantLinear) and lin.kinds == (T.Q4_K, T.Q5_0, T.Q6_K) and lin.splits == (24, 8, 8)
    W = torch.cat([dequantized(parts[0][0], T.Q4_K).flip(0), dequantized(parts[1][0], T.Q5_0),
                   dequantized(parts[2][0], T.Q6_K)])
    assert torch.equal(lin.weight, W)
    x = inputs(5, K, 4)
    alone = [BlockQuantLinear([Rows(*p)], b[i:j]) for p, i, j in zip(parts, (0, 24, 32), (24, 32, 40))]
    if kernels.library() is not None:  # each output the bits of its own segment's product
        assert torch.equal(lin(x), torch.cat([part(x) for part in alone], dim=-1))
    M = torch.cat([minima(p[0], p[1])[p[3]] if len(p) > 3 else minima(p[0], p[1]) for p in parts])
    assert ((lin(x).to(F64) - (x.to(F64) @ W.to(F64).T + b)).abs() <= bound(W, M, x, b, True)).all()
    assert torch.equal(lin.rows(torch.tensor([0, 23, 24, 39])), W[[0, 23, 24, 39]])


def test_a_segment_on_another_grid_makes_a_float32_linear():
    """F16 (or any type the kernel does not read) beside a block type: the map becomes a float32
    Linear holding the dequantised weights, permutation and bias included."""
    K = 64
    w16 = np.random.default_rng(0).standard_normal((4, K)).astype(np.float16)
    parts = [(random_blocks(T.Q8_0, 6, K, 0), T.Q8_0, (6, K)), (w16.view(np.uint8), T.F16, (4, K), [3, 2, 1, 0])]
    lin = file_grid_linear(parts, torch.arange(10.0))
    assert type(lin) is Linear
    W = torch.cat([dequantized(parts[0][0], T.Q8_0), torch.from_numpy(w16[::-1].astype(np.float32))])
    assert torch.equal(lin.weight, W) and torch.equal(lin.bias, torch.arange(10.0))


@pytest.mark.parametrize("parts, bias, message", [
    ([(np.zeros((2, 36), np.uint8), T.Q8_0, (2, 64))], None, "holds 72 uint8 elements: expected 136 bytes"),
    ([(np.zeros((2, 34), np.uint8), T.Q8_0, (2, 48))], None, "48 columns: expected a multiple of 32"),
    ([(np.zeros((2, 34), np.uint8), T.Q8_0, (2, 32)), (np.zeros((1, 68), np.uint8), T.Q8_0, (1, 64))], None,
     "one width"),
    ([(np.zeros((2, 34), np.uint8), T.Q8_0, (2, 32), [0, 0])], None, "not a permutation"),
    ([(np.zeros((2, 34), np.uint8), 99, (2, 32))], None, "ggml type 99"),
    ([(np.zeros((2, 34), np.uint8), T.Q8_0, (2, 32))], torch.zeros(3), r"bias of shape \(3,\): expected \(2,\)"),
    ([], None, "at least one segment"),
])
def test_bad_segments_are_one_line(parts, bias, message):
    with pytest.raises(InputError, match=message):
        BlockQuantLinear(parts, bias)


def test_without_the_library_the_map_is_the_same(monkeypatch):
    """No compiled kernel: Ŵ from gguf-py, the product in PyTorch (a step's rows one at a time)."""
    K, kind = 256, T.Q4_K
    raw = random_blocks(kind, 9, K, 5)
    b = torch.randn(9)
    x = inputs(3, K, 1)
    monkeypatch.setattr(kernels, "blockquant", lambda: None)
    monkeypatch.setattr(kernels, "affine", lambda: None)
    lin = BlockQuantLinear([(raw, kind, (9, K))], b)
    W = dequantized(raw, kind)
    assert torch.equal(lin.weight, W) and torch.equal(lin.rows(torch.tensor([8, 1])), W[[8, 1]])
    y = lin(x)
    assert torch.equal(y[1:2], lin(x[1:2]))
    assert ((y.to(F64) - (x.to(F64) @ W.to(F64).T + b)).abs() <= bound(W, minima(raw, kind), x, b, False)).all()


def test_pickles_copies_and_dtype_conversions():
    K, kind = 64, T.Q5_1
    lin = BlockQuantLinear([(random_blocks(kind, 5, K, 0), kind, (5, K))], torch.randn(5))
    x = inputs(2, K, 0)
    y = lin(x)
    for other in (pickle.loads(pickle.dumps(lin)), copy.deepcopy(lin)):
        assert torch.equal(other(x), y)
    half = copy.deepcopy(lin).to(torch.bfloat16)
    assert half.rows_0.dtype == torch.uint8 and half(x.bfloat16()).dtype == torch.bfloat16
    z = x.clone().requires_grad_(True)
    lin(z).sum().backward()  # autograd through x: the dequantised product
    assert torch.allclose(z.grad, lin.weight.sum(0).expand_as(z))


# ---------------------------------------------------------------------- builds
@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state with no kernel loaded yet, and an empty cache folder."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path))
    return tmp_path


def products(kinds=TYPES):
    """Every type's product and weights on a fixed case, with the library loaded now."""
    out = []
    for i, kind in enumerate(kinds):
        qk = gguf.GGML_QUANT_SIZES[kind][0]
        K = 2 * qk if qk == 256 else 13 * qk
        raw = random_blocks(kind, 21, K, i)
        lin = BlockQuantLinear([(raw, kind, (21, K))], torch.randn(21, generator=torch.Generator().manual_seed(i)))
        x = inputs(6, K, i)
        check_product(kind, 21, K // qk, 6, True, i)
        out.append((lin(x), lin.weight))
    return out


def test_the_portable_c_build_is_the_same_map(fresh, monkeypatch):
    """Without AVX2, FMA and F16C: plain loops, the same weights, the product within the same bound."""
    monkeypatch.setattr(build, "cpu_flags", list)
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    assert not lib.vectorised
    products()
    for kind in TYPES:
        check_product(kind, 5, 2, 33, False, 9)  # (a prefill: the dequantised blocks)


def test_avx2_and_avx512_builds_give_the_same_bits(fresh, monkeypatch):
    """AVX-512 changes the integer instructions only (VNNI's fused multiply-add, byte masks): every
    float operation is the AVX2 build's, so the bits are equal."""
    if kernels.library() is None or not build.source_flags("blockquant.c"):
        pytest.skip("no AVX-512 VNNI build here")
    wide = products()
    monkeypatch.setenv("HYBRIDLM_AVX512", "off")
    monkeypatch.setattr(kernels, "_state", {})
    assert not build.source_flags("blockquant.c")
    for (y, w), (y2, w2) in zip(wide, products()):
        assert torch.equal(y, y2) and torch.equal(w, w2)


# ---------------------------------------------------------------------- the compiled blocks
def grid_model():
    """A small Llama whose affine maps are block-quantised, each fused map a stack of grids as a
    Q4_K_M file has them (W_v and one W_down on other grids than their neighbours)."""
    from hybridlm import ModelConfig, load_model

    cfg = ModelConfig(vocab_size=200, n_ctx=64, d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_mlp=512,
                      eos_token_id=None, norm="rmsnorm", positions="rotary", mlp="swiglu", attn_bias=True,
                      attn_out_bias=False, mlp_bias=False)
    m = load_model(cfg, seed=3)
    kinds = {"W_qkv": (T.Q5_0, T.Q4_K, T.Q8_0), "W_O": (T.Q4_K,), "W_gate_up": (T.Q5_0, T.Q5_1), "W_down": (T.Q6_K,)}
    for layer, block in enumerate(m.blocks):
        for owner, name in ((block.attn, "W_qkv"), (block.attn, "W_O"), (block.mlp, "W_gate_up"),
                            (block.mlp, "W_down")):
            lin = getattr(owner, name)
            N, K = lin.weight.shape
            parts = kinds[name] if (layer, name) != (1, "W_down") else (T.Q4_K,)
            sizes = [N // 2, N // 4, N - N // 2 - N // 4] if len(parts) == 3 else [N // len(parts)] * len(parts)
            segments = [(random_blocks(kind, n, K, 7 * layer + i, scale=0.004), kind, (n, K))
                        for i, (kind, n) in enumerate(zip(parts, sizes))]
            setattr(owner, name, file_grid_linear(segments, None if lin.bias is None else lin.bias.detach() + 0.1))
    return m


@requires_kernel
def test_compiled_blocks_on_the_files_grids_are_the_staged_path(monkeypatch):
    """A token step's compiled blocks read the stacked segments (layer.c's Product): the same bits as
    the sublayers and the staged parts, one sequence, a batched state and a ragged batch."""
    from tests.test_step import trajectory, watching

    m = grid_model()
    calls = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks",
                        lambda self, *a, _f=kernels.BlockKernel.blocks, **k: calls.append(a[1]) or _f(self, *a, **k))
    fast, fast_kv = trajectory(m)
    assert calls and max(calls) == 2  # one call for both blocks
    for hooks in (watching(["hook_resid_mid"], range(2)), watching(["mlp.hook_pre_linear"], range(2))):
        logits, kv = trajectory(m, hooks)
        assert torch.equal(logits, fast) and all(torch.equal(a, b) for a, b in zip(kv, fast_kv))
