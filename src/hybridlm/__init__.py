"""hybridlm: decoder-only language models as explicit hybrid dynamical systems."""

from hybridlm.alphabet import concat, selection_P, selection_U, truncate
from hybridlm.lm.config import PRESETS, ModelConfig
from hybridlm.control import (
    Controller, MultiObjective, SafetyFilter, Steering, ban_words, contrast_vector, optimise_prefix,
)
from hybridlm.errors import ConfigError, HybridLMError, InputError, ModelNotFoundError, WeightsError
from hybridlm.engine.sampling import Kernel
from hybridlm.weights.loading import load_model
from hybridlm.lm.model import DecoderLM
from hybridlm.engine.clock import Generation, TokenStep, generate, token_clock
from hybridlm.lm.state import KVState

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "ConfigError", "Controller", "DecoderLM", "Generation", "HybridLMError", "InputError", "KVState",
    "Kernel", "ModelConfig", "ModelNotFoundError", "TokenStep", "WeightsError", "concat",
    "generate", "load_model", "selection_P", "selection_U", "token_clock", "truncate",
    "MultiObjective", "SafetyFilter", "Steering", "ban_words", "contrast_vector", "optimise_prefix",
]
