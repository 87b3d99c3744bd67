"""The agent: tasks through the tool-calling conversation with its tools run here; evaluations; a plant's supervisor."""

from hybridlm.agent.automaton import Arc, HybridAgent, Jump, Limits, replay

__all__ = ["Arc", "HybridAgent", "Jump", "Limits", "replay"]
