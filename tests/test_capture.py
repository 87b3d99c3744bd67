"""Trajectory capture: selection by hook, layer and position; streaming to shards."""

import torch

from hybridlm import ModelConfig, load_model
from hybridlm.lm.capture import TrajectoryRecorder, load_trajectory, run_with_trace


def small():
    cfg = ModelConfig(vocab_size=100, n_ctx=48, d_model=16, n_layer=3, n_head=2, eos_token_id=None)
    return load_model(cfg, seed=4)


def test_selection_matches_run_with_cache():
    m = small()
    ids = torch.randint(0, 100, (2, 12))
    _, cache = m.run_with_cache(ids)
    _, rec = run_with_trace(m, ids, lambda n: "resid_post" in n or "pattern" in n, layers=[1], positions=[0, 5, 11])
    assert sorted(k for k in rec if not k.endswith(":pos")) == [
        "blocks.1.attn.hook_pattern@0", "blocks.1.hook_resid_post@0"]
    rows = torch.tensor([0, 5, 11])
    assert torch.allclose(rec["blocks.1.hook_resid_post@0"], cache["blocks.1.hook_resid_post"][:, rows], atol=1e-6)
    assert torch.allclose(rec["blocks.1.attn.hook_pattern@0"], cache["blocks.1.attn.hook_pattern"][:, :, rows], atol=1e-6)
    assert rec["blocks.1.hook_resid_post@0:pos"].tolist() == [0, 5, 11]


def test_decode_steps_are_recorded_per_call():
    m = small()
    with TrajectoryRecorder(m, "blocks.2.hook_resid_post") as rec:
        x = m.init_state([1, 2, 3, 4])
        for w in (5, 6, 7):
            m.F(x, [w])
    states = rec.stacked("blocks.2.hook_resid_post")
    _, cache = m.run_with_cache(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), names="blocks.2.hook_resid_post")
    assert states.shape == (1, 7, 16)
    assert torch.allclose(states, cache["blocks.2.hook_resid_post"], atol=1e-5)


def test_streaming_to_shards_round_trips(tmp_path):
    m = small()
    ids = torch.randint(0, 100, (4, 40))
    _, in_memory = run_with_trace(m, ids)
    with TrajectoryRecorder(m, out=tmp_path, shard_mb=0.01) as rec:
        m(ids)
    assert len(rec.shards) > 3 and not rec.records  # flushed as it went
    on_disk = load_trajectory(tmp_path)
    assert on_disk.keys() == in_memory.keys()
    assert all(torch.equal(on_disk[k], in_memory[k]) for k in in_memory)


def _models_of_every_family():
    base = ModelConfig(vocab_size=100, n_ctx=48, d_model=16, n_layer=2, n_head=4, eos_token_id=None)
    yield "gpt2", load_model(base, seed=4)
    yield "llama", load_model(base.replace(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=2,
                                           attn_bias=False, attn_out_bias=False, mlp_bias=False), seed=4)
    yield "gpt-neo", load_model(base.replace(attention_layers=("global", "local"), local_window=3), seed=4)
    from hybridlm.ssm import StackConfig, random_stack

    for layers in ("SRA", "SSS"):
        yield layers, random_stack(StackConfig(layers=layers, vocab_size=100, n_ctx=48, d_model=16, n_head=4,
                                               d_state=4, eos_token_id=None), seed=3)


def test_no_family_writes_into_a_state_after_its_hook_point():
    """The recorder keeps states without copying them; that is sound only if no model
    writes into a tensor (or the storage it views) after handing it to a hook point.
    Version counters see every in-place write, so they must not move after the hook."""
    for family, m in _models_of_every_family():
        seen = []

        def note(x, hook, seen=seen):
            if not x.is_inference():  # (F's own step runs in inference mode, which keeps no versions)
                seen.append((hook.name, x, x._version))

        with m.hooks([(n, note) for n in m.hook_points]), torch.no_grad():
            m(torch.randint(0, 100, (2, 9)))  # a prefill
            x = m.init_state([1, 2, 3])
            m.F(x, [4])
            m(torch.tensor([[5]]), x)  # (no_grad, unlike inference mode, keeps versions)
        assert len(seen) > 20, family
        moved = [name for name, t, version in seen if t._version != version]
        assert not moved, f"{family}: written after the hook: {moved}"


