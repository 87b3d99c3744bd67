"""Errors that describe bad input. The CLI turns each into a message and exit code 2."""


class HybridLMError(Exception):
    """Base class: something the user passed is not what hybridlm expected."""


class ConfigError(HybridLMError, ValueError):
    """A model configuration is inconsistent or names an unknown part."""


class ModelNotFoundError(HybridLMError, LookupError):
    """A model name or path that hybridlm cannot resolve to weights."""


class WeightsError(HybridLMError, ValueError):
    """A weight file is missing, truncated, corrupt or of an unsupported kind."""


class InputError(HybridLMError, ValueError):
    """A prompt, token id or decoding parameter is out of its domain."""
