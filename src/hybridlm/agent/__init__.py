"""The agentic hybrid automaton: generation and external modes, tools, jumps, traces."""

from hybridlm.agent.automaton import Arc, HybridAgent, Jump, Limits, replay
from hybridlm.tools import Observation, Tool, ToolRegistry, calculator, registry, tool
from hybridlm.agent.trace import format_timeline, read_trace

__all__ = [
    "Arc", "HybridAgent", "Jump", "Limits", "Observation", "Tool", "ToolRegistry", "calculator",
    "format_timeline", "read_trace", "registry", "replay", "tool",
]
