"""Every family of the registry against transformers, on tiny random models it builds from config
objects (tests/families.py): the Hugging Face folder read by hybridlm gives transformers' logits
within 1e-4 over sequences of 40 tokens (five windows of the sliding families), the same greedy
continuation of 32 tokens, and a cached decode that equals a full recompute on the compiled path and
on PyTorch's; every hook point fires on every family."""

from __future__ import annotations

import json

import pytest
import torch
from families import FAMILIES, WINDOW, V, make_folder, reference

from hybridlm.errors import ConfigError, HybridLMError, WeightsError
from hybridlm.lm import kernels
from hybridlm.lm.capture import Recorder
from hybridlm.lm.config import ModelConfig
from hybridlm.weights.hub import load_hub_folder

TOL = 1e-4
N = 40  # ≥ 3 windows of the sliding families


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, transformers model read from it)}"""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, name in enumerate(FAMILIES):
        make_folder(name, root / name, seed=i)
        out[name] = (root / name, reference(root / name))
    return out


def ids(n=N, seed=0):
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt, steps=32):
    """Greedy continuation through the state-space form (cached decode)."""
    x = model.init_state(prompt)
    out = []
    for _ in range(steps):
        w = int(model.G(x)[0].argmax())
        out.append(w)
        model.F(x, [w])
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_folder_logits_match_transformers(folders, name):
    folder, ref = folders[name]
    model = load_hub_folder(folder, tokenizer=False)
    s = ids()
    with torch.no_grad():
        delta = (model(s) - ref(s).logits).abs().max().item()
    print(f"{name}: folder, max |Δlogit| = {delta:.2e}")
    assert delta <= TOL
    assert model.config.family == {"llama3": "llama", "phi3.5": "phi3"}.get(name, name)


@pytest.mark.parametrize("name", FAMILIES)
def test_folder_greedy_continuation_matches_transformers(folders, name):
    folder, ref = folders[name]
    model = load_hub_folder(folder, tokenizer=False)
    prompt = ids(N, seed=1)
    with torch.no_grad():
        theirs = ref.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32, pad_token_id=0)
    assert greedy(model, prompt[0].tolist()) == theirs[0, N:].tolist()


def no_kernels(monkeypatch):
    for name in ("blocks", "decode_attention", "affine"):
        monkeypatch.setattr(kernels, name, lambda: None)


@pytest.mark.parametrize("compiled", [True, False], ids=["kernels", "pytorch"])
@pytest.mark.parametrize("name", FAMILIES)
def test_cached_decode_equals_recompute(folders, name, compiled, monkeypatch):
    if not compiled:
        no_kernels(monkeypatch)
    elif kernels.library() is None:
        pytest.skip(f"kernels unavailable: {kernels.status()}")
    model = load_hub_folder(folders[name][0], tokenizer=False)
    s = ids(N + 12, seed=2)[0].tolist()
    x = model.init_state(s[:N - 10])
    worst = 0.0
    with torch.no_grad():
        for n in range(N - 10, len(s)):
            worst = max(worst, (model.G(x)[0] - model(torch.tensor([s[:n]]))[0, -1]).abs().max().item())
            model.F(x, [s[n]])
    assert worst <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_every_hook_point_fires_and_observing_changes_nothing(folders, name):
    model = load_hub_folder(folders[name][0], tokenizer=False)
    s = ids(20, seed=3)[0].tolist()
    x = model.init_state(s)
    model.F(x, [5])
    plain = model.G(x).clone()
    rec = Recorder(model)
    with model.hooks(rec.hooks()):
        y = model.init_state(s)
        model.F(y, [5])
    fired = {key.split("@")[0] for key in rec.records if not key.endswith(":pos")}
    assert fired == set(model.hook_points)
    assert torch.allclose(model.G(y), plain, atol=1e-5)  # (explicit attention rounds like SDPA within float32)
    family = model.config
    new = [n for n in model.hook_points if "q_norm." in n or "ln1_post." in n]
    assert bool(new) == (family.qk_norm or family.post_norms)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_precision_runs_on_every_family(folders, name):
    """--precision on each family: bfloat16 and int8 within rounding of their grids of the float32 logits
    (measured ≤ 0.12 at logits up to 3.9); int4 (random weights lose most to 4 bits) runs, prefill and step."""
    from hybridlm.lm.quantize import set_precision

    s = ids()
    with torch.no_grad():
        exact = load_hub_folder(folders[name][0], tokenizer=False)(s)
        for precision, bound in (("bfloat16", 0.2), ("int8", 0.2), ("int4", 2.0)):
            model = set_precision(load_hub_folder(folders[name][0], tokenizer=False), precision)
            assert (model(s).float() - exact).abs().max().item() <= bound
            x = model.init_state(s[0, :30].tolist())
            model.F(x, [3])
            assert torch.isfinite(model.G(x)).all()


def test_models_lists_each_family_and_what_a_path_may_hold():
    from hybridlm.weights.loading import available_models

    rows = [r for r in available_models() if r["name"] == "PATH"]
    assert {r["family"] for r in rows} == {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}
    gemma = next(r for r in rows if r["family"] == "gemma3")
    assert "architecture 'gemma3'" in gemma["source"] and "'gemma3_text'" in gemma["source"]


def test_family_parts_are_config_fields(folders):
    """What each family is, as data: the config fields its folder sets."""
    def config(name):
        return load_hub_folder(folders[name][0], tokenizer=False).config

    g3, g2, q3, q2, l3, mi, p35 = (config(n) for n in ("gemma3", "gemma2", "qwen3", "qwen2", "llama3", "mistral",
                                                        "phi3.5"))
    assert g3.qk_norm and g3.post_norms and g3.mlp == "geglu" and g3.d_head == 24 != g3.d_model // g3.n_head
    assert g3.attention_layers == ("local",) * 5 + ("global", "local") and g3.rope_local_theta == 10000.0
    assert g3.rope_theta == 1e6 and g3.final_softcap == 15.0 and g3.attn_softcap is None
    assert g3.embed_scale == pytest.approx(8.0) and g3.attn_scale == pytest.approx(24**-0.5)
    assert g2.attention_layers == ("local", "global", "local") and g2.attn_softcap == 50.0 and g2.local_window == WINDOW
    assert q3.qk_norm and not q3.attn_bias and q2.attn_bias and not q2.attn_out_bias
    assert l3.rope_freq_factors[0] == 1.0 and l3.rope_freq_factors[-1] == 8.0
    assert mi.attention_layers == ("local",) * 3 and p35.rope_attn_factor > 1
    for cfg in (g3, g2, q3, q2, l3, mi, p35):
        assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    # Gemma's scale is query_pre_attn_scalar^(−1/2), which need not be d_k (a GGUF file does not carry it:
    # llama.cpp scales by 1/√d_k, and the published models have query_pre_attn_scalar = d_k)
    from hybridlm.weights.families import FAMILIES as REGISTRY
    from hybridlm.weights.families import hf_config

    hf = json.loads((folders["gemma3"][0] / "config.json").read_text())
    assert hf_config(REGISTRY["gemma3"], {**hf, "query_pre_attn_scalar": 20}).attn_scale == pytest.approx(20**-0.5)


def test_a_sharded_folder_reads_like_one_file(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = folders["qwen2"][0]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, sharded / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (sharded / "config.json").write_bytes((folder / "config.json").read_bytes())
    a, b = load_hub_folder(folder, tokenizer=False), load_hub_folder(sharded, tokenizer=False)
    assert torch.equal(a(ids()), b(ids()))
    # a truncated shard is named, before any weight is read
    shard = sharded / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors.*truncated"):
        load_hub_folder(sharded, tokenizer=False)


def copy_folder(folder, to, config_change=None, tensors_change=None):
    from safetensors.torch import load_file, save_file

    to.mkdir()
    hf = json.loads((folder / "config.json").read_text())
    if config_change:
        config_change(hf)
    (to / "config.json").write_text(json.dumps(hf))
    tensors = load_file(folder / "model.safetensors")
    if tensors_change:
        tensors_change(tensors)
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


@pytest.mark.parametrize("change, error, fragment", [
    (lambda hf: hf.update(head_dim=23), ConfigError, "head"),
    (lambda hf: hf.update(num_key_value_heads=3), ConfigError, "n_kv_head=3"),
    (lambda hf: hf.update(layer_types=["full_attention"]), ConfigError, "layer_types"),
    (lambda hf: hf.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), ConfigError,
     "rope type 'yarn'"),
    (lambda hf: hf.update(hidden_activation="relu"), ConfigError, "relu"),
    (lambda hf: hf.update(vocab_size="300"), ConfigError, "vocab_size"),
    (lambda hf: hf.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), ConfigError, "factor"),
])
def test_an_inconsistent_config_json_is_one_line_naming_the_value(folders, tmp_path, change, error, fragment):
    folder = copy_folder(folders["gemma3"][0], tmp_path / "bad", config_change=change)
    with pytest.raises(error, match=fragment) as info:
        load_hub_folder(folder, tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, fragment", [
    (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"), "model.layers.1.self_attn.k_norm.weight.*missing"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}),
     r"model.layers.0.mlp.up_proj.weight.*\[95, 64\].*\[96, 64\]"),
    (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(96, 64)}), "layers.9.*no place"),
])
def test_a_tensor_that_does_not_fit_is_named(folders, tmp_path, change, fragment):
    folder = copy_folder(folders["gemma3"][0], tmp_path / "bad", tensors_change=change)
    with pytest.raises(WeightsError, match=fragment):
        load_hub_folder(folder, tokenizer=False)


def test_unknown_model_type_lists_the_families(tmp_path, folders):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "bad", config_change=lambda hf: hf.update(model_type="mamba"))
    with pytest.raises(HybridLMError, match="mamba.*gemma3_text.*qwen2"):
        load_hub_folder(folder)


# ====================================================================== GGUF files of llama.cpp's converter
@pytest.fixture(scope="module")
def ggufs(folders, llama_cpp_source, tmp_path_factory):
    """{family: GGUF file} written by llama.cpp's converter from each folder (float32). The converter
    writes no sliding window for Mistral (llama.cpp's `llama` architecture has none); the window of the
    folder's config is added to that file's metadata (`llama.attention.sliding_window`)."""
    from families import convert, with_metadata

    root = tmp_path_factory.mktemp("ggufs")
    jobs = {name: (folders[name][0], root / f"{name}.gguf") for name in FAMILIES}
    convert(llama_cpp_source, list(jobs.values()))
    out = {name: out for name, (_, out) in jobs.items()}
    out["mistral (as converted)"] = out["mistral"]
    out["mistral"] = with_metadata(out["mistral"], root / "mistral-window.gguf",
                                   {"llama.attention.sliding_window": WINDOW})
    return out


def gguf_model(path):
    from hybridlm.weights.gguf import load_gguf_model

    return load_gguf_model(path, tokenizer=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_converted_gguf_logits_match_transformers_on_the_folder(folders, ggufs, name):
    model = gguf_model(ggufs[name])
    s = ids()
    with torch.no_grad():
        delta = (model(s) - folders[name][1](s).logits).abs().max().item()
    print(f"{name}: converter's GGUF, max |Δlogit| = {delta:.2e}")
    assert delta <= TOL
    prompt = ids(N, seed=1)
    with torch.no_grad():
        theirs = folders[name][1].generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                           pad_token_id=0)
    assert greedy(model, prompt[0].tolist()) == theirs[0, N:].tolist()


def test_mistral_as_converted_matches_within_its_window(folders, ggufs):
    """llama.cpp's converter drops Mistral's window: within one window the file still gives the
    folder's logits; past it, the file has no window to apply."""
    model = gguf_model(ggufs["mistral (as converted)"])
    assert model.config.attention_layers is None
    s = ids(WINDOW)
    with torch.no_grad():
        assert (model(s) - folders["mistral"][1](s).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("change, fragment", [
    (dict(drop=("blk.1.attn_k_norm.weight",)), "blk.1.attn_k_norm.weight.*missing"),
    (dict(extra={"gemma3.attention.key_length": 16}), "value_length=24 differs from the head size 16"),
    (dict(extra={"gemma3.feed_forward_length": 95}), r"blk.0.ffn_gate.weight.*\[96, 64\].*\[95, 64\]"),
    (dict(extra={"gemma3.block_count": 9}), "9 blocks.*block 7"),
    (dict(extra={"gemma3.attention.head_count_kv": 3}), "n_kv_head=3"),
])
def test_a_gguf_that_contradicts_itself_is_one_line_exit_2(ggufs, tmp_path, change, fragment):
    """Named before any tensor is dequantised, and `hybridlm generate` exits 2 with that one line."""
    from click.testing import CliRunner
    from families import with_metadata

    from hybridlm.cli import cli

    bad = with_metadata(ggufs["gemma3"], tmp_path / "bad.gguf", change.get("extra", {}), change.get("drop", ()))
    with pytest.raises(WeightsError, match=fragment) as info:
        gguf_model(bad)
    assert "\n" not in str(info.value)
    r = CliRunner().invoke(cli, ["generate", "hi", "--model", str(bad), "-n", "1"])
    assert r.exit_code == 2 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


# ====================================================================== quantised files
#: llama.cpp's file types quantised here (every block type Q8_0, Q4_0–Q5_1, Q2_K–Q6_K occurs in them).
QUANTS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
QUANT_FAMILIES = ("qwen2", "llama3", "gemma3")


@pytest.fixture(scope="module")
def quantised(llama_cpp_source, tmp_path_factory):
    """{(family, file type): (folder, GGUF file)}: models of rows of 256 (K-quant super-blocks),
    converted by llama.cpp's converter and quantised by its quantiser."""
    from families import convert, quantize

    root = tmp_path_factory.mktemp("quantised")
    for name in QUANT_FAMILIES:
        make_folder(name, root / name, seed=7, wide=True)
    convert(llama_cpp_source, [(root / name, root / f"{name}-F32.gguf") for name in QUANT_FAMILIES])
    quantize([(root / f"{name}-F32.gguf", root / f"{name}-{kind}.gguf", kind)
              for name in QUANT_FAMILIES for kind in QUANTS])
    return {(name, kind): (root / name, root / f"{name}-{kind}.gguf") for name in QUANT_FAMILIES for kind in QUANTS}


def test_every_block_type_occurs(quantised):
    from hybridlm.weights.gguf_header import read_header

    kinds = {t.kind.name for _, path in quantised.values() for t in read_header(path).tensors}
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= kinds


@pytest.mark.parametrize("kind", QUANTS)
@pytest.mark.parametrize("name", QUANT_FAMILIES)
def test_quantised_file_matches_transformers_on_its_dequantised_weights(quantised, name, kind):
    from families import dequantised_reference

    folder, path = quantised[(name, kind)]
    ref = dequantised_reference(folder, path, name)
    model = gguf_model(path)
    s = ids()
    with torch.no_grad():
        delta = (model(s) - ref(s).logits).abs().max().item()
    print(f"{name} {kind}: max |Δlogit| = {delta:.2e}")
    assert delta <= TOL
