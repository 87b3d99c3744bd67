"""hybridlm: decoder-only language models as explicit hybrid dynamical systems."""

from hybridlm.memory import configure_from_env

configure_from_env()  # huge pages for large tensors; freed memory kept warm (see hybridlm.memory)

from hybridlm.alphabet import concat, selection_P, selection_U, truncate
from hybridlm.config import PRESETS, ModelConfig
from hybridlm.control import (
    Controller, MultiObjective, SafetyFilter, Steering, ban_words, contrast_vector, optimise_prefix,
)
from hybridlm.errors import ConfigError, HybridLMError, InputError, ModelNotFoundError, WeightsError
from hybridlm.kernel import Kernel
from hybridlm.loading import load_model
from hybridlm.model import DecoderLM
from hybridlm.recursion import Generation, TokenStep, generate, token_clock
from hybridlm.state import KVState

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "ConfigError", "Controller", "DecoderLM", "Generation", "HybridLMError", "InputError", "KVState",
    "Kernel", "ModelConfig", "ModelNotFoundError", "TokenStep", "WeightsError", "concat",
    "generate", "load_model", "selection_P", "selection_U", "token_clock", "truncate",
    "MultiObjective", "SafetyFilter", "Steering", "ban_words", "contrast_vector", "optimise_prefix",
]
