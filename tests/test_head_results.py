"""`attn.hook_result`: each head's write O^m W_O^m into the residual stream, [B, pos, head, d].

Checked against transformers (the input of its output projection, z, taken by a forward pre-hook on
that module and multiplied by the rows of its own weight that read each head), on GPT-2 (one key/value
head per head, a bias on W_O) and on a Qwen2 model (grouped keys and values, biases on q, k, v); the
heads sum, with b_O, to the attention output within 1e-5 there and on the real Qwen file; watching it
changes no bit, on a prefill and on the compiled decode step; replacing it replaces the output.
"""

from __future__ import annotations

import pytest
import torch
from families import V, make_folder, reference

from hybridlm import load_model
from hybridlm.lm.capture import Recorder
from hybridlm.lm.hooks import observing

SUM_TOL = 1e-5
REF_TOL = 1e-4


def reference_results(ref, projections: str, n_head: int, ids, transposed: bool) -> list[torch.Tensor]:
    """transformers' per-head writes of every layer: z (the input of each output projection named
    `projections`), split by head, times that head's rows of the projection's weight."""
    modules = [m for name, m in ref.named_modules() if name.endswith(projections)]
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach())) for m in modules]
    try:
        with torch.no_grad():
            ref(ids)
    finally:
        for h in handles:
            h.remove()
    out = []
    for z, m in zip(seen, modules):
        W = m.weight if transposed else m.weight.T  # [H·d_k, d]: Conv1D stores it so, Linear transposed
        z = z.unflatten(-1, (n_head, -1))  # [B, pos, head, d_k]
        out.append(torch.einsum("bphk,hkd->bphd", z, W.unflatten(0, (n_head, -1))))
    return out


def check_against(model, ref_results, ids, *, tol=REF_TOL):
    _, cache = model.run_with_cache(ids, names=lambda n: n.endswith(("hook_result", "hook_attn_out")))
    for layer, expected in enumerate(ref_results):
        result = cache["result", layer]
        assert result.shape == (*ids.shape, model.config.n_head, model.config.d_model)
        assert (result - expected).abs().max() <= tol
        b = model.blocks[layer].attn.W_O.bias
        summed = result.sum(2) + (0 if b is None else b)
        assert (summed - cache["attn_out", layer]).abs().max() <= SUM_TOL


def test_gpt2_heads_match_transformers(toy_hub, toy_model):
    _, ref = toy_hub
    ids = torch.randint(0, 50257, (2, 13), generator=torch.Generator().manual_seed(0))
    expected = reference_results(ref, "attn.c_proj", toy_model.config.n_head, ids, transposed=True)
    assert len(expected) == toy_model.config.n_layer
    check_against(toy_model, expected, ids)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    make_folder("qwen2", folder, seed=3)
    return load_model(folder), reference(folder)


def test_qwen2_heads_match_transformers_with_grouped_kv_and_biases(qwen2):
    model, ref = qwen2
    assert model.config.n_kv_head < model.config.n_head and model.config.attn_bias
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
    expected = reference_results(ref, "self_attn.o_proj", model.config.n_head, ids, transposed=False)
    check_against(model, expected, ids)


def test_stacked_head_results_are_labelled_by_layer_and_head(qwen2):
    model, _ = qwen2
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    _, cache = model.run_with_cache(ids, names=lambda n: n.endswith("hook_result"))
    stack, labels = cache.stack_head_results(return_labels=True)
    L, H = model.config.n_layer, model.config.n_head
    assert stack.shape == (L * H, 1, 9, model.config.d_model) and len(labels) == L * H
    assert labels[H + 2] == "L1H2" and torch.equal(stack[H + 2], cache["result", 1][:, :, 2])


def test_watching_changes_no_bit_on_prefill_and_decode(qwen2):
    """An observer of hook_result sees the decode step's heads (compiled path) equal to a prefill's
    last row, and the logits keep every bit."""
    model, _ = qwen2
    prompt = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(4))
    x = model.init_state(prompt)
    plain = model.G(x).clone()
    model.F(x, [7])
    plain_next = model.G(x).clone()
    seen = []
    watch = observing(lambda r, hook: seen.append(r.clone()))
    with model.hooks([(f"blocks.{ell}.attn.hook_result", watch) for ell in range(model.config.n_layer)]):
        y = model.init_state(prompt)
        watched = model.G(y).clone()
        model.F(y, [7])
        watched_next = model.G(y).clone()
    assert torch.equal(plain, watched) and torch.equal(plain_next, watched_next)
    L = model.config.n_layer
    assert len(seen) == 2 * L and seen[L].shape == (1, 1, model.config.n_head, model.config.d_model)
    _, cache = model.run_with_cache(torch.cat([prompt, torch.tensor([[7]])], 1), names=lambda n: "result" in n)
    for ell in range(L):
        assert (seen[L + ell][0, 0] - cache["result", ell][0, -1]).abs().max() <= 1e-5


def test_replacing_a_head_equals_ablating_its_z(qwen2):
    """Zeroing head m's write equals zeroing its z (hook_z): O^m W_O^m is what z^m contributes."""
    model, _ = qwen2
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(5))

    def drop_result(r, hook):
        r = r.clone()
        r[:, :, 1] = 0
        return r

    def drop_z(z, hook):
        z = z.clone()
        z[:, :, 1] = 0
        return z

    with model.hooks({"blocks.1.attn.hook_result": drop_result}):
        a = model(ids)
    with model.hooks({"blocks.1.attn.hook_z": drop_z}):
        b = model(ids)
    assert (a - b).abs().max() <= 1e-4 and (a - model(ids)).abs().max() > 1e-3


def test_real_qwen_heads_sum_to_the_attention_output():
    from hybridlm.errors import ModelNotFoundError
    from hybridlm.weights.registry import real_model_path

    try:
        real_model_path("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(f"qwen2.5-coder-0.5b: {exc}")
    model = load_model("qwen2.5-coder-0.5b")
    ids = torch.tensor([model.tokenizer.encode("def add(a, b):\n    return a + b")])
    layers = [0, model.config.n_layer // 2, model.config.n_layer - 1]
    with Recorder(model, lambda n: n.endswith(("hook_result", "hook_attn_out")), layers=layers) as rec:
        model(ids)
    cache = rec.cache()
    for ell in layers:
        result = cache["result", ell]
        assert result.shape == (1, ids.shape[1], model.config.n_head, model.config.d_model)
        b = model.blocks[ell].attn.W_O.bias
        summed = result.sum(2) + (0 if b is None else b)
        err = (summed - cache["attn_out", ell]).abs().max().item()
        scale = cache["attn_out", ell].abs().max().item()
        print(f"qwen2.5-coder-0.5b layer {ell}: max |Σ_m result^m + b_O − attn_out| = {err:.1e} (max |attn_out| {scale:.1f})")
        assert err <= SUM_TOL * max(1.0, scale)
