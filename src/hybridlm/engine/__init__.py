"""The engine: one token clock for a population of hybrid automata (sampling kernel, the
batched step, the arc, the solver, prefill and prefix reuse, and the token-clock API)."""

from typing import TYPE_CHECKING

from hybridlm._lazy import exports

# Imported on first use (hybridlm._lazy): the arc's reader (engine.arc) needs no PyTorch.
_HOMES = {
    "hybridlm.engine.arc": ("Event", "HybridArc", "Mode", "Termination"),
    "hybridlm.engine.clock": ("Generation", "TokenStep", "generate", "generate_batch", "token_clock"),
    "hybridlm.engine.constraint": ("Constraint",),
    "hybridlm.engine.engine": ("Engine", "EngineStats"),
    "hybridlm.engine.prefill": ("ContextPolicy", "PrefixCache"),
    "hybridlm.engine.sampling": ("Kernel",),
    "hybridlm.engine.sequence": ("ArcState", "Limits"),
    "hybridlm.engine.system": ("Generation as GenerationSystem", "HybridSystem", "Priority"),
}
__all__ = [
    "ArcState", "Constraint", "ContextPolicy", "Engine", "EngineStats", "Event", "Generation", "GenerationSystem",
    "HybridArc", "HybridSystem", "Kernel", "Limits", "Mode", "Priority", "PrefixCache", "Termination", "TokenStep",
    "generate", "generate_batch", "token_clock",
]
__getattr__, __dir__ = exports(__name__, _HOMES, __all__)

if TYPE_CHECKING:
    from hybridlm.engine.arc import Event, HybridArc, Mode, Termination
    from hybridlm.engine.clock import Generation, TokenStep, generate, generate_batch, token_clock
    from hybridlm.engine.constraint import Constraint
    from hybridlm.engine.engine import Engine, EngineStats
    from hybridlm.engine.prefill import ContextPolicy, PrefixCache
    from hybridlm.engine.sampling import Kernel
    from hybridlm.engine.sequence import ArcState, Limits
    from hybridlm.engine.system import Generation as GenerationSystem
    from hybridlm.engine.system import HybridSystem, Priority
