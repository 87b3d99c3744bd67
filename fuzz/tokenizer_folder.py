"""Fuzz the Hugging Face folder reader: tokenizer.json (read by the tokenizers library), tokenizer.model
(a SentencePiece protobuf), tokenizer_config.json, special_tokens_map.json, generation_config.json and
chat_template.jinja.

An input is a byte saying which files the folder holds, then for each of them (in that order) a u16
length and the file's bytes. The folder gives a tokenizer that encodes and decodes any text, or one
WeightsError line; any other exception is a bug.
"""

import os
import shutil
import struct

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.errors import HybridLMError
    from hybridlm.weights.vocab import tokenizer_from_folder

from common import SCRATCH, run

FILES = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
         "generation_config.json", "chat_template.jinja"]
FOLDER = os.path.join(SCRATCH, "folder")


def write_folder(data: bytes) -> bytes:
    """The folder of an input; returns the bytes after it (the text to encode)."""
    shutil.rmtree(FOLDER, ignore_errors=True)
    os.makedirs(FOLDER)
    mask, at = (data[0] if data else 0), 1
    for i, name in enumerate(FILES):
        if mask >> i & 1:
            n = struct.unpack("<H", data[at:at + 2].ljust(2, b"\0"))[0]
            with open(os.path.join(FOLDER, name), "wb") as fh:
                fh.write(data[at + 2:at + 2 + n])
            at += 2 + n
    return data[at:]


def test_one_input(data: bytes) -> None:
    text = write_folder(data).decode("utf-8", "replace")
    try:
        tok = tokenizer_from_folder(FOLDER, vocab_size=1000)
    except HybridLMError as exc:
        if "\n" in str(exc):
            raise AssertionError(f"the error is not one line: {exc}") from None
        return
    if tok is None:
        return
    try:
        exercise(tok, text)
    except HybridLMError as exc:  # text that is no Unicode (a lone surrogate) is refused in one line
        if "\n" in str(exc):
            raise AssertionError(f"the error is not one line: {exc}") from None


def exercise(tok, text: str) -> None:
    """Both encodings, decoding, token texts, BOS/EOS framing; untrusted text never gives a special token."""
    for ids in (tok.encode(text), tok.encode_markup(text)):
        tok.decode(ids)
        [tok.token_str(i) for i in ids]
        tok.with_special(ids)
    if set(tok.encode(text)) & tok.special_ids:
        raise AssertionError(f"untrusted text {text!r} gave a special token")


if __name__ == "__main__":
    run(test_one_input)
