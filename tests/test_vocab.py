"""Tokenizers built from model files, against references independent of hybridlm.

- llama.cpp's own tokenizer cases: every `models/ggml-vocab-*.gguf` of type 'gpt2', 'llama' or 'gemma4' that has
  `.inp`/`.out` files (the ids the model's Hugging Face tokenizer gives, written by llama.cpp's
  tests/test-tokenizer-0.py; read as tests/test-tokenizer-0.cpp reads them: no BOS, special tokens not
  parsed) must come out exactly, from the GGUF metadata and from folders rebuilt from it.
- llama.cpp's tokenizer itself (llama-cpp-python, vocab_only) on the real Qwen2.5 and Gemma 3 files.
- transformers (reading the folders hybridlm writes, and its own GGUF conversion) and sentencepiece
  (on the tokenizer.model made from a SentencePiece vocabulary).
"""

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybridlm.errors import WeightsError
from hybridlm.weights.gguf_header import read_header
from hybridlm.weights.vocab import (
    PRE_TOKENIZERS,
    tokenizer_from_folder,
    tokenizer_from_metadata,
)

#: The vocabulary files with cases, of the types hybridlm builds (llama.cpp 0.3.36's models/): the 13 of
#: types 'gpt2' and 'llama', and Gemma 4's.
CASE_FILES = {
    "command-r": "gpt2", "deepseek-coder": "gpt2", "deepseek-llm": "gpt2", "falcon": "gpt2", "gpt-2": "gpt2",
    "llama-bpe": "gpt2", "llama-spm": "llama", "mpt": "gpt2", "phi-3": "llama", "qwen2": "gpt2",
    "qwen35": "gpt2", "refact": "gpt2", "starcoder": "gpt2", "gemma-4": "gemma4",
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
        if kind in ("gpt2", "llama", "gemma4") and path.with_name(path.name + ".inp").is_file():
            found[path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")] = kind
    assert found == CASE_FILES


@pytest.mark.parametrize("name", sorted(CASE_FILES))
def test_ids_equal_llama_cpp_cases(vocab, name):
    meta, tok, cases = vocab(name)
    assert meta["tokenizer.ggml.model"] == CASE_FILES[name]
    wrong = [(text, ids, tok.encode(text)) for text, ids in cases if tok.encode(text) != ids]
    assert not wrong, f"{len(wrong)}/{len(cases)} cases differ, first: {wrong[0]}"
    # Every vocabulary type is lossless on these texts: bytes for what the vocabulary lacks. (The one
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
    (small_bpe, "tokenizer.ggml.model", "bert", "tokenizer.ggml.model 'bert' is not .* known: 'gpt2'"),
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


#: Characters of small vocabularies where special tokens hide: byte-level symbols that stand for other bytes
#: (Ġ a space, Ċ a newline, Ā a NUL), SentencePiece's ▁, a byte piece, markup's brackets, and a non-ASCII letter.
PIECES = ["a", "b", "é", " ", "\n", "<", ">", "|", "Ġ", "Ċ", "Ā", "\u2581", "<0x41>", "<|im_end|>"]


@st.composite
def small_vocabularies(draw):
    """A GGUF vocabulary of any builder and pre-tokenizer, with control tokens among its tokens and merges
    that are well formed (so that most of them build)."""
    tokens = draw(st.lists(st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join),
                           min_size=3, max_size=24, unique=True))
    types = draw(st.lists(st.sampled_from([1, 1, 3, 3, 4, 6]), min_size=len(tokens), max_size=len(tokens)))
    known = set(tokens)
    splits = [(t[:c], t[c:]) for t in tokens for c in range(1, len(t)) if t[:c] in known and t[c:] in known]
    merges = draw(st.lists(st.sampled_from(splits), unique=True)) if splits else []
    return {"tokenizer.ggml.model": draw(st.sampled_from(["gpt2", "llama", "gemma4"])),
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [float(-i) for i in range(len(tokens))],
            "tokenizer.ggml.merges": [f"{left} {right}" for left, right in merges],
            "tokenizer.ggml.pre": draw(st.sampled_from(["default", "llama3", "qwen2", "gpt-2", "tekken"])),
            "tokenizer.ggml.add_space_prefix": draw(st.booleans())}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_vocabularies(), st.data())
