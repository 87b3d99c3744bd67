"""The GPT-Neo family against transformers' GPTNeoForCausalLM on the same random weights.

GPT-Neo differs from GPT-2 in the attention only: unscaled scores, no b_Q/b_K/b_V, and
blocks alternating between the global causal mask and a local band i − w < j ≤ i.
"""

import json

import pytest
import torch

from hybridlm import ModelConfig, load_model
from hybridlm.lm.attention import causal_mask
from hybridlm.lm.config import PRESETS
from hybridlm.weights.hub import HUB_REPOS, gptneo_config, gptneo_hub_config
from hybridlm.errors import ConfigError
from hybridlm.weights.hub import load_hub_folder, save_hub_folder
from tests.conftest import perturb_, perturb_biases_and_gains_
from tests.test_state import check_run

torch.set_num_threads(1)

TOL = 1e-4
WINDOW = 8


def make_hub_gptneo(folder, *, num_layers, hidden_size, num_heads, window_size, max_positions, qk_gain=1.0,
                    seed=0):
    """Random GPT-Neo weights written by transformers in the hub layout (independent of hybridlm).

    Biases and norm gains get noise, so a misplaced tensor shows in the logits; `qk_gain`
    scales W_Q and W_K to make attention more peaked (the scores are not scaled by 1/√d_k,
    so a large gain on a wide model makes the logits chaotic even in float32).
    """
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoConfig(
        vocab_size=50257, max_position_embeddings=max_positions, hidden_size=hidden_size,
        num_layers=num_layers, num_heads=num_heads, window_size=window_size,
        attention_types=[[["global", "local"], num_layers // 2]],
        resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTNeoForCausalLM(config).eval()
    perturb_biases_and_gains_(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def neo(tmp_path_factory):
    """A 4-layer GPT-Neo (window 8, T = 48) in the hub layout: (folder, transformers model, ours)."""
    folder = tmp_path_factory.mktemp("toy_gptneo")
    ref = make_hub_gptneo(folder, num_layers=4, hidden_size=64, num_heads=4, window_size=WINDOW, max_positions=48,
                          qk_gain=4.0)
    return folder, ref, load_model(folder)


def ids_for(n, batch=2, seed=None):
    return torch.randint(0, 50257, (batch, n), generator=torch.Generator().manual_seed(n if seed is None else seed))


def max_delta(ours, ref, ids):
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    assert a.shape == b.shape == (*ids.shape, ours.config.vocab_size)
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------- parity
def test_reads_gptneo_layout(neo):
    _, _, ours = neo
    cfg = ours.config
    assert (cfg.family, cfg.attn_scale, cfg.local_window) == ("gpt-neo", 1.0, WINDOW)
    assert cfg.attention_layers == ("global", "local", "global", "local")
    attn = ours.blocks[1].attn
    assert attn.W_qkv.bias is None and attn.W_O.bias is not None and attn.window == WINDOW
    assert ours.blocks[0].attn.window is None and ours.tokenizer is not None


@pytest.mark.parametrize("n", [1, 17, 40])
def test_toy_parity(neo, n):
    _, ref, ours = neo
    delta = max_delta(ours, ref, ids_for(n))
    print(f"gpt-neo toy (window {WINDOW}) n={n}: max |Δlogit| = {delta:.2e}")
    assert delta <= TOL


def test_window_and_scale_matter(neo):
    """Control: dropping the local band or restoring 1/√d_k moves the logits well beyond TOL."""
    _, ref, ours = neo
    ids = ids_for(40)
    for change in (dict(attention_layers=None), dict(attn_scale=None)):
        other = load_model(ours.config.replace(**change))
        other.load_state_dict(ours.state_dict())
        delta = max_delta(other, ref, ids)
        print(f"gpt-neo toy with {change}: max |Δlogit| = {delta:.2e}")
        assert delta > 10 * TOL, change


def test_our_layout_reads_back_in_transformers(tmp_path):
    """hybridlm's own random GPT-Neo, written in the hub layout, is read by transformers identically."""
    from transformers import GPTNeoForCausalLM

    cfg = PRESETS["gpt-neo-125m"].replace(n_ctx=40, d_model=48, n_layer=2, n_head=3, n_kv_head=3,
                                          attention_layers=("global", "local"), local_window=5)
    ours = load_model(cfg, seed=5)
    perturb_(ours)  # give biases and gains non-trivial values too
    save_hub_folder(ours, tmp_path)
    ref = GPTNeoForCausalLM.from_pretrained(tmp_path).eval()
    assert max_delta(ours, ref, ids_for(33, batch=3)) <= TOL
    back = load_hub_folder(tmp_path)
    assert back.config == cfg.replace(init_std=back.config.init_std)


@pytest.mark.slow
def test_gptneo_125m_shape_parity(tmp_path_factory):
    """The published gpt-neo-125m shape (random weights) on 300 tokens: the window of 256 bites."""
    folder = tmp_path_factory.mktemp("gptneo_125m")
    ref = make_hub_gptneo(folder, num_layers=12, hidden_size=768, num_heads=12, window_size=256,
                          max_positions=2048, seed=2)
    ours = load_model(folder)
    assert ours.config == PRESETS["gpt-neo-125m"].replace(init_std=ours.config.init_std)
    delta = max_delta(ours, ref, ids_for(300, batch=1))
    print(f"gpt-neo-125m shape (random weights) n=300: max |Δlogit| = {delta:.2e}")
    assert delta <= TOL


@pytest.mark.slow
def test_random_preset_loads():
    model = load_model("random:gpt-neo-125m")
    assert model.config == PRESETS["gpt-neo-125m"] and model.tokenizer is not None
    assert model.num_parameters() == 125_198_592  # the published checkpoint's count (tied W_u)


# ---------------------------------------------------------------------- the state
def test_decode_equals_recompute_across_window_and_horizon(neo):
    """F/G from a 5-token prompt for 50 steps: past the window (8) and the horizon (T = 48)."""
    _, _, ours = neo
    worst, rebuilds = check_run(ours, ids_for(5, batch=1)[0].tolist(), steps=50)
    print(f"gpt-neo toy decode, 50 steps: {rebuilds} rebuilds, max |Δlogit| = {worst:.2e}")
    assert rebuilds == 5 + 50 - 48
    assert worst <= TOL


@pytest.mark.parametrize("split", [3, 12, 30])
def test_block_entering_state_equals_recompute(neo, split):
    """A block of tokens entering a non-empty state (the masked path, with the band cutting)."""
    _, _, ours = neo
    ids = ids_for(40)
    x = ours.init_state(ids[:, :split])
    ours.F(x, ids[:, split:])
    with torch.no_grad():
        full = ours(ids)[:, -1]
    assert (ours.G(x) - full).abs().max().item() <= TOL


# ---------------------------------------------------------------------- the explicit path
def band(n_queries, n_keys, w):
    i = torch.arange(n_keys - n_queries, n_keys)[:, None]
    j = torch.arange(n_keys)[None, :]
    return (j <= i) & (j > i - w)


def test_causal_mask_window():
    pos = torch.arange(3, 6)
    assert torch.equal(causal_mask(pos, 6), torch.arange(6)[None, :] <= pos[:, None])
    assert causal_mask(pos, 6, window=2).int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


def test_pattern_hook_path_matches_and_is_banded(neo):
    _, _, ours = neo
    ids = ids_for(40)
    with torch.no_grad():
        fused = ours(ids)
    logits, cache = ours.run_with_cache(ids, names=lambda n: n.endswith("attn.hook_pattern"))
    assert (logits - fused).abs().max().item() <= 1e-5
    local, glob = cache["blocks.1.attn.hook_pattern"], cache["blocks.0.attn.hook_pattern"]
    assert local.shape == (2, 4, 40, 40)
    assert torch.all(local[..., ~band(40, 40, WINDOW)] == 0)
    assert torch.all(glob[..., ~band(40, 40, 40)] == 0) and (glob[..., 20, :12] > 0).all()
    assert torch.allclose(local.sum(-1), torch.ones(2, 4, 40), atol=1e-5)


def test_pattern_hook_path_with_state(neo):
    """Decode steps and a block entering the state give the same readout with the hook active."""
    _, _, ours = neo
    ids = ids_for(30)
    seen = []
    hook = {"blocks.1.attn.hook_pattern": lambda p, hook: seen.append(p)}
    a, b = ours.init_state(ids[:, :10]), ours.init_state(ids[:, :10])
    ours.F(a, ids[:, 10:20])
    with ours.hooks(hook):
        ours.F(b, ids[:, 10:20])
    assert (ours.G(a) - ours.G(b)).abs().max().item() <= 1e-5
    for j in range(20, 30):
        ours.F(a, ids[:, j])
        with ours.hooks(hook):
            ours.F(b, ids[:, j])
        assert (ours.G(a) - ours.G(b)).abs().max().item() <= 1e-5
    last = seen[-1]
    assert last.shape == (2, 4, 1, 30) and torch.all(last[..., : 30 - WINDOW] == 0)


# ---------------------------------------------------------------------- configuration
def test_presets():
    for name, (d, L, h) in {"gpt-neo-125m": (768, 12, 12), "gpt-neo-1.3b": (2048, 24, 16),
                            "gpt-neo-2.7b": (2560, 32, 20)}.items():
        c = PRESETS[name]
        assert (c.family, c.d_model, c.n_layer, c.n_head, c.n_ctx, c.vocab_size) == ("gpt-neo", d, L, h, 2048, 50257)
        assert c.attention_layers == ("global", "local") * (L // 2) and c.local_window == 256
        assert (c.attn_scale, c.attn_bias, c.attn_out_bias, c.tie_embeddings) == (1.0, False, True, True)
        assert HUB_REPOS[name].startswith("EleutherAI/gpt-neo-")
        hf = gptneo_hub_config(c)
        assert hf["attention_types"] == [[["global", "local"], L // 2]]
        assert gptneo_config(hf) == c


def test_config_json_round_trip():
    c = PRESETS["gpt-neo-1.3b"]
    back = ModelConfig.from_dict(json.loads(c.to_json()))
    assert back == c and isinstance(back.attention_layers, tuple)
    assert ModelConfig.from_dict(json.loads(PRESETS["gpt2"].to_json())) == PRESETS["gpt2"]


@pytest.mark.parametrize("change, message", [
    (dict(attention_layers=("global", "local")), "names 2 blocks but n_layer=4"),
    (dict(attention_layers=("global", "local", "sliding", "local")), "'sliding'.*one of"),
    (dict(attention_layers="global"), "expected a list"),
    (dict(local_window=0), "local_window=0"),
    (dict(attn_scale=-1.0), "attn_scale=-1.0"),
])
def test_config_errors(change, message):
    base = dict(vocab_size=100, n_ctx=32, d_model=16, n_layer=4, n_head=2)
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**base, **change)


def test_hub_config_errors(tmp_path):
    hf = gptneo_hub_config(PRESETS["gpt-neo-125m"])
    with pytest.raises(ConfigError, match="attention_types"):
        gptneo_config({**hf, "attention_types": [["global", 12]]})
    with pytest.raises(ConfigError, match="names 6 blocks but n_layer=12"):
        gptneo_config({**hf, "attention_types": [[["global", "local"], 3]]})
    with pytest.raises(ConfigError, match="lacks the field 'num_heads'"):
        gptneo_config({k: v for k, v in hf.items() if k != "num_heads"})
    with pytest.raises(ConfigError, match="cannot express"):
        gptneo_hub_config(PRESETS["gpt-neo-125m"].replace(attn_scale=None))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="model_type 'bert' is not supported.*gpt_neo"):
        load_model(tmp_path)
