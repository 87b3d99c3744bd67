"""Fuzz the GGUF vocabulary reader: `tokenizer.ggml.*` values of every kind, well and wrongly typed.

The input drives a FuzzedDataProvider that writes the metadata: the vocabulary type ('gpt2', 'llama',
'gemma4' or any text), tokens, token types, merges, scores, special ids, the pre-tokenizer's name, the
flags; each key absent, of its type, or of another. The reader must give a tokenizer that encodes and
decodes any text (free text, or pieces of its own tokens) and never gives a special token for it, or one
WeightsError line; any other exception is a bug.
"""

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.errors import HybridLMError
    from hybridlm.weights.vocab import PRE_TOKENIZERS, tokenizer_from_metadata

from common import exercise_tokenizer, one_line, run
from tokenizers import decoders

PRE_NAMES = sorted(PRE_TOKENIZERS)
BYTE_LEVEL = decoders.ByteLevel()


def anything(fdp: atheris.FuzzedDataProvider):
    """A value of a type the key may not expect."""
    return fdp.PickValueInList([
        lambda: fdp.ConsumeInt(4), lambda: fdp.ConsumeFloat(), lambda: fdp.ConsumeBool(),
        lambda: fdp.ConsumeUnicode(8), lambda: [fdp.ConsumeInt(2) for _ in range(fdp.ConsumeIntInRange(0, 4))],
        lambda: [fdp.ConsumeUnicode(3) for _ in range(fdp.ConsumeIntInRange(0, 4))], lambda: None,
    ])()


def metadata(fdp: atheris.FuzzedDataProvider) -> dict:
    n = fdp.ConsumeIntInRange(0, 40)
    tokens = [fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 6)) for _ in range(n)]
    if fdp.ConsumeBool():  # the pieces a SentencePiece vocabulary needs to build anything
        tokens += ["<unk>", "<s>", "</s>", "\u2581", *[f"<0x{b:02X}>" for b in range(0, 256, 17)]]
    n = len(tokens)
    well = {
        "tokenizer.ggml.model": fdp.PickValueInList(["gpt2", "llama", "llama", "gpt2", "gemma4",
                                                     fdp.ConsumeUnicode(5)]),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [fdp.ConsumeIntInRange(-1, 7) if fdp.ConsumeProbability() < 0.2 else 1
                                      for _ in range(n + fdp.ConsumeIntInRange(-1, 1))],
        "tokenizer.ggml.scores": [fdp.ConsumeFloat() for _ in range(n + fdp.ConsumeIntInRange(-1, 1))],
        "tokenizer.ggml.merges": [fdp.PickValueInList(tokens or [""]) + fdp.PickValueInList([" ", "", "  "]) +
                                  fdp.PickValueInList(tokens or [""]) for _ in range(fdp.ConsumeIntInRange(0, 30))],
        "tokenizer.ggml.pre": fdp.PickValueInList(PRE_NAMES + [fdp.ConsumeUnicode(6)]),
        "tokenizer.chat_template": fdp.ConsumeUnicode(20),
        **{f"tokenizer.ggml.{k}_token_id": fdp.ConsumeIntInRange(-2, n + 2)
           for k in ("bos", "eos", "eot", "eom", "unknown", "padding")},
        **{f"tokenizer.ggml.{k}": fdp.ConsumeBool() for k in ("add_bos_token", "add_eos_token", "add_space_prefix")},
    }
    meta = {}
    for key, value in well.items():
        choice = fdp.ConsumeIntInRange(0, 9)
        if choice == 0:
            continue  # absent
        meta[key] = anything(fdp) if choice == 1 else value
    return meta


def text_of(fdp: atheris.FuzzedDataProvider, meta: dict) -> str:
    """Free text, or pieces of the vocabulary's own tokens: as written (`Ġa`), as the text a byte-level token
    stands for (" a") and with SentencePiece's ▁ as a space; where a control token lies within reach of text."""
    tokens = meta["tokenizer.ggml.tokens"]
    if fdp.ConsumeBool():
        return fdp.ConsumeUnicode(64)
    pieces = []
    for _ in range(fdp.ConsumeIntInRange(1, 6)):
        token = fdp.PickValueInList(tokens)
        pieces.append(fdp.PickValueInList([token, BYTE_LEVEL.decode([token]), token.replace("\u2581", " "),
                                           fdp.ConsumeUnicode(3)]))
    return "".join(pieces)


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    meta = metadata(fdp)
    try:
        tok = tokenizer_from_metadata(meta, name="fuzz", vocab_size=fdp.PickValueInList([None, 50]))
    except HybridLMError as exc:
        one_line(exc)
        return
    if tok is not None:  # its tokens are text: the library took them
        exercise_tokenizer(tok, text_of(fdp, meta))


if __name__ == "__main__":
    run(test_one_input)
