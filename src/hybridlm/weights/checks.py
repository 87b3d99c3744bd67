"""The one check every weight source passes: the tensors it read fit the model its config
implies, name by name and shape by shape, before they are copied in."""

from __future__ import annotations

import torch

from hybridlm.errors import WeightsError
from hybridlm.lm.config import ModelConfig
from hybridlm.lm.model import DecoderLM
from hybridlm.tokenizer import Tokenizer

Weights = dict[str, torch.Tensor]  # a state dict of `DecoderLM`


def assemble(cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None, *, origin: str) -> DecoderLM:
    """`DecoderLM(cfg)` holding `weights` (checked name by name and shape by shape)."""
    model = DecoderLM(cfg)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            f"{origin}: weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            found = tuple(weights[name].shape)
            raise WeightsError(f"{origin}: {name} has shape {found}, the config implies {shape}")
    # Copy into the model's own (anonymous, aligned) memory rather than assigning the
    # tensors: weights left on a file mapping stream several times slower in a decode step.
    model.load_state_dict(weights, strict=True)
    model.tokenizer = tokenizer
    return model
