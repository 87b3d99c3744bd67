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

from hybridlm.errors import InputError
from hybridlm.lm import kernels
from hybridlm.lm.kernels import build
from hybridlm.lm.quantize import Int4Linear, _aten_int4_kernel, set_precision

F64 = torch.float64
requires_kernel = pytest.mark.skipif(kernels.library() is None, reason=f"kernels unavailable: {kernels.status()}")


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
def check_int4(N, groups, R, bias, seed):
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
@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 70), groups=st.integers(1, 20), R=st.integers(1, 40), bias=st.booleans(),
       seed=st.integers(0, 10**6))
def test_kernel_is_the_closed_form_within_its_rounding(N, groups, R, bias, seed):
    check_int4(N, groups, R, bias, seed)


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


def test_dtype_conversions_leave_the_codes_and_scales_alone():
    """`.double()`, `.half()`, `.to(bfloat16)` convert floating buffers; the int4 layer keeps
    its codes and the bits of its float16 scales as integers, so it computes the same map."""
    W, b = weights(32, 64, 4)
    lin = Int4Linear(W, b)
    x = inputs(3, 64, 4)
    y = lin(x)
    for twin in (copy.deepcopy(lin).double(), copy.deepcopy(lin).half(), copy.deepcopy(lin).to(torch.bfloat16)):
        assert torch.equal(twin.d, lin.d) and torch.equal(twin.m, lin.m) and torch.equal(twin.packed, lin.packed)
        assert torch.allclose(twin(x.to(twin.bias.dtype)).float(), y, rtol=2e-2, atol=0.3)
    assert torch.equal(copy.deepcopy(lin).double().float()(x), y)  # (float64 holds the bias exactly)


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
        monkeypatch.setattr(kernels, "library", lambda: None)
        monkeypatch.setattr(kernels, "int4", lambda: None)
        with pytest.warns(UserWarning, match="kernels are unavailable"):
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


# ---------------------------------------------------------------------- decode attention
def attention_case(B, H, H_kv, d, n, rotary, window, scale, seed):
    """An attention sublayer (W_O taken out, so its output is O) and two copies of a random
    state holding n positions."""
    from hybridlm.lm.attention import Attention
    from hybridlm.lm.config import ModelConfig
    from hybridlm.lm.positions import Rotary
    from hybridlm.lm.state import KVState

    cfg = ModelConfig(vocab_size=50, n_ctx=512, d_model=H * d, n_layer=1, n_head=H, n_kv_head=H_kv,
                      positions="rotary" if rotary else "learned", attn_scale=scale,
                      attention_layers=("local",) if window else None, local_window=window or 256)
    g = torch.Generator().manual_seed(seed)
    attn = Attention(cfg, 0)
    with torch.no_grad():
        attn.W_qkv.weight.copy_(torch.randn(attn.W_qkv.weight.shape, generator=g) / d**0.5)
        attn.W_qkv.bias.copy_(torch.randn(attn.W_qkv.bias.shape, generator=g))
    attn.W_O = torch.nn.Identity()
    states = []
    for _ in range(2):
        x = KVState(cfg, B, capacity=n + 1)
        x.kv[..., :n, :] = torch.randn(x.kv[..., :n, :].shape, generator=torch.Generator().manual_seed(seed + 1))
        x.n = n
        states.append(x)
    z = torch.randn(B, 1, H * d, generator=g)
    return attn, (Rotary(cfg) if rotary else None), states, z