def test_untrusted_text_never_spells_a_control_token(meta, data):
    """The law the reader guards: whatever a vocabulary it accepts, text never becomes a special token. The
    texts are the vocabulary's own tokens as written, as the text a byte-level token stands for, and with ▁
    as a space, in any order: where a control token is one merge, one byte or one whole word away."""
    from tokenizers import decoders

    try:
        tok = tokenizer_from_metadata(meta, name="x")
    except WeightsError as exc:
        assert "\n" not in str(exc)
        event("refused")
        return
    event(f"built, {len(tok.special_ids)} special")
    tokens = meta["tokenizer.ggml.tokens"]
    forms = [t for token in tokens for t in (token, decoders.ByteLevel().decode([token]), token.replace("\u2581", " "))]
    text = "".join(data.draw(st.lists(st.sampled_from(forms + PIECES), min_size=1, max_size=6)))
    assert not set(tok.encode(text)) & tok.special_ids, (text, tok.encode(text))


# ====================================================================== the cache's form
def test_the_cache_form_round_trips(vocab):
    from hybridlm.weights.vocab import tokenizer_from_json, tokenizer_to_json

    for name in ("llama-spm", "llama-bpe"):
        _, tok, cases = vocab(name)
        again = tokenizer_from_json(json.dumps(tokenizer_to_json(tok)))
        assert [again.encode(t) for t, _ in cases] == [ids for _, ids in cases]
        assert (again.add_bos, again.end_of_turn_ids, again.bos_id) == (tok.add_bos, tok.end_of_turn_ids, tok.bos_id)
    with pytest.raises(ValueError, match="another form"):
        tokenizer_from_json(json.dumps({**tokenizer_to_json(tok), "version": 1}))


# ====================================================================== Hugging Face folders
def write_folder(tok, folder, **config):
    """The folder transformers' save_pretrained writes for a fast tokenizer: tokenizer.json and its config."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(folder / "tokenizer.json"))
    named = {key: tok.backend.id_to_token(i) for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id))
             if i is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **named, "add_bos_token": tok.add_bos, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.mark.parametrize("name", sorted(CASE_FILES))
def test_folders_rebuilt_from_the_vocabularies(vocab, tmp_path, name):
    """tokenizer.json + tokenizer_config.json of each vocabulary: hybridlm's folder reader and transformers
    (reading the same folder) both give llama.cpp's ids."""
    import transformers

    _, tok, cases = vocab(name)
    folder = write_folder(tok, tmp_path / name)
    again = tokenizer_from_folder(folder)
    assert [again.encode(t) for t, _ in cases] == [ids for _, ids in cases]
    assert [again.decode(again.encode(t)) for t, _ in cases] == [t for t, _ in cases]
    assert (again.bos_id, again.eos_id, again.add_bos) == (tok.bos_id, tok.eos_id, tok.add_bos)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert [theirs.encode(t, add_special_tokens=False) for t, _ in cases] == [ids for _, ids in cases]


#: The vocabularies whose transformers GGUF conversion (AutoTokenizer.from_pretrained(..., gguf_file=...))
#: gives llama.cpp's ids. Measured with transformers 5.25: falcon 37/46, llama-spm 31/46, deepseek-coder,
#: deepseek-llm, llama-bpe and starcoder 45/46 (its converter keeps no per-vocabulary split); command-r,
#: mpt and refact it does not read.
TRANSFORMERS_CONVERTS = ["gpt-2", "phi-3", "qwen2", "qwen35"]


@pytest.mark.parametrize("name", TRANSFORMERS_CONVERTS)
def test_folders_of_transformers_gguf_conversion(vocab, llama_cpp_source, tmp_path, name):
    import transformers

    _, _, cases = vocab(name)
    path = vocab_path(llama_cpp_source, name)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    theirs.save_pretrained(tmp_path)
    ours = tokenizer_from_folder(tmp_path)
    assert [ours.encode(t) for t, _ in cases] == [ids for _, ids in cases]
    assert ours.eos_id == theirs.eos_token_id and ours.bos_id == theirs.bos_token_id


