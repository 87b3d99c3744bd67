"""Control inputs for the token-clock recursion: test-time alignment as feedback control.

Input channels (`inputs`): logit inputs and hard masks on the kernel, residual inputs
u(ℓ, t) on the state, a soft prefix on the context. Controllers (`controllers`) compute
them from the observed state each token step: a control-barrier safety filter
(`safety`), multi-objective decoding (`objectives`), contrast-vector steering
(`steering`); `prefix` tunes a soft prefix by gradient. Survey, "Safety and Alignment".
"""

from hybridlm.control.controllers import (
    REGISTRY, ControlRecord, Controller, Observation, control_step, make_controller, register,
)
from hybridlm.control.inputs import KernelInput, removed_mass, residual_hook, residual_point
from hybridlm.control.loop import Rollout, rollout
from hybridlm.engine.inputs import ControlLoop
from hybridlm.control.objectives import MultiObjective, Objective, lexicon_score, model_score
from hybridlm.control.prefix import PrefixResult, SoftPrefix, optimise_prefix, target_logprob
from hybridlm.control.safety import (
    Barrier, BannedWords, HiddenBarrier, NoSafeToken, SafetyFilter, TokenMask, ban_words,
)
from hybridlm.control.steering import ContrastVector, Steering, contrast_vector

__all__ = [
    "REGISTRY", "BannedWords", "Barrier", "ContrastVector", "ControlLoop", "ControlRecord", "Controller",
    "HiddenBarrier", "KernelInput", "MultiObjective", "NoSafeToken", "Objective", "Observation", "PrefixResult",
    "Rollout", "SafetyFilter", "SoftPrefix", "Steering", "TokenMask", "ban_words", "contrast_vector",
    "control_step", "lexicon_score", "make_controller", "model_score", "optimise_prefix",
    "register", "removed_mass", "residual_hook", "residual_point", "rollout", "target_logprob",
]
