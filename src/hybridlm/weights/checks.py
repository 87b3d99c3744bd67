"""The one check every weight source passes: the tensors it read fit the model its config
implies, name by name and shape by shape, before they are copied in.

The check runs before the model is allocated: the blocks the config names must all be in the
file, and the expected shapes come from a skeleton of the model on PyTorch's "meta" device
(shapes without storage), so a config that claims sizes the file does not hold (a 4 KB file
"with" 2²¹ × 2¹⁶ embeddings) costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridlm.errors import WeightsError
from hybridlm.lm.config import ModelConfig
from hybridlm.lm.model import DecoderLM
from hybridlm.tokenizer import Tokenizer

Weights = Mapping[str, torch.Tensor]  # a state dict of `DecoderLM`, or a Mapping that reads each tensor when asked


def _shape(weights, name: str) -> tuple[int, ...]:
    """A tensor's shape, without reading it where the source can tell (`LazyWeights.shape`)."""
    shape = getattr(weights, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(weights[name].shape)


def assemble(cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None, *, origin: str,
             precision: str = "float32") -> DecoderLM:
    """`DecoderLM(cfg)` holding `weights` (checked name by name and shape by shape); with precision
    int8 or int4 built quantised, without a float32 copy (hybridlm.lm.quantize.quantized_model)."""
    present = {int(name.split(".")[1]) for name in weights
               if name.startswith("blocks.") and name.split(".")[1].isdigit()}
    absent = [layer for layer in range(cfg.n_layer) if layer not in present]
    if absent:
        raise WeightsError(f"{origin}: the config names {cfg.n_layer} blocks, the file holds no tensor of block "
                           f"{absent[0]}{f' (nor of {len(absent) - 1} more)' if len(absent) > 1 else ''}")
    with torch.device("meta"):
        skeleton = DecoderLM(cfg)
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            f"{origin}: weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, shape in expected.items():
        found = _shape(weights, name)
        if found != shape:
            raise WeightsError(f"{origin}: {name} has shape {found}, the config implies {shape}")
    if precision in ("int8", "int4"):
        from hybridlm.lm.quantize import quantized_model

        model = quantized_model(cfg, weights, precision)
        model.tokenizer = tokenizer
        return model
    model = DecoderLM(cfg)
    # Copy into the model's own (anonymous, aligned) memory rather than assigning the
    # tensors: weights left on a file mapping stream several times slower in a decode step.
    # One tensor at a time, so that a source that reads each when asked (the float32 cache)
    # never holds a second copy of the whole model.
    with torch.no_grad():
        for name, target in model.state_dict(keep_vars=True).items():
            target.copy_(weights[name])
    model.tokenizer = tokenizer
    return model