def sentencepiece_model(meta, pieces: int) -> bytes:
    """A SentencePiece BPE model (tokenizer.model) holding the first `pieces` pieces of a GGUF vocabulary,
    written with sentencepiece's own protobuf schema."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    unk = meta["tokenizer.ggml.unknown_token_id"]
    for i, (text, score, kind) in enumerate(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                                meta["tokenizer.ggml.token_type"])):
        if i < pieces:  # sentencepiece wants exactly one unknown piece (Phi-3's file marks its padding so)
            proto.pieces.add(piece=text, score=score, type=2 if i == unk else 3 if kind == 2 else kind)
    spec = proto.trainer_spec
    spec.model_type, spec.byte_fallback = pb.TrainerSpec.BPE, True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk, meta["tokenizer.ggml.bos_token_id"], 2, -1
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces, norm.escape_whitespaces = "identity", True, False, True
    return proto.SerializeToString()


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_folders_with_only_a_sentencepiece_model(vocab, tmp_path, name):
    """tokenizer.model made from the vocabulary: sentencepiece itself gives llama.cpp's ids on it, and so
    does hybridlm's folder reader (Phi-3's 64 tokens past the model's 32,000 pieces come from
    tokenizer_config.json's added_tokens_decoder, as its folder has them)."""
    import sentencepiece

    meta, _, cases = vocab(name)
    model = sentencepiece_model(meta, 32_000)
    reference = sentencepiece.SentencePieceProcessor(model_proto=model)
    assert [reference.encode(t) for t, _ in cases] == [ids for _, ids in cases]
    (tmp_path / "tokenizer.model").write_bytes(model)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    added = {str(i): {"content": tokens[i], "special": types[i] != 4} for i in range(32_000, len(tokens))}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}), encoding="utf-8")
    ours = tokenizer_from_folder(tmp_path)
    assert [ours.encode(t) for t, _ in cases] == [ids for _, ids in cases]
    assert [ours.decode(ours.encode(t)) for t, _ in cases] == [t for t, _ in cases]
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.vocab_size) == (1, 2, True, len(tokens))
    if name == "phi-3":
        assert ours.encode_markup("<|end|>") == [32007] and 32007 not in ours.encode("<|end|>")


def test_folder_settings(vocab, tmp_path):
    """What a folder says besides tokenizer.json: the template file over the config's, every EOS of
    generation_config.json, BOS from Llama 3's post-processor, special_tokens_map.json's tokens."""
    from tokenizers import processors

    _, tok, _ = vocab("llama-bpe")
    folder = write_folder(tok, tmp_path / "llama3", chat_template="config {{ messages }}")
    del_keys = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("add_bos_token", "bos_token", "eos_token"):
        del_keys.pop(key)
    (folder / "tokenizer_config.json").write_text(json.dumps(del_keys))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<|begin_of_text|>"},
                                                                "eos_token": "<|eot_id|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    (folder / "chat_template.jinja").write_text("{{ bos_token }}<|eot_id|><|eom_id|>", encoding="utf-8")
    backend = tok.backend
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 128000)])
    backend.save(str(folder / "tokenizer.json"))
    backend.post_processor = None
    ours = tokenizer_from_folder(folder)
    assert ours.chat_template == "{{ bos_token }}<|eot_id|><|eom_id|>"
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.end_of_turn_id) == (128000, 128009, True, 128009)
    assert ours.end_of_turn_ids == {128001, 128008, 128009} and ours.stop_ids() == {128001, 128008, 128009}
    assert ours.with_special(ours.encode("hi")) == [128000, *ours.encode("hi")]


