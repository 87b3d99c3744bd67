"""Trajectory capture: selection by hook, layer and position; streaming to shards."""

import torch

from hybridlm import ModelConfig, load_model
from hybridlm.capture import TrajectoryRecorder, load_trajectory, run_with_trace


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
