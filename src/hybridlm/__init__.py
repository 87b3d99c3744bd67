"""hybridlm: decoder-only language models as explicit hybrid dynamical systems."""

from hybridlm.alphabet import concat, selection_P, selection_U, truncate
from hybridlm.control import (
    Controller, MultiObjective, SafetyFilter, Steering, ban_words, contrast_vector, optimise_prefix,
)
from hybridlm.engine import (
    ArcState, ContextPolicy, Engine, Generation, HybridArc, Kernel, Limits, PrefixCache, Termination, TokenStep,
    generate, generate_batch, token_clock,
)
from hybridlm.errors import ConfigError, HybridLMError, InputError, ModelNotFoundError, WeightsError
from hybridlm.lm.config import PRESETS, ModelConfig
from hybridlm.lm.model import DecoderLM
from hybridlm.lm.state import KVState
from hybridlm.weights.loading import load_model

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "ArcState", "ConfigError", "ContextPolicy", "Controller", "DecoderLM", "Engine", "Generation",
    "HybridArc", "HybridLMError", "InputError", "KVState", "Kernel", "Limits", "ModelConfig", "ModelNotFoundError",
    "MultiObjective", "PrefixCache", "SafetyFilter", "Steering", "Termination", "TokenStep", "WeightsError",
    "ban_words", "concat", "contrast_vector", "generate", "generate_batch", "load_model", "optimise_prefix",
    "selection_P", "selection_U", "token_clock", "truncate",
]
