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

from common import SCRATCH, exercise_tokenizer, one_line, run

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
        one_line(exc)
        return
    if tok is not None:
        exercise_tokenizer(tok, text)


if __name__ == "__main__":
    run(test_one_input)