@pytest.mark.parametrize("file, text, fragment", [
    ("tokenizer.json", "{not json", "tokenizer.json: not a tokenizer"),
    ("tokenizer.json", '{"model": {"type": "Nope"}}', "tokenizer.json: not a tokenizer"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: a JSON list, expected an object"),
    ("tokenizer_config.json", "\xff\xfe", "tokenizer_config.json: not a JSON object"),
    ("tokenizer_config.json", '{"bos_token": "<nope>"}', "bos_token is '<nope>': expected a token"),
    ("tokenizer_config.json", '{"eos_token": 5}', "eos_token is '5'"),
    ("tokenizer_config.json", '{"add_bos_token": "yes"}', "add_bos_token is 'yes': expected true or false"),
    ("tokenizer_config.json", '{"chat_template": 3}', "chat_template is '3'"),
    ("generation_config.json", '{"eos_token_id": [1, 999999]}', "eos_token_id holds '999999'"),
    ("generation_config.json", '{"eos_token_id": true}', "eos_token_id holds 'True'"),
    ("chat_template.jinja", b"\xff", "chat_template.jinja: not readable"),
])
def test_bad_folder_files_are_one_line(vocab, tmp_path, file, text, fragment):
    _, tok, _ = vocab("gpt-2")
    folder = write_folder(tok, tmp_path / "f")
    (folder / file).write_bytes(text if isinstance(text, bytes) else text.encode("latin-1"))
    with pytest.raises(WeightsError, match=fragment) as info:
        tokenizer_from_folder(folder)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, fragment", [
    (lambda proto: setattr(proto.trainer_spec, "model_type", 1), "a SentencePiece UNIGRAM model"),
    (lambda proto: setattr(proto.normalizer_spec, "remove_extra_whitespaces", True), "is not the identity"),
    (lambda proto: proto.pieces.add(piece=proto.pieces[300].piece, score=0.0, type=1), "tokenizer.model holds .* twice"),
])
def test_sentencepiece_models_hybridlm_does_not_build_are_refused(vocab, tmp_path, change, fragment):
    from sentencepiece import sentencepiece_model_pb2 as pb

    meta, _, _ = vocab("llama-spm")
    proto = pb.ModelProto.FromString(sentencepiece_model(meta, 400))
    change(proto)
    (tmp_path / "tokenizer.model").write_bytes(proto.SerializeToString())
    with pytest.raises(WeightsError, match=fragment):
        tokenizer_from_folder(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\xff\xff\xff")
    with pytest.raises(WeightsError, match="tokenizer.model: not a SentencePiece model"):
        tokenizer_from_folder(tmp_path)


def test_a_folder_without_a_tokenizer_has_none(tmp_path):
    assert tokenizer_from_folder(tmp_path) is None


def test_a_folder_whose_model_spells_a_special_token_is_refused(tmp_path):
    """A word-level model that holds '<s>' as a word reads the text '<s>' as the special token even when
    special tokens are text: untrusted text could produce it, so the folder is refused."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "hi": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(WeightsError, match="turns the text '<s>' into the special token 1"):
        tokenizer_from_folder(tmp_path)


def test_a_folder_whose_model_looks_a_special_word_up_is_refused(tmp_path):
    """A byte-level BPE that looks whole words up (`ignore_merges`, Llama 3's) reads the word " a" as its
    special token `Ġa`, with no merge: the library gives it for the text, so the folder is refused."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.BPE(vocab={"a": 0, "Ġ": 1, "Ġa": 2, "<x>": 3}, merges=[], ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("Ġa", "<x>")])
    backend.encode_special_tokens = True  # the reference: the library's own reading of untrusted text
    assert backend.encode("say a", add_special_tokens=False).ids[-1] == 2
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(WeightsError, match="turns the text ' a' into the special token 2"):
        tokenizer_from_folder(tmp_path)


def test_a_special_token_of_one_character_is_refused():
    """Text spells a one-character control token without any merge: untrusted text could produce it."""
    meta = small_spm()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"][:-1], "\x00"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"][:-1], 3]
    with pytest.raises(WeightsError, match=r"turns the text '\\x00' into the special token 8"):
        tokenizer_from_metadata(meta, name="x")


@pytest.mark.parametrize("tokens, types, merges, pre, text", [
    (["a", "b", "Ā", "Ģ"], [1, 1, 3, 1], [], "default", "\x00"),  # Ā is byte 0x00: any text holding a NUL
    (["a", "b", "Ā", "Ģ"], [1, 1, 1, 3], [], "default", "⨀"),  # Ģ is byte 0x80, inside ⨀ (E2 A8 80)
    (["a", "b", "ab", "<x>"], [1, 1, 3, 3], ["a b"], "default", "ab"),  # a merge reaches the control token
    # Llama 3's pre-tokenizer looks a whole word up before any merge: the word " a" is the token Ġa, and
    # "\x00a" the token Āa, with no merge at all
    (["a", "Ġ", "Ġa", "<x>"], [1, 1, 3, 3], [], "llama3", "say a"),
    (["a", "Ā", "Āa", "<x>"], [1, 1, 3, 3], [], "llama-bpe", "\x00a"),
])
def test_a_byte_level_control_token_that_text_reaches_is_refused(tokens, types, merges, pre, text):
    """A byte-level BPE whose control token is one byte's symbol (or a merge's result, or a word it looks up
    whole) writes it for a text that is not the token's own text: the vocabulary is refused, whatever the
    special token's spelling."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.pre": pre}
    special = types.index(3)
    with pytest.raises(WeightsError, match=f"into the special token {special}"):
        tokenizer_from_metadata(meta, name="x")
    meta["tokenizer.ggml.token_type"] = [1] * len(tokens)  # the reference: the same text without the control type
    assert special in tokenizer_from_metadata(meta, name="x").encode(text)


def test_a_tokenizer_json_whose_ids_collide_is_refused(vocab, tmp_path):
    _, tok, _ = vocab("gpt-2")
    folder = write_folder(tok, tmp_path / "f")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<|endoftext|>"] = 50  # the id of 'S'
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(WeightsError, match="tokenizer.json: .*50"):
        tokenizer_from_folder(folder)


def test_a_special_byte_piece_is_refused():
    """A SentencePiece vocabulary whose byte piece <0x41> is a control token writes 'A' as that token."""
    meta = small_spm()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<0x42>"]  # a byte piece: byte fallback on
    meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0]
    meta["tokenizer.ggml.token_type"] = [2, 3, 3, 3, 1, 1, 1, 1, 1, 6]
    with pytest.raises(WeightsError, match="turns the text '<0x41>' into the special token 3"):
        tokenizer_from_metadata(meta, name="x")
