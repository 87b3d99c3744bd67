"""hybridlm: decoder-only language models as explicit hybrid dynamical systems."""

from typing import TYPE_CHECKING

from hybridlm._lazy import exports

__version__ = "0.1.0"

# Imported on first use (hybridlm._lazy): a command that loads no model does not import PyTorch.
_HOMES = {
    "hybridlm.alphabet": ("concat", "selection_P", "selection_U", "truncate"),
    "hybridlm.control": ("Controller", "MultiObjective", "SafetyFilter", "Steering", "ban_words", "contrast_vector",
                         "optimise_prefix"),
    "hybridlm.engine": ("ArcState", "ContextPolicy", "Engine", "Generation", "HybridArc", "Kernel", "Limits",
                        "PrefixCache", "Termination", "TokenStep", "generate", "generate_batch", "token_clock"),
    "hybridlm.errors": ("ConfigError", "HybridLMError", "InputError", "ModelNotFoundError", "WeightsError"),
    "hybridlm.lm.config": ("PRESETS", "ModelConfig"),
    "hybridlm.lm.model": ("DecoderLM",),
    "hybridlm.lm.state": ("KVState",),
    "hybridlm.weights.loading": ("load_model",),
}
__all__ = [
    "PRESETS", "ArcState", "ConfigError", "ContextPolicy", "Controller", "DecoderLM", "Engine", "Generation",
    "HybridArc", "HybridLMError", "InputError", "KVState", "Kernel", "Limits", "ModelConfig", "ModelNotFoundError",
    "MultiObjective", "PrefixCache", "SafetyFilter", "Steering", "Termination", "TokenStep", "WeightsError",
    "ban_words", "concat", "contrast_vector", "generate", "generate_batch", "load_model", "optimise_prefix",
    "selection_P", "selection_U", "token_clock", "truncate",
]
__getattr__, __dir__ = exports(__name__, _HOMES, __all__)

if TYPE_CHECKING:
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