def closed_form_attention(attn, rotary, state, z, n):
    """O of one decode step in float64 from the state's rows 0..n−1 and the new row."""
    B, H, H_kv, d = z.shape[0], attn.n_head, attn.n_kv_head, attn.d_head
    heads = attn.W_qkv(z).view(B, H + 2 * H_kv, d).to(F64)
    q, k, v = heads[:, :H], heads[:, H:H + H_kv], heads[:, H + H_kv:]
    if rotary is not None:
        cos, sin = rotary.cos[n].to(F64), rotary.sin[n].to(F64)
        swap = lambda t: torch.cat([t[..., d // 2:], t[..., : d // 2]], -1)  # noqa: E731 - a one-line helper of the test
        q, k = q * cos + swap(q) * sin, k * cos + swap(k) * sin
    K = torch.cat([state.kv[0, 0, :, :, :n].to(F64), k[:, :, None]], 2)  # [B, H_kv, n + 1, d]
    V = torch.cat([state.kv[0, 1, :, :, :n].to(F64), v[:, :, None]], 2)
    start = n + 1 - attn.window if attn.window is not None and n + 1 > attn.window else 0
    K, V = K[:, :, start:], V[:, :, start:]
    group = H // H_kv
    Kq, Vq = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)  # [B, H, keys, d]
    s = (q[:, :, None] * Kq).sum(-1) * attn.scale  # [B, H, keys]
    o = (torch.softmax(s, -1)[..., None] * Vq).sum(-2)  # [B, H, d]
    terms = (q[:, :, None].abs() * Kq.abs()).sum(-1) * attn.scale  # Σ |q_i K_ti| · scale
    return o.reshape(B, 1, H * d), terms.amax(), V.abs().amax(), K.shape[2]


ATTENTION_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")


def run_attention(attn, rot, x, z, n, *, hooks=None, pytorch=False, monkeypatch=None):
    """O of one decode step: the compiled call, the compiled stages (with `hooks`), or PyTorch's path."""
    for name, fn in (hooks or {}).items():
        getattr(attn, name).fns.append(fn)
    try:
        if pytorch:
            monkeypatch.setattr(kernels, "decode_attention", lambda: None)
        with torch.no_grad():
            return attn(z, torch.tensor([n]), x, rot)
    finally:
        for name in hooks or {}:
            getattr(attn, name).fns.clear()
        if pytorch:
            monkeypatch.undo()


def check_attention(B, shape, n, rotary, window, scale, seed):
    """The compiled step, its stages with observing hooks, and PyTorch's path each give O
    within float32 rounding of its float64 closed form. The stages give the one call's bits,
    and every path writes the same bits into the state (the rotation is the same rounded
    products and sum)."""
    H, H_kv, d = shape
    attn, rot, (x_fast, x_ref), z = attention_case(B, H, H_kv, d, n, rotary, window, scale, seed)
    x_staged = x_ref.clone()
    seen = {}

    def watch_one(name):
        def watch(t, hook):
            seen[name] = t.clone()  # (returns None: the state is only watched)
        return watch

    watch = {name: watch_one(name) for name in ATTENTION_HOOKS}
    with pytest.MonkeyPatch.context() as mp:
        fast = run_attention(attn, rot, x_fast, z, n)
        staged = run_attention(attn, rot, x_staged, z, n, hooks=watch)
        ref = run_attention(attn, rot, x_ref, z, n, pytorch=True, monkeypatch=mp)
    assert torch.equal(staged, fast) and torch.equal(x_staged.kv, x_fast.kv) and torch.equal(x_ref.kv, x_fast.kv)
    assert seen["hook_attn_scores"].shape == seen["hook_pattern"].shape == (B, H, 1, n + 1)
    assert torch.allclose(seen["hook_pattern"].sum(-1), torch.ones(()), atol=1e-6)
    with torch.no_grad():
        o64, terms, v_max, keys = closed_form_attention(attn, rot, x_ref, z, n)
    score_err = (d + 4) * 2.0**-24 * terms  # q·k in float32, and q rotated in float32
    bound = (2.2 * score_err + 1e-6 + (keys + 2) * 2.0**-24) * v_max  # softmax's spread; exp; the sum
    for o in (fast, ref):
        assert ((o.to(F64) - o64).abs() <= bound).all()


ATTENTION_SHAPES = [(4, 4, 8), (4, 2, 16), (6, 3, 64), (4, 1, 72), (2, 2, 12)]  # (H, H_kv, d)


@requires_kernel
@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), shape=st.sampled_from(ATTENTION_SHAPES), n=st.integers(0, 200), rotary=st.booleans(),
       window=st.sampled_from([None, 1, 40]), scale=st.sampled_from([None, 1.0]), seed=st.integers(0, 10**6))
def test_decode_attention_is_the_closed_form(B, shape, n, rotary, window, scale, seed):
    check_attention(B, shape, n, rotary, window, scale, seed)


@requires_kernel
@pytest.mark.parametrize("name", ATTENTION_HOOKS)
def test_replacing_hooks_act_as_on_pytorchs_path(name, monkeypatch):
    """A hook that replaces q, k, v, S, A or z drives the compiled stages as it drives
    PyTorch's path: the same output and the same state rows."""
    attn, rot, (x1, x2), z = attention_case(2, 4, 2, 16, 30, True, 8, None, 1)

    def replace(t, hook):
        if name == "hook_pattern":  # uniform attention over every key, the window's mask ignored
            return torch.full_like(t, 1.0 / t.shape[-1])
        if name == "hook_attn_scores":
            return t.flip(-1)
        return t * 0.5 + 1.0

    compiled = run_attention(attn, rot, x1, z, 30, hooks={name: replace})
    ref = run_attention(attn, rot, x2, z, 30, hooks={name: replace}, pytorch=True, monkeypatch=monkeypatch)
    assert torch.allclose(compiled, ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x1.kv, x2.kv, atol=1e-6)


