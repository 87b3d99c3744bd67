"""Hostile weight files: every count and length of a GGUF or safetensors header, and every field
of a hub config.json, is checked against the file before anything is allocated or iterated.

The reference for "well formed" is the `gguf` package's own writer (GGUFWriter) and the
`safetensors` writer; the mutations below are made at byte offsets this file finds itself
from the format's documented layout, independently of hybridlm's reader.
"""

import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hybridlm.errors import ConfigError, HybridLMError, WeightsError
from hybridlm.weights.gguf import load_gguf_model
from tests.test_gguf import D, D_MLP, HEADS, KV_HEADS, VOCAB, tiny_tensors

TOKENS = ["t", "1", "t1"] + [f"w{i}" for i in range(VOCAB - 3)]


def write_tokenised_gguf(path):
    """A valid one-block Llama GGUF with a vocabulary (string and integer arrays) and a chat template."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_block_count(1)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["t 1"])
    writer.add_eos_token_id(1)
    for name, data in tiny_tensors().items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def key_offset(data: bytes, key: str) -> int:
    """Offset just after a metadata key's bytes (GGUF: u64 length, the key, then u32 value type)."""
    raw = key.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw)
    return at + 8 + len(raw)


def tensor_info_offset(data: bytes, name: str) -> int:
    """Offset just after a tensor's name in the tensor-info table (then u32 n_dims, u64 dims, u32 type, u64 offset)."""
    raw = name.encode()
    at = data.rindex(struct.pack("<Q", len(raw)) + raw)
    return at + 8 + len(raw)


