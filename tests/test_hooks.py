"""Named hook points: names, caching, replacement, and the sphere of LayerNorm."""

import copy
import io
import math

import pytest
import torch

from hybridlm import ModelConfig, load_model


def small(**changes):
    cfg = ModelConfig(vocab_size=120, n_ctx=32, d_model=24, n_layer=3, n_head=3, eos_token_id=None)
    return load_model(cfg.replace(**changes), seed=2)


def test_names_follow_transformerlens():
    names = set(small().hook_points)
    for l in range(3):
        for n in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post",
                  "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern",
                  "attn.hook_z", "ln1.hook_normalized", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_post"):
            assert f"blocks.{l}.{n}" in names
    assert {"hook_embed", "pos_embed.hook_pos_embed", "ln_final.hook_normalized", "hook_logits"} <= names


def test_run_with_cache_reads_the_trajectory():
    m = small()
    ids = torch.randint(0, 120, (2, 9))
    logits, cache = m.run_with_cache(ids, names=lambda n: "resid" in n or "pattern" in n)
    assert not any(p.fns for p in m.hook_points.values())  # hooks removed afterwards
    assert torch.allclose(m.readout(cache["blocks.2.hook_resid_post"]), logits, atol=1e-5)
    for l in range(2):  # H⁽ℓ⁾ leaving block ℓ is H⁽ℓ⁾ entering block ℓ+1
        assert torch.equal(cache[f"blocks.{l}.hook_resid_post"], cache[f"blocks.{l + 1}.hook_resid_pre"])
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 3, 9, 9)


def test_layernorm_normalized_lies_on_sphere():
    """Before its affine part LN maps onto {Σx_j = 0, ‖x‖ = √d} (exactly so as ε → 0)."""
    m = small(norm_eps=1e-12)
    _, cache = m.run_with_cache(torch.randint(0, 120, (1, 12)), names="blocks.1.ln2.hook_normalized")
    x = cache["blocks.1.ln2.hook_normalized"]
    d = m.config.d_model
    assert torch.allclose(x.sum(-1), torch.zeros(x.shape[:-1]), atol=1e-5)
    assert torch.allclose(x.norm(dim=-1), torch.full(x.shape[:-1], math.sqrt(d)), atol=1e-3)


def test_hook_injects_input_into_residual_stream():
    """Adding u to H⁽⁰⁾ at the rows of token v equals adding u to row v of W_e (untied W_u)."""
    m = small(tie_embeddings=False)
    ids = torch.tensor([[5, 7, 9, 11]])
    u = torch.randn(m.config.d_model)

    def inject(h, hook):
        return h + (ids[..., None] == 7) * u

    with m.hooks({"blocks.0.hook_resid_pre": inject}):
        steered = m(ids)
    with torch.no_grad():
        m.W_e[7] += u
        shifted = m(ids)
        m.W_e[7] -= u
    assert torch.allclose(steered, shifted, atol=1e-5)
    assert not torch.allclose(steered, m(ids), atol=1e-3)


def test_hook_context_gives_positions_during_decode():
    m = small()
    seen = []
    x = m.init_state([1, 2, 3])
    with m.hooks({"blocks.0.hook_resid_pre": lambda h, hook: seen.append(hook.ctx.pos.tolist())}):
        m.F(x, [4])
        m.F(x, [5])
    assert seen == [[3], [4]]


