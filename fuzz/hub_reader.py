"""Fuzz the hub-layout reader: config.json (every field type-checked, GPT-2, GPT-Neo and every family
of the registry: both RoPE spellings, layer types, head sizes) and the safetensors header.

An input is a u32 length L, then L bytes of config.json, then the bytes of model.safetensors;
the folder is read with `load_hub_folder`, the reader `load_model` uses (the weights only: the
tokenizer has its own harness). Any exception other than hybridlm's input errors is a bug.
"""

import os
import struct

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.errors import HybridLMError
    from hybridlm.weights.hub import load_hub_folder

from common import SCRATCH, scratch

FOLDER = os.path.join(SCRATCH, "hub")
os.makedirs(FOLDER, exist_ok=True)


def test_one_input(data: bytes) -> None:
    n = struct.unpack("<I", data[:4])[0] if len(data) >= 4 else 0
    config, weights = data[4:4 + n], data[4 + n:]
    scratch("hub/config.json", config)
    scratch("hub/model.safetensors", weights)
    try:
        load_hub_folder(FOLDER, tokenizer=False)
    except HybridLMError:
        pass


if __name__ == "__main__":
    from common import run

    run(test_one_input)
