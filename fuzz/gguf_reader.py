"""Fuzz the GGUF reader: header (counts, lengths, types), metadata checks of every architecture in the
family registry, tokenizer, tensors.

Any exception other than WeightsError (and the other HybridLMError input errors) is a bug.
"""

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.errors import HybridLMError
    from hybridlm.weights.gguf import config_from_metadata, weights_from_tensors
    from hybridlm.weights.vocab import tokenizer_from_metadata
    from hybridlm.weights.gguf_header import read_header

from common import run, scratch


def test_one_input(data: bytes) -> None:
    path = scratch("input.gguf", data)
    try:
        header = read_header(path)
        cfg = config_from_metadata(header.metadata, header, origin="input.gguf")
        tokenizer_from_metadata(header.metadata, name="input", vocab_size=cfg.vocab_size)
        weights = weights_from_tensors(header.tensors, cfg, origin="input.gguf")
        for name in weights:  # every tensor dequantised, stacked and permuted as the family says
            weights[name]
    except HybridLMError:
        pass


if __name__ == "__main__":
    run(test_one_input)
