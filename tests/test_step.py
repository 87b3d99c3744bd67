"""A token step of the blocks in compiled code (hybridlm.lm.step, layer.c).

The norms and activations are checked against their closed forms in float64, with bounds from
the arithmetic. The compiled blocks are checked against the staged path (every part's own
forward, with a hook point forcing it) bit for bit, in every family's parts, float32 and int4,
for one sequence, a batched state and the engine's ragged batch; and against PyTorch's own
operations (the kernels off) within float32 rounding.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import ModelConfig, load_model
from hybridlm.lm import kernels
from hybridlm.lm.linear import Linear
from hybridlm.lm.quantize import set_precision

F64 = torch.float64
EPS = 2.0**-24
requires_kernel = pytest.mark.skipif(kernels.library() is None, reason=f"kernels unavailable: {kernels.status()}")


# ---------------------------------------------------------------------- the element-wise parts
def rows(R, D, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, 1, D, generator=g) * spread + torch.randn(R, 1, 1, generator=g)  # rows off centre
    h[..., torch.randint(0, D, (max(1, D // 40),), generator=g)] *= 20  # outlier features
    return h


@requires_kernel
@settings(max_examples=60, deadline=None)
@given(R=st.integers(1, 32), D=st.integers(1, 700), rms=st.booleans(), affine=st.booleans(),
       seed=st.integers(0, 10**6))
def test_norms_are_their_closed_forms(R, D, rms, affine, seed):
    check_norm(R, D, rms, affine, seed)


def check_norm(R, D, rms, affine, seed):
    h = rows(R, D, seed)
    g = torch.Generator().manual_seed(seed + 7)
    gamma, beta = torch.randn(D, generator=g), torch.randn(D, generator=g)
    eps = 1e-5
    out = kernels.blocks().norm(h, rms, eps, gamma if affine else None, None if rms or not affine else beta)
    x = h.to(F64)
    mu = 0 if rms else x.mean(-1, keepdim=True)
    inv = 1 / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)
    x_hat = (x - mu) * inv
    ref = x_hat * gamma.to(F64) + (0 if rms else beta.to(F64)) if affine else x_hat
    # Σ over D terms (D roundings of the sums, carried into μ and 1/σ), then a few element-wise roundings
    spread = (x_hat.abs() + (0 if rms else x.abs().mean(-1, keepdim=True) * inv))
    bound = (D + 8) * EPS * spread * (gamma.abs().to(F64) if affine else 1) + 4 * EPS * ref.abs() + 1e-30
    assert ((out.to(F64) - ref).abs() <= bound).all()


@requires_kernel
@settings(max_examples=60, deadline=None)
@given(R=st.integers(1, 32), n=st.integers(1, 300), seed=st.integers(0, 10**6))
def test_activations_are_their_closed_forms(R, n, seed):
    check_activations(R, n, seed)


def check_activations(R, n, seed):
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(R, 1, 2 * n, generator=g) * 6
    fused[..., :3] = torch.tensor([-100.0, 100.0, 0.0])[: min(3, 2 * n)]  # past e^x's range, and zero
    gate, up = fused[..., :n], fused[..., n:]  # slices of the fused product, read where they lie
    silu = kernels.blocks().swiglu(gate, up)
    a, u = gate.to(F64), up.to(F64)
    ref = a / (1 + torch.exp(-a)) * u
    assert ((silu.to(F64) - ref).abs() <= 8 * EPS * ref.abs() + 1e-30).all()

    x = fused[..., :n].contiguous()
    gelu = kernels.blocks().gelu(x)
    v = x.to(F64)
    inner = math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)
    ref = 0.5 * v * (1 + torch.tanh(inner))
    # e^x's ~1 ulp and the cancellation in (1 − t)/(1 + t) near 0 (absolute, ≤ 3·10⁻⁷ in tanh), the
    # roundings of the inner polynomial carried through tanh' = sech², then the outer products
    tanh_err = 3e-7 + 6 * EPS * inner.abs() / torch.cosh(inner.clamp(-40, 40)) ** 2
    assert ((gelu.to(F64) - ref).abs() <= 0.5 * v.abs() * tanh_err + 6 * EPS * ref.abs() + 1e-30).all()


# ---------------------------------------------------------------------- whole blocks
FAMILIES = {
    "gpt2": dict(),
    "llama": dict(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=2, attn_bias=False,
                  attn_out_bias=False, mlp_bias=False),
    "gptneo": dict(attn_bias=False, attn_scale=1.0, attention_layers=("global", "local", "global", "local"),
                   local_window=5),
    # Gemma 3's block: QK-norm, post-norms, GeGLU, local blocks with their own rotary base, d_k ≠ d / N_h
    "gemma3": dict(norm="rmsnorm", positions="rotary", mlp="geglu", n_kv_head=2, attn_bias=False, attn_out_bias=False,
                   mlp_bias=False, qk_norm=True, post_norms=True, head_dim=24, rope_local_theta=10000.0,
                   rope_theta=1e6, attention_layers=("local", "global", "local", "global"), local_window=5,
                   embed_scale=8.0, attn_scale=0.2),
}


def model_of(family, precision):
    cfg = ModelConfig(vocab_size=200, n_ctx=64, d_model=64, n_layer=4, n_head=4, d_mlp=96, eos_token_id=None)
    m = load_model(cfg.replace(**FAMILIES[family]), seed=3)
    with torch.no_grad():  # gains and biases off their constants, so a misplaced one shows
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return set_precision(m, precision) if precision != "float32" else m


def trajectory(m, hooks=None, steps=6):
    """Logits and states of three ways to step: one sequence, a batched state of two, and the
    engine's ragged batch of three states of different lengths (`hooks` attached for the steps)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (4, 9, 2)]
    tokens = torch.randint(0, 200, (steps, 3), generator=g)
    one, two = m.init_state(prompts[0]), m.init_state(torch.tensor([prompts[1][:4], prompts[0]]))
    ragged = [m.init_state(p) for p in prompts]
    out = []
    with m.hooks(hooks or {}):  # (after the prefills, which are not token steps)
        for t in tokens:
            m.F(one, [int(t[0])])
            m.F(two, t[:2])
            m.step(ragged, t.tolist())
            out += [one.logits, two.logits, *(x.logits for x in ragged)]
    return torch.cat(out), [one.kv, two.kv, *(x.kv for x in ragged)]