def test_records_share_storage_only_when_compact():
    m = small()
    ids = torch.randint(0, 100, (1, 12))
    logits, rec = run_with_trace(m, ids)
    _, cache = m.run_with_cache(ids)
    for name, value in cache.items():  # the records hold the very values, shared or copied
        assert torch.equal(rec[f"{name}@0"], value), name
    for key, value in rec.items():
        if value._base is not None:
            assert 2 * value.numel() >= value._base.numel(), key


def test_activation_cache_reads_as_transformer_lens_does():
    """TransformerLens' names and helpers, checked against the laws they stand for: the residual
    stream is the sum of what wrote into it; the stack after the last block, normed with the
    final norm's own scale and γ, is the final norm's output."""
    for family, m in list(_models_of_every_family())[:2]:
        ids = torch.randint(0, 100, (2, 7))
        _, cache = m.run_with_cache(ids)
        L = m.config.n_layer
        assert torch.equal(cache["resid_post", 1], cache["blocks.1.hook_resid_post"])
        assert torch.equal(cache["pattern", 0], cache["blocks.0.attn.hook_pattern"])
        assert torch.equal(cache["post", 1], cache["blocks.1.mlp.hook_post"])
        assert torch.equal(cache["resid_pre", -1], cache[f"blocks.{L - 1}.hook_resid_pre"])
        acc, labels = cache.accumulated_resid(return_labels=True)
        assert acc.shape == (L + 1, 2, 7, 16) and labels[-1] == "final_post"
        assert torch.equal(acc[-1], cache["resid_post", L - 1]) and torch.equal(acc[0], cache["resid_pre", 0])
        assert cache.accumulated_resid(1, incl_mid=True).shape[0] == 3  # pre 0, mid 0, pre 1
        parts, names = cache.decompose_resid(return_labels=True)
        assert names[0] == "embed" and len(names) == (2 if family == "gpt2" else 1) + 2 * L
        assert torch.allclose(parts.sum(0), cache["resid_post", L - 1], atol=1e-5)
        assert torch.allclose(cache.decompose_resid(1).sum(0), cache["resid_pre", 1], atol=1e-5)
        normed = cache.accumulated_resid(apply_ln=True)[-1] * m.ln_final.weight
        if family == "gpt2":
            normed = normed + m.ln_final.bias
        assert torch.allclose(normed, m.ln_final(cache["resid_post", L - 1]), atol=1e-5), family
        assert cache.stack_activation("resid_post").shape == (L, 2, 7, 16)


def test_one_recorder_serves_a_sequence_of_the_engine(tmp_path):
    """The recorder as an observer: h of each decode step of one sequence, in a batch with another,
    equals the same states recomputed alone; written with the token step of each row."""
    from safetensors.torch import load_file

    from hybridlm.engine import Engine
    from hybridlm.engine.clock import sequence
    from hybridlm.engine.trace import StateRecorder

    m = small()
    rec = StateRecorder(m, tmp_path / "states.safetensors")
    a = sequence(m, [1, 2, 3], max_new_tokens=5, stop_ids=(), observers=[rec])
    b = sequence(m, [9, 8, 7, 6, 5], max_new_tokens=5, stop_ids=())
    engine = Engine(m)
    engine.add(a)
    engine.add(b)
    engine.run()
    saved = load_file(str(tmp_path / "states.safetensors"))
    assert saved["t"].tolist() == [1, 2, 3, 4, 5]  # step t computes the state of its token w_t
    _, cache = m.run_with_cache(torch.tensor([[1, 2, 3] + a.arc.tokens]))
    assert torch.allclose(saved["resid_final"], cache["resid_post", 2][0, 3:8], atol=1e-5)
