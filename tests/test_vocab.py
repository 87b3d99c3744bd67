"""Tokenizers built from model files, against references independent of hybridlm.

- llama.cpp's own tokenizer cases: every `models/ggml-vocab-*.gguf` of type 'gpt2' or 'llama' that has
  `.inp`/`.out` files (the ids the model's Hugging Face tokenizer gives, written by llama.cpp's
  tests/test-tokenizer-0.py; read as tests/test-tokenizer-0.cpp reads them: no BOS, special tokens not
  parsed) must come out exactly, from the GGUF metadata and from folders rebuilt from it.
- llama.cpp's tokenizer itself (llama-cpp-python, vocab_only) on the real Qwen2.5 and Gemma 3 files.
- transformers (reading the folders hybridlm writes, and its own GGUF conversion) and sentencepiece
  (on the tokenizer.model made from a SentencePiece vocabulary).
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.errors import WeightsError
from hybridlm.weights.gguf_header import read_header
from hybridlm.weights.vocab import PRE_TOKENIZERS, tokenizer_from_metadata

#: The vocabulary files with cases, of the two types hybridlm builds (llama.cpp 0.3.36's models/).
CASE_FILES = {
    "command-r": "gpt2", "deepseek-coder": "gpt2", "deepseek-llm": "gpt2", "falcon": "gpt2", "gpt-2": "gpt2",
    "llama-bpe": "gpt2", "llama-spm": "llama", "mpt": "gpt2", "phi-3": "llama", "qwen2": "gpt2",
    "qwen35": "gpt2", "refact": "gpt2", "starcoder": "gpt2",
}
SEPARATOR = "\n__ggml_vocab_test__\n"


def read_cases(path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of a vocabulary file, split as test-tokenizer-0.cpp splits them."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()  # the C++ reader stops at the end: no empty case after the last separator
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), path.name
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def vocab_path(source, name):
    return source / "models" / f"ggml-vocab-{name}.gguf"


@pytest.fixture(scope="module")
def vocab(llama_cpp_source):
    """name → (metadata, tokenizer, cases), built once per file."""
    built = {}

    def get(name):
        if name not in built:
            path = vocab_path(llama_cpp_source, name)
            meta = read_header(path).metadata
            built[name] = meta, tokenizer_from_metadata(meta, name=name), read_cases(path)
        return built[name]

    return get


# ====================================================================== llama.cpp's cases
def test_every_vocabulary_with_cases_is_checked(llama_cpp_source):
    found = {}
    for path in (llama_cpp_source / "models").glob("ggml-vocab-*.gguf"):
        kind = read_header(path).metadata.get("tokenizer.ggml.model")
        if kind in ("gpt2", "llama") and path.with_name(path.name + ".inp").is_file():
            found[path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")] = kind
    assert found == CASE_FILES


@pytest.mark.parametrize("name", sorted(CASE_FILES))
def test_ids_equal_llama_cpp_cases(vocab, name):
    meta, tok, cases = vocab(name)
    assert meta["tokenizer.ggml.model"] == CASE_FILES[name]
    wrong = [(text, ids, tok.encode(text)) for text, ids in cases if tok.encode(text) != ids]
    assert not wrong, f"{len(wrong)}/{len(cases)} cases differ, first: {wrong[0]}"
    # Both vocabulary types are lossless on these texts: bytes for what the vocabulary lacks. (The one
    # loss: a SentencePiece vocabulary reads a literal ▁ as a space; see test_sentencepiece_space_marker.)
    assert [tok.decode(tok.encode(text)) for text, _ in cases] == [text for text, _ in cases]


def test_sentencepiece_space_marker(vocab):
    _, tok, _ = vocab("llama-spm")
    assert tok.decode(tok.encode("a\u2581b")) == "a b"  # ▁ is SentencePiece's space: the one lossy character
    assert tok.decode(tok.encode(" a  b ")) == " a  b "  # the space put before the text comes off again
    assert tok.token_str(tok.encode("Hello world")[1]) == " world"  # a token alone keeps its space


# ====================================================================== the real files
#: Code, unicode, digits, whitespace runs and special-token-looking strings (the tokens themselves, in
#: markup, and near misses). Not '</s>': llama.cpp promotes any token spelled '</s>' to a control token
#: (its end-of-generation name list), which neither vocabulary nor its Hugging Face tokenizer does.
REAL_TEXT = (
    "def f(x):\n    return x**2  # square\n\n\n\tif x != 0: pass  \r\n"
    "Ünïcödé — 日本語のテキスト, Ελληνικά, 한국어, emoji 🤖🚀 😶‍🌫️ and ß/ǅ/ﬁ ½ Ⅻ ١٢٣ 2⁵ 1234567 3.14159e-10\n"
    "    indented     runs      of spaces\u00a0nbsp ’curly’ “quotes” it's THEY'RE I'll\n"
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\nok<end_of_turn>\n<bos><eos><unk><pad> <|endoftext|> "
    "<|im_end <im_end|> [multimodal] <tool_call>{\"a\": 1}</tool_call> <0x41> <unused0> \u200b\x00\x01\n"
)


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "gemma-3-270m"])
def real(request):
    from hybridlm.weights.registry import real_model_path

    path = real_model_path(request.param)  # the test extra installs the parts: missing, the test fails
    return path, tokenizer_from_metadata(read_header(path).metadata, name=request.param)


def test_real_vocabularies_match_llama_cpp(real):
    import llama_cpp

    path, tok = real
    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in (REAL_TEXT, *REAL_TEXT.splitlines()):
            data = text.encode("utf-8")
            assert tok.encode(text) == llama.tokenize(data, add_bos=False, special=False), text
            assert tok.encode_markup(text) == llama.tokenize(data, add_bos=False, special=True), text
        assert tok.with_special(tok.encode("x")) == llama.tokenize(b"x", add_bos=True, special=False)
    finally:
        llama.close()
    assert tok.decode(tok.encode(REAL_TEXT)) == REAL_TEXT


def test_real_vocabularies_kinds(real):
    path, tok = real
    if "gemma" in path.name:  # SentencePiece: 262,144 pieces, BOS first, no space before the text
        assert tok.vocab_size == 262_144 and tok.add_bos and tok.bos_id == 2 and tok.eos_id == 1
        assert tok.decode(tok.encode(" x")) == " x" and tok.encode("\n\n") == [108]  # a user-defined token
    else:  # Qwen2.5: byte-level BPE ('qwen2'), ChatML
        assert not tok.add_bos and tok.chat_template and tok.end_of_turn_id == tok.encode_markup("<|im_end|>")[0]
        assert tok.encode("<tool_call>") == [151657]  # user-defined: matched in any text, as llama.cpp does


# ====================================================================== the pre-tokenizer table
def test_the_names_the_issue_asks_for_are_known():
    for name in ("gpt-2", "llama-bpe", "qwen2", "qwen35", "smollm", "smaug-bpe", "deepseek-llm", "deepseek-coder",
                 "falcon", "starcoder", "command-r", "mpt", "default", "refact"):
        assert name in PRE_TOKENIZERS


def test_every_pre_tokenizer_compiles():
    from hybridlm.weights.vocab import pre_tokenizer

    for name in PRE_TOKENIZERS:
        split, _ = pre_tokenizer(name)
        assert split.pre_tokenize_str("It's 1234 days, ok?\n")


def test_an_unknown_pre_tokenizer_is_refused_by_name(vocab):
    meta, _, _ = vocab("gpt-2")
    with pytest.raises(WeightsError, match=r"tokenizer.ggml.pre 'jais-3' is not a pre-tokenizer .*known: .*llama-bpe")as info:
        tokenizer_from_metadata({**meta, "tokenizer.ggml.pre": "jais-3"}, name="x")
    assert "\n" not in str(info.value)


# ====================================================================== bad metadata: one line naming key and value
def small_bpe() -> dict:
    tokens = ["a", "b", "ab", "<|end|>", "c"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 1, 3, 1], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.eos_token_id": 3}


def small_spm() -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", "\u2581", "a", "b", "\u2581a", "ab"]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0],
            "tokenizer.ggml.token_type": [2, 3, 3, 6, 1, 1, 1, 1, 1],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def test_small_vocabularies_build():
    bpe = tokenizer_from_metadata(small_bpe(), name="bpe")
    assert bpe.encode("abc") == [2, 4] and bpe.encode_markup("<|end|>") == [3] and not bpe.add_bos
    spm = tokenizer_from_metadata(small_spm(), name="spm")
    # ▁ab▁a: ▁a scores above ab, so ▁a merges first (twice) and b stays alone
    assert spm.encode("ab a") == [7, 6, 7] and spm.add_bos and spm.with_special([8]) == [1, 8]
    assert spm.encode("A") == [4, 3] and spm.decode([4, 3]) == "A"  # 'A' is no piece: its byte


@pytest.mark.parametrize("base, key, value, fragment", [
    (small_bpe, "tokenizer.ggml.model", "bert", "tokenizer.ggml.model 'bert'"),
    (small_bpe, "tokenizer.ggml.model", 3, "tokenizer.ggml.model"),
    (small_bpe, "tokenizer.ggml.tokens", [1, 2], "tokenizer.ggml.tokens"),
    (small_bpe, "tokenizer.ggml.tokens", [], "tokenizer.ggml.tokens holds no token"),
    (small_bpe, "tokenizer.ggml.tokens", ["a", "b", "ab", "a", "c"], "'a' twice"),
    (small_bpe, "tokenizer.ggml.token_type", ["1"] * 5, "tokenizer.ggml.token_type"),
    (small_bpe, "tokenizer.ggml.token_type", [1, 1, 1], "token_type has 3 entries for 5 tokens"),
    (small_bpe, "tokenizer.ggml.token_type", [1, 1, 1, 9, 1], r"token_type\[3\] is 9"),
    (small_bpe, "tokenizer.ggml.merges", ["ab"], r"merges\[0\] is 'ab'"),
    (small_bpe, "tokenizer.ggml.merges", ["a c"], r"merges\[0\] is 'a c'"),
    (small_bpe, "tokenizer.ggml.merges", "a b", "tokenizer.ggml.merges"),
    (small_bpe, "tokenizer.ggml.pre", 7, "tokenizer.ggml.pre"),
    (small_bpe, "tokenizer.ggml.eos_token_id", 5, "eos_token_id is 5"),
    (small_bpe, "tokenizer.ggml.bos_token_id", -1, "bos_token_id is -1"),
    (small_bpe, "tokenizer.ggml.eot_token_id", "3", "eot_token_id"),
    (small_bpe, "tokenizer.ggml.add_bos_token", 1, "add_bos_token"),
    (small_bpe, "tokenizer.chat_template", ["x"], "chat_template"),
    (small_spm, "tokenizer.ggml.scores", [0.0] * 4, "scores has 4 entries for 9 tokens"),
    (small_spm, "tokenizer.ggml.scores", [float("nan")] * 9, "tokenizer.ggml.scores"),
    (small_spm, "tokenizer.ggml.scores", None, "tokenizer.ggml.scores is missing"),
    (small_spm, "tokenizer.ggml.add_space_prefix", "yes", "add_space_prefix"),
    (small_spm, "tokenizer.ggml.unknown_token_id", 99, "unknown_token_id is 99"),
])
def test_bad_metadata_is_one_line_naming_key_and_value(base, key, value, fragment):
    meta = base()
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    with pytest.raises(WeightsError, match=fragment) as info:
        tokenizer_from_metadata(meta, name="x")
    assert "\n" not in str(info.value)


def test_a_vocabulary_larger_than_the_model_is_refused():
    with pytest.raises(WeightsError, match="5 tokens, more than the model's vocabulary of 4"):
        tokenizer_from_metadata(small_bpe(), name="x", vocab_size=4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(small_spm()) + ["tokenizer.ggml.pre", "tokenizer.ggml.merges"]),
                       st.one_of(st.none(), st.integers(-3, 12), st.text(max_size=6), st.booleans(),
                                 st.lists(st.one_of(st.integers(-2, 9), st.text(max_size=3), st.floats()), max_size=10)),
                       max_size=4),
       st.sampled_from([small_bpe, small_spm]))
def test_any_metadata_gives_a_tokenizer_or_one_line(changes, base):
    meta = {**base(), **{k: v for k, v in changes.items() if v is not None}}
    try:
        tok = tokenizer_from_metadata(meta, name="x")
    except WeightsError as exc:
        assert "\n" not in str(exc)
    else:
        assert tok is not None and isinstance(tok.encode("ab ba"), list)


# ====================================================================== the cache's form
def test_the_cache_form_round_trips(vocab):
    from hybridlm.weights.vocab import tokenizer_from_json, tokenizer_to_json

    for name in ("llama-spm", "llama-bpe"):
        _, tok, cases = vocab(name)
        again = tokenizer_from_json(json.loads(json.dumps(tokenizer_to_json(tok))))
        assert [again.encode(t) for t, _ in cases] == [ids for _, ids in cases]
        assert (again.add_bos, again.end_of_turn_ids, again.bos_id) == (tok.add_bos, tok.end_of_turn_ids, tok.bos_id)
    with pytest.raises(ValueError, match="another form"):
        tokenizer_from_json({**tokenizer_to_json(tok), "version": 1})