def watching(names, layers):
    return {f"blocks.{layer}.{name}": (lambda t, hook: None) for layer in layers for name in names}


@requires_kernel
@pytest.mark.parametrize("precision", ["float32", "int4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_blocks_are_the_staged_path(family, precision, monkeypatch):
    """Whole runs of blocks, sublayers between residual hook points, and the staged parts give the
    same bits (logits and every state row); PyTorch's own operations agree within rounding."""
    check_blocks(family, precision, monkeypatch)


def check_blocks(family, precision, monkeypatch):
    m = model_of(family, precision)
    calls = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks",
                        lambda self, *a, _f=kernels.BlockKernel.blocks, **k: calls.append(a[1]) or _f(self, *a, **k))
    fast, fast_kv = trajectory(m)
    assert calls and max(calls) == 4  # one call for the four blocks
    inner = {"llama": "mlp.hook_pre_linear", "gemma3": "attn.q_norm.hook_normalized"}.get(family, "ln1.hook_normalized")
    for hooks in (watching(["hook_resid_mid"], range(4)),  # every block in sublayers
                  watching([inner], range(4)),  # every block staged
                  watching(["attn.hook_pattern", "hook_resid_post"], [1])):  # runs around one staged block
        logits, kv = trajectory(m, hooks)
        assert torch.equal(logits, fast) and all(torch.equal(a, b) for a, b in zip(kv, fast_kv))
    if precision == "float32":
        monkeypatch.setattr(kernels, "blocks", lambda: None)
        monkeypatch.setattr(kernels, "decode_attention", lambda: None)
        monkeypatch.setattr(kernels, "affine", lambda: None)
        ref, _ = trajectory(m)
        assert torch.allclose(fast, ref, rtol=1e-4, atol=1e-4)


@requires_kernel
def test_a_residual_hook_that_replaces_the_state_acts_on_the_compiled_sublayers():
    """A control input added to the residual stream (a replacing hook) keeps the compiled sublayers
    and gives the staged path's bits."""
    m = model_of("llama", "float32")
    push = torch.randn(64, generator=torch.Generator().manual_seed(2))
    steer = {"blocks.2.hook_resid_mid": lambda t, hook: t + push}
    plain, _ = trajectory(m)
    steered, _ = trajectory(m, steer)
    staged, _ = trajectory(m, {**steer, **watching(["ln2.hook_normalized"], [2])})
    assert torch.equal(steered, staged) and not torch.allclose(steered, plain)


@requires_kernel
def test_a_replaced_weight_or_module_is_read_afresh():
    """The compiled blocks hold the addresses of a block's tensors and copy a few constants: a weight
    replaced in place of its storage (`.data =`), a new module, a changed scale or ε and a new
    precision are all seen on the next step."""
    m = model_of("gpt2", "float32")
    trajectory(m, steps=1)  # the specs are built
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        W = m.blocks[1].attn.W_O.weight
        W.data = (torch.randn(W.shape, generator=g) * 0.1).t().contiguous().t()
        new = Linear(96, 64, bias=True)
        new.weight.copy_(torch.randn(64, 96, generator=g) * 0.1)
        new.requires_grad_(False)
        m.blocks[2].mlp.W_proj = new
    fast, _ = trajectory(m)
    staged, _ = trajectory(m, watching(["mlp.hook_post"], range(4)))
    assert torch.equal(fast, staged)
    m.blocks[3].attn.scale, m.blocks[0].ln2.eps = 0.3, 1e-2  # constants the spec copies
    fast, _ = trajectory(m)
    staged, _ = trajectory(m, watching(["mlp.hook_post"], range(4)))
    assert torch.equal(fast, staged)
    set_precision(m, "int4")
    fast, _ = trajectory(m)
    staged, _ = trajectory(m, watching(["mlp.hook_post"], range(4)))
    assert torch.equal(fast, staged)


@requires_kernel
def test_a_prefill_and_autograd_keep_pytorchs_path(monkeypatch):
    """Many positions (a prefill) and a step under autograd never reach the compiled blocks, and a
    step under autograd keeps its graph."""
    m = model_of("llama", "float32")
    calls = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks", lambda self, *a: calls.append(1))
    monkeypatch.setattr(kernels.BlockKernel, "attention", lambda self, *a: calls.append(1))
    x = m.init_state(list(range(10)))
    assert not calls
    m.requires_grad_(True)
    out = m(torch.tensor([[3]]), x)
    assert not calls and out.grad_fn is not None
    out = m(torch.tensor([[3]]))
    out[0, -1, 0].backward()
    assert not calls and m.blocks[0].attn.W_qkv.weight.grad is not None


@requires_kernel
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_recorder_of_the_residual_stream_keeps_the_blocks_whole(family, monkeypatch):
    """Hooks that only observe the residual stream (the recorder's) get the states of a whole
    compiled run afterwards: the same records, bit for bit and in the same order, as an ordinary
    hook between the compiled sublayers sees, and the engine's ragged batch keeps one call."""
    from hybridlm.lm.capture import Recorder

    m = model_of(family, "float32")
    calls = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks",
                        lambda self, *a, _f=kernels.BlockKernel.blocks, **k: calls.append(a[1]) or _f(self, *a, **k))
    seen = []
    plain = {f"blocks.{layer}.{name}": (lambda t, hook: seen.append((hook.name, t.clone())))
             for layer in range(4) for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid",
                                                "hook_mlp_out", "hook_resid_post")}
    logits, _ = trajectory(m, plain)
    assert not calls  # (ordinary hooks: sublayer by sublayer)
    recorder = Recorder(m, lambda n: "resid" in n or n.endswith(("attn_out", "mlp_out")), decode_only=True)
    with recorder:
        recorded, _ = trajectory(m)
    assert calls and max(calls) == 4 and torch.equal(recorded, logits)
    records = [(k.rsplit("@", 1)[0], v) for k, v in recorder.records.items() if not k.endswith(":pos")]
    assert [name for name, _ in records] == [name for name, _ in seen]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(records, seen))


