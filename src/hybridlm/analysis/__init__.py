"""Control-vantage analyses of the survey (docs/theory.md §5)."""

from hybridlm.analysis.consensus import LayerStep, looped, random_prompts, table1
from hybridlm.analysis.geometry import (
    Deviation, LayerGeometry, geometry_report, on_layernorm_sphere, row_stochastic, token_norms,
)
from hybridlm.analysis.plots import plot_sphere_trajectory
from hybridlm.analysis.sphere import (
    SphereTrajectory, consensus_E, normalize_tokens, simulate_sphere, sphere_field,
)

__all__ = [
    "Deviation", "LayerGeometry", "LayerStep", "looped", "random_prompts", "table1", "SphereTrajectory", "consensus_E",
    "geometry_report",
    "normalize_tokens", "on_layernorm_sphere", "plot_sphere_trajectory", "row_stochastic",
    "simulate_sphere", "sphere_field", "token_norms",
]