@requires_kernel
@pytest.mark.parametrize("name", ATTENTION_HOOKS[:5])
def test_a_hook_that_hands_back_a_wrong_shape_is_named(name):
    attn, rot, (x, _), z = attention_case(1, 4, 2, 16, 30, True, None, None, 0)
    with pytest.raises(InputError, match="returned a tensor of shape .*expected None or a tensor of shape"):
        run_attention(attn, rot, x, z, 30, hooks={name: lambda t, h: t[..., :-1]})


@requires_kernel
def test_decode_attention_falls_back_where_it_does_not_apply(monkeypatch):
    """A state buffer that is not contiguous takes PyTorch's path (the compiled step never
    runs), with the same result."""
    attn, rot, (x1, x2), z = attention_case(1, 4, 2, 16, 30, True, None, None, 0)
    ref = run_attention(attn, rot, x1, z, 30)
    strided = x2.clone()
    strided.kv = strided.kv.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    assert not strided.layer_buffers(0)[0].is_contiguous()
    monkeypatch.setattr(kernels.DecodeAttention, "__call__", lambda *a: pytest.fail("the compiled step ran"))
    assert torch.allclose(run_attention(attn, rot, strided, z, 30), ref, atol=1e-5)


@requires_kernel
def test_a_decode_step_under_autograd_keeps_its_graph(monkeypatch):
    """With gradients wanted through z the step takes PyTorch's path (C keeps no graph):
    d Σ O / dz equals the gradient of the float64 closed form."""
    attn, rot, (x, _), z = attention_case(1, 4, 2, 16, 30, True, None, None, 0)
    monkeypatch.setattr(kernels.DecodeAttention, "__call__", lambda *a: pytest.fail("the compiled step ran"))
    z = z.clone().requires_grad_(True)
    attn(z, torch.tensor([30]), x, rot).sum().backward()
    z_ref = z.detach().clone().requires_grad_(True)
    _, _, (x_ref, _), _ = attention_case(1, 4, 2, 16, 30, True, None, None, 0)
    closed_form_attention(attn, rot, x_ref, z_ref, 30)[0].sum().backward()
    assert z.grad.abs().max() > 0.1 and torch.allclose(z.grad, z_ref.grad, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- build and threads
@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process state with no kernel loaded yet, and an empty cache folder."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path))
    return tmp_path


def test_the_library_is_built_once_into_the_cache(fresh):
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    assert lib.path.parent == fresh / "kernels" and lib.path.exists()
    assert "hybridlm's kernels" in kernels.status()
    stamp = lib.path.stat().st_mtime_ns
    kernels._state.clear()
    assert kernels.library().path == lib.path and lib.path.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_pytorch_paths_can_be_chosen_and_a_bad_choice_is_named(fresh, monkeypatch):
    monkeypatch.setenv("HYBRIDLM_KERNELS", "off")
    assert kernels.int4() is None and kernels.decode_attention() is None
    assert "HYBRIDLM_KERNELS=off" in kernels.status()
    kernels._state.clear()
    monkeypatch.setenv("HYBRIDLM_KERNELS", "fast")
    with pytest.raises(InputError, match="HYBRIDLM_KERNELS='fast'"):
        kernels.library()


def test_without_a_compiler_the_path_falls_back(fresh, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert kernels.library() is None and "no C compiler" in kernels.status()


def test_a_failed_build_is_named_and_the_path_still_works(fresh, monkeypatch):
    (fresh / "src").mkdir()
    (fresh / "src" / "int4.c").write_text("this is not C\n")
    for name in (*(s for s in build.SOURCES if s != "int4.c"), *build.HEADERS):
        (fresh / "src" / name).write_text((build.folder() / name).read_text())
    monkeypatch.setattr(build, "folder", lambda: fresh / "src")
    if build.shutil.which("cc") is None and build.shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    W, b = weights(8, 64, 0)
    with pytest.warns(UserWarning, match="build failed"):
        lin = Int4Linear(W, b)  # on PyTorch's kernel, or the dequantised product
    assert kernels.library() is None and "build failed" in kernels.status()
    x = inputs(2, 64, 0)
    assert torch.allclose(lin(x), x @ lin.weight.T + b, rtol=2e-2, atol=0.2)


def test_the_portable_c_build_is_the_same_map(fresh, monkeypatch):
    """Where the CPU lacks AVX2, FMA or F16C the kernels are plain C loops: the same checks."""
    monkeypatch.setattr(build, "cpu_flags", list)
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.status())
    assert not lib.vectorised and "portable C" in kernels.status()
    for case in [(5, 1, 1, True, 0), (33, 18, 1, False, 1), (20, 7, 3, True, 2), (9, 48, 6, True, 3),
                 (40, 3, 35, False, 4)]:
        check_int4(*case)
    for B, shape, n, rotary, window, scale in [(1, (6, 3, 64), 0, True, None, None),
                                             (2, (4, 1, 72), 50, True, 40, None),
                                             (3, (2, 2, 12), 17, False, None, 1.0),
                                             (1, (4, 4, 8), 120, True, 1, None)]:
        check_attention(B, shape, n, rotary, window, scale, seed=n)
    for case in [(1, 1, 1, False, 0), (33, 70, 5, True, 1), (96, 64, 2, True, 2), (200, 130, 17, False, 3)]:
        check_affine(*case)
    from tests.test_step import check_activations, check_blocks, check_norm

    for case in [(1, 576, True, True, 0), (3, 77, False, True, 1), (32, 9, False, False, 2)]:
        check_norm(*case)
    check_activations(5, 99, 3)
    check_blocks("llama", "int4", monkeypatch)
    check_blocks("gpt2", "float32", monkeypatch)


@requires_kernel
def test_torch_set_num_threads_governs_the_kernel():
    """The kernel's loops run on PyTorch's own OpenMP runtime: its team follows
    torch.set_num_threads (a second runtime would keep its own count, and its own pool)."""
    k, threads = kernels.library(), torch.get_num_threads()
    if build.torch_openmp() is None:
        pytest.skip("PyTorch here maps no OpenMP runtime")
    try:
        for n in (1, 3, 2):
            torch.set_num_threads(n)
            assert k.team() == n
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_cache_file_is_built_again(fresh, monkeypatch):
    k = kernels.library()
    if k is None:
        pytest.skip(kernels.status())
    other = fresh / "other"  # (a path this process has not loaded yet)
    damaged = other / "kernels" / k.path.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setenv("HYBRIDLM_CACHE", str(other))
    kernels._state.clear()
    assert kernels.library().path == damaged and damaged.read_bytes()[:4] == b"\x7fELF"


# ---------------------------------------------------------------------- the batch-invariant float32 product
def column_major(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, N, generator=g).t(), torch.randn(N, generator=g)  # W [N, K] stored as Wᵀ rows


def check_affine(N, K, R, bias, seed):
    """y = x Wᵀ + b within float32's rounding of a K-term sum (γ_K Σ|W||x|, plus the bias's), and
    every row's bits the same alone, in any batch, at any offset and on any thread count."""
    W, b = column_major(N, K, seed)
    b = b if bias else None
    x = inputs(R, K, seed)
    ref = x.to(F64) @ W.to(F64).T + (b.to(F64) if bias else 0)
    bound = accumulation_bound(W.to(F64), x) + (ref.abs() * 2.0**-23 if bias else 0) + 1e-30
    y = kernels.affine()(x, W, b)
    assert y.shape == (R, N) and ((y.to(F64) - ref).abs() <= bound).all()
    for r in {0, R // 2, R - 1}:
        assert torch.equal(kernels.affine()(x[r : r + 1], W, b), y[r : r + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.affine()(x, W, b), y)
    finally:
        torch.set_num_threads(threads)


@requires_kernel
@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 200), K=st.integers(1, 300), R=st.integers(1, 32), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_affine_kernel_is_the_closed_form_and_batch_invariant(N, K, R, bias, seed):
    check_affine(N, K, R, bias, seed)


@requires_kernel
def test_a_token_steps_products_take_the_batch_invariant_kernel(monkeypatch):
    """linear.affine sends a token step's rows (≤ STEP_ROWS, float32, column-major W) to the
    kernel; where the library is missing the rows go one at a time, still batch-invariant."""
    from hybridlm.lm import linear

    W, b = column_major(96, 64, 1)
    x = inputs(6, 64, 1)
    y = linear.affine(x, W, b)
    assert torch.equal(y, kernels.affine()(x, W, b))
    assert torch.equal(linear.affine(x[2:3], W, b), y[2:3])
    monkeypatch.setattr(kernels, "affine", lambda: None)
    alone = linear.affine(x, W, b)
    assert torch.equal(alone[4:5], linear.affine(x[4:5], W, b))
    assert torch.allclose(alone, y, rtol=1e-5, atol=1e-5)


@requires_kernel
def test_int4_products_are_batch_invariant():
    """A row of the int4 kernel has the same bits alone as in a tile of rows."""
    W, b = weights(70, 32 * 19, 7)
    lin = Int4Linear(W, b)
    x = inputs(13, 32 * 19, 7)
    y = lin(x)
    for r in range(13):
        assert torch.equal(lin(x[r : r + 1]), y[r : r + 1])
    assert torch.equal(lin(x[3:11]), y[3:11])