def mutate(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    path = write_tokenised_gguf(tmp_path_factory.mktemp("gguf") / "tok.gguf")
    return path.read_bytes()


def mutations(data: bytes) -> dict[str, bytes]:
    tokens = key_offset(data, "tokenizer.ggml.tokens")  # u32 ARRAY, u32 STRING, u64 count
    types = key_offset(data, "tokenizer.ggml.token_type")
    template = key_offset(data, "general.architecture")  # u32 STRING, u64 length, bytes
    embd = tensor_info_offset(data, "token_embd.weight")
    huge = 0x00FF_FFFF_FFFF_FFFF
    return {
        "string array count": mutate(data, tokens + 8, "<Q", huge),
        "string array count 2^40": mutate(data, tokens + 8, "<Q", 1 << 40),
        "int array count": mutate(data, types + 8, "<Q", huge),
        "array element type": mutate(data, tokens + 4, "<I", 77),
        "value type": mutate(data, template, "<I", 99),
        "string length": mutate(data, template + 4, "<Q", huge),
        "key length": mutate(data, 24, "<Q", huge),
        "kv count": mutate(data, 16, "<Q", huge),
        "tensor count": mutate(data, 8, "<Q", huge),
        "tensor n_dims": mutate(data, embd, "<I", 0xFFFF_FFFF),
        "tensor dim": mutate(data, embd + 4, "<Q", huge),
        "tensor dim zero": mutate(data, embd + 4, "<Q", 0),
        "tensor dims overflow": mutate(mutate(data, embd + 4, "<Q", 1 << 62), embd + 12, "<Q", 1 << 62),
        "tensor type": mutate(data, embd + 4 + 16, "<I", 1000),
        "tensor offset": mutate(data, embd + 4 + 16 + 4, "<Q", huge),
        "tensor offset misaligned": mutate(data, embd + 4 + 16 + 4, "<Q", 3),
        "version": mutate(data, 4, "<I", 1),
    }


REPRO = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the unfixed reader grew to 14 GB
    from hybridlm.errors import WeightsError
    from hybridlm.weights.gguf import load_gguf_model
    try:
        load_gguf_model(sys.argv[1])
    except WeightsError as exc:
        print(f"WeightsError: {exc}")
        sys.exit(3)
""")


def test_mutated_array_count_is_one_weights_error_quickly(good_gguf, tmp_path):
    """The issue's repro: a valid GGUF from GGUFWriter, one array's element count mutated."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutations(good_gguf)["string array count"])
    env = {**os.environ, "HYBRIDLM_CACHE": str(tmp_path / "cache")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", REPRO, str(bad)], capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stdout.count("\n") == 1 and "tokenizer.ggml.tokens" in p.stdout, p.stdout
    assert "Traceback" not in p.stderr
    reference = subprocess.run([sys.executable, "-c", "import hybridlm.weights.gguf"], env=env, timeout=120)
    assert reference.returncode == 0
    print(f"mutated GGUF refused in {elapsed:.2f} s (subprocess, imports included)")


MUTATIONS = [
    "string array count", "string array count 2^40", "int array count", "array element type", "value type",
    "string length", "key length", "kv count", "tensor count", "tensor n_dims", "tensor dim", "tensor dim zero",
    "tensor dims overflow",
    "tensor type", "tensor offset", "tensor offset misaligned", "version"]


@pytest.mark.parametrize("kind", MUTATIONS)
def test_every_header_count_is_bounded(good_gguf, tmp_path, kind, monkeypatch):
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(mutations(good_gguf)[kind])
    t0 = time.perf_counter()
    with pytest.raises(WeightsError) as info:
        load_gguf_model(path)
    assert time.perf_counter() - t0 < 30
    assert "\n" not in str(info.value) and "m.gguf" in str(info.value)


def test_the_valid_file_still_loads(good_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "ok.gguf"
    path.write_bytes(good_gguf)
    model = load_gguf_model(path)
    assert model.config.vocab_size == VOCAB and model.tokenizer.eos_id == 1
    assert model.tokenizer.table.texts[5] == "w2"


def test_header_reader_agrees_with_gguf_on_the_default_model():
    """hybridlm's header reader against the gguf package's reader, field by field, on SmolLM2's file."""
    from hybridlm.weights.gguf import smollm2_path
    from hybridlm.weights.gguf_header import read_header

    def field_value(f):  # the gguf reader's field as a Python value (nested arrays: None, as hybridlm)
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.ARRAY:
                return None
            return [bytes(f.parts[i]).decode() if f.types[-1] == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0]
                    for i in f.data]
        part = f.parts[f.data[0]]
        return bytes(part).decode() if f.types[0] == gguf.GGUFValueType.STRING else part.tolist()[0]

    path = smollm2_path()
    ours = read_header(path)
    theirs = gguf.GGUFReader(path)
    expected = {name: field_value(f) for name, f in theirs.fields.items() if not name.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.kind == b.tensor_type and a.data_offset == b.data_offset and a.n_bytes == b.n_bytes
        assert a.shape == tuple(reversed(b.shape.tolist()))
        np.testing.assert_array_equal(np.asarray(a.data()).reshape(-1), np.asarray(b.data).view(np.uint8).reshape(-1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8))
def test_random_byte_damage_is_weights_error_or_loads(good_gguf, tmp_path, monkeypatch, damage):
    data = bytearray(good_gguf)
    for at, value in damage:
        data[at % len(data)] = value
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    try:
        load_gguf_model(path)
    except WeightsError as exc:
        assert "\n" not in str(exc)
    except HybridLMError:
        pass


def test_huge_sizes_in_gguf_metadata_allocate_nothing(tmp_path, monkeypatch):
    """A 100 KB file that claims d_mlp = 2^17, V = 2^21 and 4,096 blocks: refused before the model is built."""
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    for add, value in [(writer.add_context_length, 1 << 20), (writer.add_embedding_length, D),
                       (writer.add_block_count, 4096), (writer.add_feed_forward_length, 1 << 17),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, 1 << 21)]:
        add(value)
    for name, data in tiny_tensors().items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightsError, match="block|blk"):
        load_gguf_model(tmp_path / "big.gguf")


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2", "gemma3"])
def test_a_block_count_past_the_bound_is_refused_before_any_work_per_block(arch):
    """A block count of 2³² − 2 (a fuzzer's find on Gemma 3) is refused from the metadata alone: the local and
    global pattern, one entry per block, is never written out (it held the reader for minutes)."""
    from hybridlm.lm.config import MAX_SIZES
    from hybridlm.weights.gguf import config_from_metadata

    meta = {"general.architecture": arch, **{f"{arch}.{key}": value for key, value in [
        ("block_count", 2**32 - 2), ("embedding_length", 64), ("attention.head_count", 4), ("context_length", 128),
        ("feed_forward_length", 128), ("attention.layer_norm_rms_epsilon", 1e-6), ("attention.sliding_window", 16),
        ("vocab_size", 100)]}}
    with pytest.raises(WeightsError, match=f"t.gguf: {arch}.block_count=4,294,967,294: hybridlm supports at most "
                                           f"{MAX_SIZES['n_layer']:,}"):
        config_from_metadata(meta, set(), origin="t.gguf")


@pytest.mark.parametrize("key, value, fragment", [
    ("llama.embedding_length", "256", "llama.embedding_length"),
    ("llama.attention.layer_norm_rms_epsilon", [1.0], "layer_norm_rms_epsilon"),
    ("tokenizer.ggml.eos_token_id", "one", "eos_token_id"),
    ("tokenizer.ggml.eos_token_id", 10_000, "eos_token_id"),
    ("tokenizer.chat_template", 7, "chat_template"),
])
def test_wrongly_typed_gguf_metadata_is_named(tmp_path, monkeypatch, key, value, fragment):
    from hybridlm.weights.gguf import config_from_metadata, tokenizer_from_metadata
    from hybridlm.weights.gguf_header import read_header

    path = write_tokenised_gguf(tmp_path / "t.gguf")
    meta = dict(read_header(path).metadata)
    meta[key] = value
    with pytest.raises(WeightsError, match=fragment):
        config_from_metadata(meta, set(), origin="t.gguf")
        tokenizer_from_metadata(meta, name="t", vocab_size=VOCAB)


# ====================================================================== hub layout
@pytest.fixture()
def hub_copy(toy_hub, tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((toy_hub[0] / name).read_bytes())
    return folder


def load(folder):
    from hybridlm.weights.hub import load_hub_folder

    return load_hub_folder(folder)


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2, 3]", "JSON object"),
    ('"gpt2"', "JSON object"),
    ("[" * 100_000, "config.json"),
    ("\xff\xfe", "config.json"),
])
def test_config_json_that_is_no_object(hub_copy, text, fragment):
    (hub_copy / "config.json").write_text(text, encoding="latin-1")
    with pytest.raises((WeightsError, ConfigError), match=fragment) as info:
        load(hub_copy)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("n_embd", "64"), ("n_layer", 2.0), ("n_head", True), ("vocab_size", None), ("n_positions", [1024]),
    ("layer_norm_epsilon", "1e-5"), ("layer_norm_epsilon", -1), ("n_inner", {"a": 1}), ("model_type", 7),
    ("bos_token_id", "x"), ("eos_token_id", 1.5), ("initializer_range", "0.02"), ("activation_function", 3),
])
def test_wrongly_typed_config_field_is_named(hub_copy, field, value):
    cfg = json.loads((hub_copy / "config.json").read_text())
    cfg[field] = value
    (hub_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((WeightsError, ConfigError), match=field) as info:
        load(hub_copy)
    assert "\n" not in str(info.value)


def test_config_claiming_huge_sizes_allocates_nothing(hub_copy):
    cfg = json.loads((hub_copy / "config.json").read_text())
    cfg.update(n_layer=4096, n_embd=8192, n_head=64, vocab_size=1 << 21)
    (hub_copy / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with pytest.raises((WeightsError, ConfigError)):
        load(hub_copy)
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma2", "gemma3_text"])
def test_a_config_json_block_count_past_the_bound_is_refused_before_any_work_per_block(model_type):
    """config.json's num_hidden_layers of 2³² − 2 is refused from the fields alone: the per-block layer types
    are never written out."""
    from hybridlm.lm.config import MAX_SIZES
    from hybridlm.weights.families import hf_config, hf_family

    hf = {"model_type": model_type, "num_hidden_layers": 2**32 - 2, "hidden_size": 64, "num_attention_heads": 4,
          "max_position_embeddings": 128, "intermediate_size": 128, "vocab_size": 100, "sliding_window": 16}
    with pytest.raises(ConfigError, match=f"config.json: num_hidden_layers=4,294,967,294: hybridlm supports at "
                                          f"most {MAX_SIZES['n_layer']:,}"):
        hf_config(hf_family(model_type), hf)


def safetensors_with_header(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


@pytest.mark.parametrize("blob, fragment", [
    (safetensors_with_header(b"{}", length=1 << 60), "header"),
    (safetensors_with_header(b"[" * 100_000), "header"),
    (safetensors_with_header(b"\xff\xfe{}"), "header"),
    (safetensors_with_header(json.dumps({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40],
                                               "data_offsets": [0, 16]}}).encode(), b"\0" * 16), "a"),
    (safetensors_with_header(json.dumps({"a": {"dtype": "F32", "shape": [4],
                                               "data_offsets": [0, 1 << 50]}}).encode(), b"\0" * 16), "a"),
    (safetensors_with_header(json.dumps({"a": {"dtype": "F32", "shape": "4",
                                               "data_offsets": [0, 16]}}).encode(), b"\0" * 16), "a"),
    (safetensors_with_header(json.dumps({"a": {"dtype": "Q9", "shape": [4],
                                               "data_offsets": [0, 16]}}).encode(), b"\0" * 16), "Q9"),
    (safetensors_with_header(json.dumps({"a": [1]}).encode()), "a"),
])
def test_hostile_safetensors_headers(hub_copy, blob, fragment):
    (hub_copy / "model.safetensors").write_bytes(blob)
    with pytest.raises(WeightsError, match=fragment) as info:
        load(hub_copy)
    assert "\n" not in str(info.value)


def test_sharded_index_cannot_leave_the_folder(hub_copy, tmp_path):
    (tmp_path / "outside.safetensors").write_bytes((hub_copy / "model.safetensors").read_bytes())
    (hub_copy / "model.safetensors").unlink()
    (hub_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"wte.weight": "../outside.safetensors"}}))
    with pytest.raises(WeightsError, match="outside"):
        load(hub_copy)
    (hub_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(WeightsError, match="weight_map"):
        load(hub_copy)


def test_the_toy_folder_still_loads(hub_copy, toy_model):
    import torch

    assert torch.equal(load(hub_copy).W_e, toy_model.W_e)
