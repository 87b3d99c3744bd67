"""Geometric checks on the states of a model (docs/theory.md §2 and §5.3, around the survey's (0.44)).

- Before its affine part LayerNorm maps onto the (d−2)-sphere {x : Σx_j = 0, ‖x‖ = √d}
  (exactly as ε → 0; with ε > 0 the norm is √d σ/√(σ² + ε)). RMSNorm keeps ‖x‖ = √d only.
- An attention pattern A is row-stochastic (rows sum to 1, entries ≥ 0) and, causal,
  zero above the diagonal: the a_ij of the consensus form of (0.43).
- Token norms ‖h_i‖ per layer, and the consensus error E of (0.45) per layer.

Each check returns its maximal deviations, so a report can show how far from the property
a model is, not only whether it holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridlm.analysis.sphere import consensus_E


@dataclass(frozen=True)
class Deviation:
    """Maximal absolute deviations from a property, by name; `ok` when all are ≤ atol."""

    values: dict[str, float]
    atol: float

    @property
    def ok(self) -> bool:
        return all(v <= self.atol for v in self.values.values())

    def __getitem__(self, name: str) -> float:
        return self.values[name]


def _max(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def on_layernorm_sphere(x: torch.Tensor, atol: float = 1e-4) -> Deviation:
    """Deviations of LN outputs x [..., d] (γ = 1, β = 0) from {Σx_j = 0, ‖x‖ = √d}.

    `sum`: max |Σ_j x_j|; `norm`: max |‖x‖ − √d|.
    """
    x = x.double()
    d = x.shape[-1]
    return Deviation({"sum": _max(x.sum(-1)), "norm": _max(x.norm(dim=-1) - math.sqrt(d))}, atol)


def row_stochastic(A: torch.Tensor, *, causal: bool = True, atol: float = 1e-5) -> Deviation:
    """Deviations of attention patterns A [..., n_query, n_key] from row-stochastic (and causal).

    `row_sum`: max |Σ_j a_ij − 1|; `negative`: max(−a_ij, 0); `above_diagonal` (causal only):
    max |a_ij| for key j after query i. The queries are the last n_query of the n_key
    positions, as in a decode step from a KV state.
    """
    A = A.double()
    n_q, n_k = A.shape[-2:]
    values = {"row_sum": _max(A.sum(-1) - 1), "negative": _max((-A).clamp(min=0))}
    if causal:
        later = torch.ones(n_q, n_k, dtype=torch.bool, device=A.device).triu(n_k - n_q + 1)
        values["above_diagonal"] = _max(A[..., later])
    return Deviation(values, atol)


def token_norms(resid: Mapping[int, torch.Tensor] | torch.Tensor):
    """‖h_i‖ for each token: a tensor [..., n, d] → [..., n], or {layer: [B, n, d]} → {layer: [B, n]}."""
    if isinstance(resid, Mapping):
        return {layer: h.norm(dim=-1) for layer, h in resid.items()}
    return resid.norm(dim=-1)


@dataclass(frozen=True)
class LayerGeometry:
    """Figures for one block ℓ: its two normalisations, its attention, and the state it leaves."""

    layer: int
    ln1: Deviation  # ln1.hook_normalized vs the LN sphere
    ln2: Deviation
    pattern: Deviation  # attn.hook_pattern vs causal row-stochastic
    norm_mean: float  # mean ‖h_i‖ over batch and pos of hook_resid_post
    norm_max: float
    E: float  # consensus error (0.45) of hook_resid_post, averaged over the batch

    @property
    def ok(self) -> bool:
        return self.ln1.ok and self.ln2.ok and self.pattern.ok


def geometry_report(
    model, ids, *, atol_sphere: float = 1e-3, atol_pattern: float = 1e-5
) -> list[LayerGeometry]:
    """Run `model` once on ids [B, n] with the needed hooks and return one row per layer.

    The sphere check applies to LayerNorm models; for RMSNorm only its `norm` entry is a
    property of the map (`model.config.norm` says which). The default `atol_sphere` suits
    float32 and ε = 1e-5 LN only for tokens with σ² ≫ ε; use a small `norm_eps` to test it.
    """
    L = model.config.n_layer
    names = [f"blocks.{l}.{p}" for l in range(L) for p in
             ("ln1.hook_normalized", "ln2.hook_normalized", "attn.hook_pattern", "hook_resid_post")]
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.as_tensor(ids), names=names)
    rows = []
    for l in range(L):
        h = cache[f"blocks.{l}.hook_resid_post"]
        norms = token_norms(h)
        rows.append(LayerGeometry(
            layer=l,
            ln1=on_layernorm_sphere(cache[f"blocks.{l}.ln1.hook_normalized"], atol_sphere),
            ln2=on_layernorm_sphere(cache[f"blocks.{l}.ln2.hook_normalized"], atol_sphere),
            pattern=row_stochastic(cache[f"blocks.{l}.attn.hook_pattern"], causal=True, atol=atol_pattern),
            norm_mean=float(norms.mean()),
            norm_max=float(norms.max()),
            E=float(consensus_E(h.double()).mean()),
        ))
    return rows
