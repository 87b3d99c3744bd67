"""The int4 path's product against its closed form, its weights against GGUF's own
dequantisation, and the kernel's build, fallbacks and threads.

The closed form is written here from the layout alone: Ŵ[o, 32g + j] = d q + m with q of input
i of a group in the low nibble of byte i and of input i + 16 in the high one. Error bounds come
from the arithmetic: float32 accumulation (γ_K = K·2⁻²⁴ of Σ|Ŵ||x|) and, in the kernel, the
16-bit input (|x̂ s − x| ≤ s/2 with s = max|x| / 32767 per group of 32).
"""

import copy
import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import kernels
from hybridlm.errors import InputError
from hybridlm.quantize import Int4Linear, _aten_int4_kernel, set_precision

F64 = torch.float64
requires_kernel = pytest.mark.skipif(kernels.int4() is None, reason=f"int4 kernel unavailable: {kernels.int4_status()}")


def closed_form(lin: Int4Linear) -> torch.Tensor:
    """Ŵ in float64 from the stored codes, scales and offsets."""
    N, K = lin.out_features, lin.in_features
    p = lin.packed.view(N, K // 32, 16).long()
    q = torch.cat([p & 0x0F, p >> 4], dim=-1).to(F64)
    return (lin.d.to(F64)[..., None] * q + lin.m.to(F64)[..., None]).view(N, K)


def accumulation_bound(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """γ_K Σ_k |Ŵ_ok| |x_k|, with K + 2 roundings per entry (float32)."""
    K = W.shape[1]
    return (K + 2) * 2.0**-24 * (x.abs().to(F64) @ W.abs().T) * 1.01


def input_bound(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """Σ_g d_g (s_g / 2) Σ_j q_gj: the 16-bit input's rounding, carried through the weights."""
    N, K = lin.out_features, lin.in_features
    p = lin.packed.view(N, K // 32, 16).long()
    q_sum = (torch.cat([p & 0x0F, p >> 4], dim=-1)).sum(-1).to(F64)  # [N, G]
    s = x.to(F64).view(x.shape[0], K // 32, 32).abs().amax(-1) / 32767  # [R, G]
    return (s / 2) @ (lin.d.to(F64) * q_sum).T * 1.01


def weights(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(N, 1, generator=g) * 2 + 0.01  # channels of different scales
    return torch.randn(N, K, generator=g) * rows, torch.randn(N, generator=g)


def inputs(R, K, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(R, K, generator=g)
    x[:, torch.randint(0, K, (max(1, K // 50),), generator=g)] *= 30  # outlier features, as in LLM activations
    return x


# ---------------------------------------------------------------------- the map
@requires_kernel
@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 70), groups=st.integers(1, 20), R=st.integers(1, 40), bias=st.booleans(),
       seed=st.integers(0, 10**6))
def test_kernel_is_the_closed_form_within_its_rounding(N, groups, R, bias, seed):
    """A token step's rows (≤ 32: the kernel, 16-bit input) and a prefill's (the dequantised
    blocks through the BLAS) both compute x Ŵᵀ + b, each within its own rounding."""
    K = 32 * groups
    W, b = weights(N, K, seed)
    lin = Int4Linear(W, b if bias else None)
    x = inputs(R, K, seed)
    W_hat = closed_form(lin)
    ref = x.to(F64) @ W_hat.T + (b.to(F64) if bias else 0)
    bound = accumulation_bound(W_hat, x) + (input_bound(lin, x) if R <= 32 else 0) + 1e-30
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (R, N)
    assert ((y.to(F64) - ref).abs() <= bound).all()


@requires_kernel
def test_kernel_keeps_leading_dimensions_and_empty_inputs():
    W, b = weights(40, 96, 0)
    lin = Int4Linear(W, b)
    x = inputs(6, 96, 0).view(2, 3, 96)
    assert torch.equal(lin(x), lin(x.reshape(6, 96)).view(2, 3, 40))
    assert torch.equal(lin(x.transpose(0, 1)), lin(x.transpose(0, 1).contiguous()))  # a strided input
    assert lin(torch.empty(0, 96)).shape == (0, 40)


def test_q4_1_grid_comes_back_exactly():
    """Weights on a Q4_1 grid (float16 d and m, every group spanning 0..15) are stored without loss."""
    g = torch.Generator().manual_seed(1)
    N, K = 64, 96
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.1 + 0.01).half().float()
    m = (-torch.rand(N, K // 32, 1, generator=g)).half().float()
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    W = (d * q + m).view(N, K)
    lin = Int4Linear(W, None)
    assert torch.equal(lin.weight, W)
    assert torch.equal(closed_form(lin).float(), W)


def test_smollm2_q4_1_tensors_are_the_gguf_files_own(smollm2):
    """Every affine map of SmolLM2 that the GGUF file holds in Q4_1 (dequantised by the gguf
    package) is represented by the int4 path without new loss."""
    for block in smollm2.blocks[:: len(smollm2.blocks) // 5]:
        for lin in (block.attn.W_qkv, block.attn.W_O, block.mlp.W_gate_up, block.mlp.W_down):
            W = lin.weight.detach()
            assert torch.equal(Int4Linear(W, None).weight, W)


def test_weights_beyond_float16_are_an_input_error():
    with pytest.raises(InputError, match="float16's range"):
        Int4Linear(torch.full((4, 32), 1e6) * torch.arange(32.0), None)


def test_a_flat_group_keeps_its_value():
    W = torch.full((3, 64), 0.25)
    W[1, 32:] = -2.0
    assert torch.equal(Int4Linear(W, None).weight, W)


# ---------------------------------------------------------------------- the other paths
def test_every_product_path_is_the_same_map(monkeypatch):
    """The kernel, PyTorch's int4 kernel (where the library cannot be built) and the
    dequantised product (autograd through x, other devices) give x Ŵᵀ + b, each within the
    rounding of what it reads (PyTorch's kernel reads x and returns y in bfloat16)."""
    W, b = weights(48, 128, 3)
    x = inputs(4, 128, 3)
    lin = Int4Linear(W, b)
    W_hat = closed_form(lin)
    ref = x.to(F64) @ W_hat.T + b.to(F64)
    gamma = accumulation_bound(W_hat, x)

    x_grad = x.clone().requires_grad_(True)
    y = lin(x_grad)  # the dequantised product, differentiable in x
    assert ((y.detach().to(F64) - ref).abs() <= gamma).all()
    y.sum().backward()
    assert torch.allclose(x_grad.grad.to(F64), W_hat.sum(0).expand(4, -1), rtol=1e-6, atol=1e-6)

    if kernels.int4() is not None:
        assert ((lin(x).to(F64) - ref).abs() <= gamma + input_bound(lin, x)).all()
    if _aten_int4_kernel():
        monkeypatch.setattr(kernels, "_state", {"why": "a test's choice"})
        monkeypatch.setattr(kernels, "int4", lambda: None)
        with pytest.warns(UserWarning, match="int4 kernel is unavailable"):
            aten = Int4Linear(W, b)
        assert aten.aten_packed is not None
        bf16 = 2.0**-8 * ((x.abs().to(F64) @ W_hat.abs().T) + ref.abs()) * 1.1 + gamma
        assert ((aten(x).to(F64) - ref).abs() <= bf16).all()


def test_an_int4_model_pickles_and_copies(smollm2):
    """The modules hold tensors only (the compiled library is looked up per call)."""
    from hybridlm import load_model

    m = set_precision(load_model(smollm2.config.replace(n_layer=1), seed=0), "int4")
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = m(ids)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(buf, weights_only=False)):
        assert torch.equal(twin(ids), ref)


# ---------------------------------------------------------------------- build and threads
@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state with no kernel loaded yet, and an empty cache folder."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path))
    return tmp_path


def test_the_kernel_is_built_once_into_the_cache(fresh):
    k = kernels.int4()
    if k is None:
        pytest.skip(kernels.int4_status())
    assert k.path.parent == fresh / "kernels" and k.path.exists()
    assert "hybridlm's int4 kernel" in kernels.int4_status()
    stamp = k.path.stat().st_mtime_ns
    kernels._state.clear()
    assert kernels.int4().path == k.path and k.path.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_torch_can_be_chosen_and_a_bad_choice_is_named(fresh, monkeypatch):
    monkeypatch.setenv("HYBRIDLM_INT4_KERNEL", "torch")
    assert kernels.int4() is None and "HYBRIDLM_INT4_KERNEL=torch" in kernels.int4_status()
    kernels._state.clear()
    monkeypatch.setenv("HYBRIDLM_INT4_KERNEL", "fast")
    with pytest.raises(InputError, match="HYBRIDLM_INT4_KERNEL='fast'"):
        kernels.int4()


def test_without_a_compiler_the_path_falls_back(fresh, monkeypatch):
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    assert kernels.int4() is None and "no C compiler" in kernels.int4_status()


def test_a_failed_build_is_named_and_the_path_still_works(fresh, monkeypatch):
    broken = fresh / "int4.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(kernels, "_SOURCE", broken)
    if kernels.shutil.which("cc") is None and kernels.shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    W, b = weights(8, 64, 0)
    with pytest.warns(UserWarning, match="build failed"):
        lin = Int4Linear(W, b)  # on PyTorch's kernel, or the dequantised product
    assert kernels.int4() is None and "build failed" in kernels.int4_status()
    x = inputs(2, 64, 0)
    assert torch.allclose(lin(x), x @ lin.weight.T + b, rtol=2e-2, atol=0.2)


@requires_kernel
def test_torch_set_num_threads_governs_the_kernel():
    """The kernel's loops run on PyTorch's own OpenMP runtime: its team follows
    torch.set_num_threads (a second runtime would keep its own count, and its own pool)."""
    k, threads = kernels.int4(), torch.get_num_threads()
    if kernels._torch_openmp() is None:
        pytest.skip("PyTorch here maps no OpenMP runtime")
    try:
        for n in (1, 3, 2):
            torch.set_num_threads(n)
            assert k.team() == n
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_cache_file_is_built_again(fresh, monkeypatch):
    k = kernels.int4()
    if k is None:
        pytest.skip(kernels.int4_status())
    other = fresh / "other"  # (a path this process has not loaded yet)
    damaged = other / "kernels" / k.path.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setenv("HYBRIDLM_CACHE", str(other))
    kernels._state.clear()
    assert kernels.int4().path == damaged and damaged.read_bytes()[:4] == b"\x7fELF"
