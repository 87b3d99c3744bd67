"""The looped transformer and the consensus runner."""

import csv
import json

import pytest
import torch
from click.testing import CliRunner

from hybridlm import ModelConfig, load_model
from hybridlm.analysis import consensus as C
from hybridlm.analysis import runner as R
from hybridlm.analysis.sphere import consensus_E

torch.set_num_threads(1)


def tiny(**changes):
    cfg = ModelConfig(vocab_size=200, n_ctx=64, d_model=32, n_layer=3, n_head=4, eos_token_id=None).replace(**changes)
    return load_model(cfg, seed=3)


def test_first_pass_is_the_forward_map():
    """Layer-steps 1..L of pass 1 are H⁽¹⁾..H⁽ᴸ⁾ of the ordinary forward pass."""
    m = tiny()
    ids = torch.randint(0, 200, (2, 10))
    _, cache = m.run_with_cache(ids, names=lambda n: n.endswith("hook_resid_post"))
    steps = list(C.looped(m, C.embed(m, ids), passes=1))
    assert [s.k for s, _ in steps] == [0, 1, 2, 3]
    for step, h in steps[1:]:
        expect = cache[f"blocks.{step.layer}.hook_resid_post"]
        assert torch.allclose(h, expect, atol=1e-6)
        assert torch.allclose(step.E, consensus_E(expect), atol=1e-6)


def test_first_pass_is_the_forward_map_rotary():
    m = tiny(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=2, attn_bias=False, attn_out_bias=False,
             mlp_bias=False)
    ids = torch.randint(0, 200, (1, 12))
    _, cache = m.run_with_cache(ids, names="blocks.2.hook_resid_post")
    *_, (step, h) = C.looped(m, C.embed(m, ids), passes=1)
    assert torch.allclose(h, cache["blocks.2.hook_resid_post"], atol=1e-6)


def test_attention_only_drops_the_mlp():
    m = tiny()
    ids = torch.randint(0, 200, (1, 8))
    h0 = C.embed(m, ids)
    (_, _), (_, h1) = list(C.looped(m, h0, passes=1, attention_only=True))[:2]
    b = m.blocks[0]
    pos = torch.arange(8)
    assert torch.allclose(h1, h0 + b.attn(b.ln1(h0), pos), atol=1e-6)


def test_redrawn_weights_change_each_pass_deterministically():
    m = tiny()
    C.redraw(m, 5)
    a = m.blocks[0].attn.W_qkv.weight.clone()
    C.redraw(m, 6)
    assert not torch.equal(a, m.blocks[0].attn.W_qkv.weight)
    C.redraw(m, 5)
    assert torch.equal(a, m.blocks[0].attn.W_qkv.weight)


def test_random_weights_are_gpt2_normals_drawn_in_place():
    """GPT-2's initialisation, closed form: weights N(0, σ²), residual projections N(0, σ²/(2L)), biases 0,
    gains 1; each tensor holds what `torch.randn(shape) · σ` draws from the seeded stream, in order."""
    m = tiny(d_model=64)
    from hybridlm.lm.model import init_weights

    init_weights(m, seed=11)
    g = torch.Generator().manual_seed(11)
    sigma, L = m.config.init_std, m.config.n_layer
    drawn = 0
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert not p.any()
        elif ("ln" in name or "norm" in name) and p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p))
        else:
            s = sigma / (2 * L) ** 0.5 if name.endswith(("W_O.weight", "W_proj.weight", "W_down.weight")) else sigma
            assert torch.equal(p, torch.randn(p.shape, generator=g) * s), name
            if p.numel() >= 4096:  # mean within 5 standard errors, std within 5 % (n ≥ 4096)
                assert abs(p.mean().item()) < 5 * s / p.numel() ** 0.5, name
                assert abs(p.std().item() / s - 1) < 0.05, name
            drawn += p.numel()
    assert drawn > m.num_parameters() // 2


def test_attention_only_redraw_skips_the_unused_mlp():
    """Attention only, a pass draws the blocks' attention and leaves the MLPs as they are; the draw is
    reproducible under its seed and has the initialisation's σ."""
    m = tiny(d_model=64)
    mlp = [p.clone() for p in m.blocks[0].mlp.parameters()]
    C.redraw(m, 5, attention_only=True)
    a = m.blocks[1].attn.W_qkv.weight.clone()
    assert [torch.equal(x, y) for x, y in zip(mlp, m.blocks[0].mlp.parameters())] == [True] * len(mlp)
    assert abs(a.std().item() / m.config.init_std - 1) < 0.05
    C.redraw(m, 6, attention_only=True)
    assert not torch.equal(a, m.blocks[1].attn.W_qkv.weight)
    C.redraw(m, 5, attention_only=True)
    assert torch.equal(a, m.blocks[1].attn.W_qkv.weight)
    C.redraw(m, 5)  # the full redraw draws the MLPs too
    assert not torch.equal(mlp[0], next(m.blocks[0].mlp.parameters()))


def test_consensus_is_reached_by_random_attention_loops():
    """Random fixed weights, attention only: E(k) decays towards 0 (the survey's Fig. 8, docs/theory.md §5.3)."""
    m = tiny()
    ids = C.random_prompts(m, 4, 16, seed=0)
    E = [s.E.mean().item() for s, _ in C.looped(m, C.embed(m, ids), passes=30, attention_only=True)]
    assert E[0] > 0.5
    assert E[-1] < 0.5 * E[0]
    assert all(b <= a + 1e-3 for a, b in zip(E[::9], E[9::9]))  # pass over pass it does not grow


