"""Resident memory of loading a model, by part: what is read and kept beyond the weights.

Each bound is on memory (tracemalloc's peak, or a fresh process's resident size), never on time:
the vocabulary's arrays are not read when only the weights are, a model's skeleton on the meta
device pulls in no symbolic-shape machinery, and a tokenizer read from the cache's JSON hands the
library's parse back to the system."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tracemalloc

import pytest

from hybridlm.errors import WeightsError
from hybridlm.weights.gguf import config_from_metadata
from hybridlm.weights.gguf_header import Unread, read_header


def _traced_peak(read) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = read()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_weights_alone_leave_the_vocabulary_unread(smollm2):
    path = smollm2.gguf_path
    full, full_peak = _traced_peak(lambda: read_header(path))
    light, light_peak = _traced_peak(lambda: read_header(path, vocabulary=False))
    arrays = [k for k, v in full.metadata.items() if k.startswith("tokenizer.ggml.") and isinstance(v, list)]
    assert "tokenizer.ggml.tokens" in arrays
    for key, value in full.metadata.items():
        if key in arrays:
            assert isinstance(light.metadata[key], Unread) and len(light.metadata[key]) == len(value)
        else:
            assert light.metadata[key] == value
    assert [t.name for t in light.tensors] == [t.name for t in full.tensors]
    n_tokens = len(full.metadata["tokenizer.ggml.tokens"])
    assert light_peak < 16 * n_tokens < full_peak, (light_peak, full_peak)  # under 16 bytes a token, not its strings
    # the vocabulary's size where the metadata name none: the count of the unread token list
    arch = full.metadata["general.architecture"]
    no_size = {k: v for k, v in light.metadata.items() if k != f"{arch}.vocab_size"}
    assert config_from_metadata(no_size, light, origin="x").vocab_size == n_tokens


def test_an_unread_vocabulary_is_still_bounded_by_the_file(smollm2, tmp_path):
    """A file cut inside its token list is refused alike whether the list is read or only walked."""
    data = smollm2.gguf_path.read_bytes()
    header = read_header(smollm2.gguf_path, vocabulary=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:header.data_start // 2])
    for vocabulary in (True, False):
        with pytest.raises(WeightsError, match="truncated or corrupt header"):
            read_header(cut, vocabulary=vocabulary)


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_a_model_skeleton_on_the_meta_device_imports_no_sympy(smollm2):
    """PyTorch's meta `arange` imports sympy (some 80 MB resident); the rotary tables are made without it."""
    code = (f"import sys, torch; from hybridlm.weights.gguf import read_gguf; from hybridlm.lm.model import DecoderLM\n"
            f"cfg = read_gguf(__import__('pathlib').Path({str(smollm2.gguf_path)!r}), tokenizer=False)[0]\n"
            "with torch.device('meta'):\n    m = DecoderLM(cfg)\n"
            "print(m.rotary is not None, 'sympy' in sys.modules)")
    assert _fresh(code).split() == ["True", "False"]


def _synthetic_bpe(n_merges: int, seed: int = 0) -> dict:
    """A byte-level BPE of 256 symbols and `n_merges` merges, each joining two earlier tokens, in the
    cache's form (`tokenizer_to_json`)."""
    from hybridlm.tokenizer import Tokenizer, byte_level_bpe
    from hybridlm.weights.vocab import tokenizer_to_json

    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(0x100, 0x200)]  # one Unicode symbol per byte, as GPT-2's alphabet
    tokens, merges = list(alphabet), []
    vocab = dict.fromkeys(tokens)
    while len(merges) < n_merges:
        first = min(len(tokens), 5000)  # (pairs of the first tokens: 25 million of them, short ones)
        left, right = tokens[rng.randrange(first)], tokens[rng.randrange(first)]
        if left + right not in vocab:
            vocab[left + right] = None
            tokens.append(left + right)
            merges.append((left, right))
    ids = {t: i for i, t in enumerate(tokens)}
    return tokenizer_to_json(Tokenizer(byte_level_bpe(ids, merges), eos_id=0))


def test_a_tokenizer_from_the_cache_keeps_no_parse(tmp_path):
    """`tokenizer_from_json` of a large vocabulary: the library parses its JSON through a tree of its own,
    freed when it returns; what the process then holds is the tokenizer (some 190 bytes a token and a
    merge), not that tree as well (390 bytes, kept by the C library's heap until handed back)."""
    n = 300_000
    stored = tmp_path / "tokenizer.json"
    stored.write_text(json.dumps(_synthetic_bpe(n)), encoding="utf-8")
    code = ("import json, sys\nfrom hybridlm.weights.vocab import tokenizer_from_json\n"
            "rss = lambda: int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024\n"
            f"text = open({str(stored)!r}, encoding='utf-8').read()\n"
            "before = rss(); tok = tokenizer_from_json(text); after = rss()\n"
            "print(after - before, tok.vocab_size)")
    grown, size = map(int, _fresh(code).split())
    assert size == 256 + n
    assert grown < 250 * (size + n), grown / (size + n)