def test_rmsnorm_is_transformers_bit_for_bit_with_or_without_its_hook():
    """One path for RMSNorm: the same bits as transformers' LlamaRMSNorm in float32 and
    bfloat16, and attaching a hook to its normalized state changes nothing."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hybridlm.lm.norm import RMSNorm

    g = torch.Generator().manual_seed(0)
    ours, ref = RMSNorm(48, 1e-5), LlamaRMSNorm(48, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48, generator=g))
        ref.weight.copy_(ours.weight)
    h = 3 * torch.randn(2, 5, 48, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ours.to(dtype), ref.to(dtype)
        x = h.to(dtype)
        plain = ours(x)
        ours.hook_normalized.fns.append(lambda t, hook: None)
        hooked = ours(x)
        ours.hook_normalized.fns.clear()
        assert plain.dtype == dtype
        assert torch.equal(plain, ref(x)) and torch.equal(hooked, plain)


def test_parts_refuse_pytorch_module_hooks_and_the_model_keeps_them():
    """The parts of the map are called straight into forward, so PyTorch's module hooks
    could not fire on them: registering one is an error that points to the hook points.
    The model itself is an ordinary module, whose hooks fire."""
    m = small()
    for part in (m.blocks[0], m.blocks[0].attn, m.blocks[0].attn.W_qkv, m.blocks[0].ln1, m.blocks[0].mlp):
        for register in (part.register_forward_hook, part.register_forward_pre_hook, part.register_full_backward_hook):
            with pytest.raises(TypeError, match="hook point"):
                register(lambda *args: None)
    fired = []
    handle = m.register_forward_hook(lambda module, args, out: fired.append(out.shape))
    m(torch.randint(0, 120, (1, 5)))
    handle.remove()
    assert fired == [(1, 5, 120)]


def test_a_hook_that_replaces_q_or_k_is_rotated_as_the_fused_slice_would_be():
    """q and k are rotated in one call on their shared slice of the q|k|v product; a hook
    that hands back new tensors takes the other branch and must give the same map."""
    m = small(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=1, attn_bias=False, attn_out_bias=False)
    ids = torch.randint(0, 120, (2, 7), generator=torch.Generator().manual_seed(1))
    plain = m(ids)
    for name in ("blocks.1.attn.hook_q", "blocks.1.attn.hook_k"):
        with m.hooks({name: lambda x, hook: x.clone()}):
            assert torch.equal(m(ids), plain)
        with m.hooks({name: lambda x, hook: 2 * x}):
            assert not torch.allclose(m(ids), plain)


def _members_agree(model) -> None:
    """Every part's submodules, parameters and buffers are plain attributes, the same objects
    as in its nn.Module tables, and nothing stale is left behind."""
    from hybridlm.lm.direct import DirectModule

    parts = [p for p in model.modules() if isinstance(p, DirectModule)]
    assert parts
    for part in parts:
        members = {**part._modules, **part._parameters, **part._buffers}
        for name, value in members.items():
            assert vars(part)[name] is value, (type(part).__name__, name)


def test_members_of_the_parts_stay_plain_attributes_through_every_change():
    """The parts keep their members in their instance dicts (no nn.Module.__getattr__ in the
    step); assignment, deletion, dtype conversion, deepcopy, pickling and
    torch.func.functional_call's swaps must all leave those copies right."""
    from hybridlm.lm.linear import Linear

    m = small(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=1, attn_bias=False, attn_out_bias=False)
    ids = torch.randint(0, 120, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = m(ids)
    _members_agree(m)
    attn = m.blocks[1].attn

    # torch.func.functional_call swaps the parameters through the tables: the swapped
    # weights must be the ones used, and the originals must come back afterwards.
    doubled = {"blocks.1.attn.W_O.weight": 2 * attn.W_O.weight.detach()}
    swapped = torch.func.functional_call(m, doubled, (ids,))
    with torch.no_grad():
        attn.W_O.weight.mul_(2)
    assert torch.equal(swapped, m(ids))
    with torch.no_grad():
        attn.W_O.weight.div_(2)
    assert torch.equal(m(ids), plain)
    _members_agree(m)

    # a new submodule or parameter by assignment; a deleted one is gone from both places
    new_out = Linear(attn.W_O.in_features, attn.W_O.out_features, bias=False)
    old_out, attn.W_O = attn.W_O, new_out
    assert attn.W_O is new_out and not torch.equal(m(ids), plain)
    attn.W_O = old_out
    assert torch.equal(m(ids), plain)
    norm = m.blocks[0].ln1
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    _members_agree(m)
    del norm.weight
    assert "weight" not in vars(norm)
    norm.weight = torch.nn.Parameter(torch.ones(24))
    _members_agree(m)

    # .to() replaces buffers (the rotary phases) and may replace parameters
    m.double()
    assert m.rotary.cos.dtype == torch.float64 and m.blocks[0].attn.W_qkv.weight.dtype == torch.float64
    _members_agree(m)
    m.float()

    # copies: each copy's attributes are its own members
    for twin in (copy.deepcopy(m), _pickled(m)):
        _members_agree(twin)
        assert twin.blocks[0].attn.W_qkv is not m.blocks[0].attn.W_qkv
        assert torch.equal(twin(ids), m(ids))


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