def run(tmp_path, name, **kw):
    cfg = R.ConsensusConfig(model="random:gpt2", **kw)
    return cfg, tmp_path / name


def test_runner_writes_csv_json_png_and_resumes(tmp_path, monkeypatch):
    tiny_model = tiny()
    monkeypatch.setattr(R, "prepare_model", lambda cfg, device: tiny_model)
    cfg = R.ConsensusConfig(model="tiny", weights="random-redrawn", prompts=3, prompt_len=10, passes=4, seed=1)
    R.run_consensus(cfg, tmp_path / "full", progress=False)
    rows = list(csv.DictReader(open(tmp_path / "full" / "consensus.csv")))
    assert len(rows) == 1 + 4 * 3 and list(rows[0]) == R.COLUMNS
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["layer_steps"] == 12 and summary["config"]["weights"] == "random-redrawn"
    assert (tmp_path / "full" / "consensus.png").stat().st_size > 1000

    real_checkpoint = R.save_checkpoint

    def crash_after_two(out, cfg, h, done, info):
        real_checkpoint(out, cfg, h, done, info)
        if done == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(R, "save_checkpoint", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        R.run_consensus(cfg, tmp_path / "resumed", progress=False)
    monkeypatch.setattr(R, "save_checkpoint", real_checkpoint)
    R.run_consensus(cfg, tmp_path / "resumed", progress=False)
    resumed = list(csv.DictReader(open(tmp_path / "resumed" / "consensus.csv")))
    assert [r["layer_step"] for r in resumed] == [r["layer_step"] for r in rows]
    for a, b in zip(rows, resumed):
        assert float(a["E_mean"]) == pytest.approx(float(b["E_mean"]), abs=1e-6)
    other = R.ConsensusConfig(model="tiny", prompts=3, prompt_len=10, passes=4, seed=2)
    with pytest.raises(Exception, match="another configuration"):
        R.run_consensus(other, tmp_path / "resumed", progress=False)
    longer = R.ConsensusConfig(model="tiny", weights="random-redrawn", prompts=3, prompt_len=10, passes=6, seed=1)
    summary = R.run_consensus(longer, tmp_path / "resumed", progress=False)  # continued to more passes
    assert summary["layer_steps"] == 18
    extended = list(csv.DictReader(open(tmp_path / "resumed" / "consensus.csv")))
    assert [r["E_mean"] for r in extended[:13]] == [r["E_mean"] for r in resumed]


def test_cli_consensus_and_table1(tmp_path, toy_hub):
    from hybridlm.cli import cli

    out = tmp_path / "run"
    r = CliRunner().invoke(cli, ["consensus", "--model", str(toy_hub[0]), "--weights", "random-fixed",
                                 "--prompts", "2", "--prompt-len", "8", "--passes", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "after pass 2" in r.output and (out / "summary.json").exists()
    r = CliRunner().invoke(cli, ["consensus", "--model", str(toy_hub[0]), "--table1", "Deep neural networks, in their"])
    assert r.exit_code == 0, r.output
    assert [line.split()[0] for line in r.output.strip().splitlines()] == ["1", "2", "4", "10"]
    r = CliRunner().invoke(cli, ["consensus", "--model", str(toy_hub[0])])
    assert r.exit_code == 2 and "--out" in r.output


def test_random_run_model_is_drawn_once_from_the_run_seed():
    """A run on random:<preset> / random-<family>:<size> weights gets the loader's draw from its seed: the
    same weights as a model loaded with any seed and redrawn with the run's."""
    from hybridlm.analysis.consensus import reinit

    cfg = R.ConsensusConfig(model="random-ssm:tiny", weights="random-fixed", seed=4)
    got = R.prepare_model(cfg, "cpu")
    want = load_model("random-ssm:tiny")
    reinit(want, 4)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values(), strict=True))
    assert not torch.equal(got.W_e, load_model("random-ssm:tiny").W_e)


def test_compare_csv_holds_each_runs_mean_E(tmp_path, monkeypatch):
    """plot_compare(data=True): one column per run, its consensus.csv's E_mean at each layer-step, empty past
    the passes a shorter (unfinished) run has."""
    tiny_model = tiny()
    monkeypatch.setattr(R, "prepare_model", lambda cfg, device: tiny_model)
    for name, passes in (("long", 4), ("short", 2)):
        R.run_consensus(R.ConsensusConfig(model="tiny", weights="random-fixed", prompts=2, prompt_len=8, passes=passes),
                        tmp_path / name, progress=False)
    png = R.plot_compare({"long run": tmp_path / "long", "short run": tmp_path / "short"}, tmp_path / "cmp.png", data=True)
    table = list(csv.DictReader(open(png.with_suffix(".csv"))))
    assert list(table[0]) == ["layer_step", "long run", "short run"] and len(table) == 1 + 4 * 3
    for name, column in (("long", "long run"), ("short", "short run")):
        rows = list(csv.DictReader(open(tmp_path / name / "consensus.csv")))
        assert [float(t[column]) for t in table[:len(rows)]] == [float(r["E_mean"]) for r in rows]
    assert [t["short run"] for t in table[7:]] == [""] * 6