def records(m, observe: bool):
    """Logits and a recorder's records (every hook point of the blocks, token steps only), its
    hooks marked as observing (the compiled run) or wrapped unmarked (the staged parts)."""
    from hybridlm.lm.capture import Recorder

    rec = Recorder(m, lambda n: n.startswith("blocks."), decode_only=True)
    if not observe:
        keep = rec._keep
        rec.hooks = lambda model=None: [(n, lambda x, hook: keep(x, hook)) for n in rec.names]
    with rec:
        logits, _ = trajectory(m)
    return logits, rec.records


@requires_kernel
@pytest.mark.parametrize("precision", ["float32", "int4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_recording_every_activation_keeps_the_blocks_whole(family, precision, monkeypatch):
    """A recorder of every hook point of the blocks (its hooks observe) leaves the compiled run
    whole, and records exactly what the staged parts hand out: the same names in the same order,
    the same shapes and bits, the same positions (a ragged batch's attention row by row)."""
    m = model_of(family, precision)
    calls = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks",
                        lambda self, *a, _f=kernels.BlockKernel.blocks, **k: calls.append(a[1]) or _f(self, *a, **k))
    staged_logits, staged = records(m, observe=False)
    assert not calls
    logits, recorded = records(m, observe=True)
    # (QK-norm's and the post-norms' x̂ have no taps: with them recorded, Gemma's blocks run staged)
    assert (calls and max(calls) == 4) if family != "gemma3" else not calls
    assert torch.equal(logits, staged_logits)
    assert list(recorded) == list(staged)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(recorded.values(), staged.values()))


