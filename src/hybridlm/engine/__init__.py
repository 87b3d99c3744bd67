"""The engine: one token clock for a population of hybrid automata (sampling kernel, the
batched step, the arc, the solver, prefill and prefix reuse, and the token-clock API)."""

from hybridlm.engine.arc import Event, HybridArc, Mode, Termination
from hybridlm.engine.clock import Generation, TokenStep, generate, generate_batch, token_clock
from hybridlm.engine.constraint import Constraint
from hybridlm.engine.engine import Engine, EngineStats
from hybridlm.engine.prefill import ContextPolicy, PrefixCache
from hybridlm.engine.sampling import Kernel
from hybridlm.engine.sequence import ArcState, Limits
from hybridlm.engine.system import Generation as GenerationSystem
from hybridlm.engine.system import HybridSystem, Priority

__all__ = [
    "ArcState", "Constraint", "ContextPolicy", "Engine", "EngineStats", "Event", "Generation", "GenerationSystem",
    "HybridArc", "HybridSystem", "Kernel", "Limits", "Mode", "Priority", "PrefixCache", "Termination", "TokenStep",
    "generate", "generate_batch", "token_clock",
]
