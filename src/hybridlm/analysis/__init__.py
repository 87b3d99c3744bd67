"""Control-vantage analyses of the survey (docs/theory.md §5)."""

from typing import TYPE_CHECKING

from hybridlm._lazy import exports

# Imported on first use (hybridlm._lazy): the report reads a run's folder without PyTorch.
_HOMES = {
    "hybridlm.analysis.consensus": ("LayerStep", "looped", "random_prompts", "table1"),
    "hybridlm.analysis.geometry": ("Deviation", "LayerGeometry", "geometry_report", "on_layernorm_sphere",
                                   "row_stochastic", "token_norms"),
    "hybridlm.analysis.plots": ("plot_sphere_trajectory",),
    "hybridlm.analysis.sphere": ("SphereTrajectory", "consensus_E", "normalize_tokens", "simulate_sphere",
                                 "sphere_field"),
}
__all__ = [
    "Deviation", "LayerGeometry", "LayerStep", "looped", "random_prompts", "table1", "SphereTrajectory", "consensus_E",
    "geometry_report",
    "normalize_tokens", "on_layernorm_sphere", "plot_sphere_trajectory", "row_stochastic",
    "simulate_sphere", "sphere_field", "token_norms",
]
__getattr__, __dir__ = exports(__name__, _HOMES, __all__)

if TYPE_CHECKING:
    from hybridlm.analysis.consensus import LayerStep, looped, random_prompts, table1
    from hybridlm.analysis.geometry import (
        Deviation, LayerGeometry, geometry_report, on_layernorm_sphere, row_stochastic, token_norms,
    )
    from hybridlm.analysis.plots import plot_sphere_trajectory
    from hybridlm.analysis.sphere import (
        SphereTrajectory, consensus_E, normalize_tokens, simulate_sphere, sphere_field,
    )