@requires_kernel
@pytest.mark.parametrize("precision", ["float32", "int4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_fork_runs_whole_with_each_candidates_bits(family, precision, monkeypatch):
    """A fork's k candidates (a barrier's) go through the compiled run in one call, and each one's
    final state and new rows have the bits the staged fork and a step of F alone give it."""
    from hybridlm.lm.state import ForkedState

    m = model_of(family, precision)
    calls = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks",
                        lambda self, *a, _f=kernels.BlockKernel.blocks, **k: calls.append(a[1]) or _f(self, *a, **k))
    x = m.init_state(list(range(3, 12)))
    m.F(x, [7])
    calls.clear()
    cand = torch.tensor([[5], [19], [7], [100]])

    def fork(hooks=None):
        f = ForkedState(x, 4)
        with m.hooks(hooks or {}):
            m(cand, f, logits=False)
        return f

    fast = fork()
    assert calls == [4]
    staged = fork(watching(["mlp.hook_post"], range(4)))
    assert calls == [4] and torch.equal(fast.final, staged.final)
    for layer in range(4):
        assert all(torch.equal(a, b) for a, b in zip(fast.rows[layer], staged.rows[layer]))
    for i, w in enumerate(cand[:, 0].tolist()):
        alone = x.clone()
        m.F(alone, [w])
        assert torch.equal(m.readout(fast.final[i : i + 1][:, None])[:, -1], alone.logits)
        for layer, (k, v) in fast.rows.items():
            K, V = alone.layer_buffers(layer)
            assert torch.equal(K[0, :, x.n], k[i]) and torch.equal(V[0, :, x.n], v[i])
