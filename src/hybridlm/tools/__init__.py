"""What runs in the external mode q_E: tools, their registry, the sandbox a call runs in, and MCP servers."""

from hybridlm.tools.builtins import calculator, clock, evaluate_arithmetic, lookup_tool, registry
from hybridlm.tools.registry import Observation, Tool, ToolRegistry, tool

__all__ = [
    "Observation", "Tool", "ToolRegistry", "calculator", "clock", "evaluate_arithmetic", "lookup_tool", "registry",
    "tool",
]
