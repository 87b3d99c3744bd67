"""The sampling kernel p_θ(v | s_t) and the decoding rules that reshape it (SPEC.md §2, seed 000).

    p_θ(v | s_t) = exp(z_v/τ) / Σ_u exp(z_u/τ),   τ > 0.

Greedy decoding is the limit τ → 0 (argmax, ties to the lowest id). Top-k keeps the k
largest logits; top-p (nucleus) keeps the smallest set of most likely tokens whose mass
reaches p. Sampling draws from a seeded `torch.Generator`, so a seed fixes the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridlm.errors import InputError


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of p [B, V] by inverting its distribution function: with one
    uniform u per row from the generator, the first v whose cumulative mass passes u·Σp.

    A token of zero probability is never drawn (the cumulative mass does not pass u at it), and
    each row costs one uniform number, so a row's draw depends on its generator alone.
    (torch.multinomial draws the same law at about 30 times the cost for a 49,152-token row.)
    """
    c = p.double().cumsum(dim=-1)
    u = torch.rand(p.shape[0], 1, generator=generator, dtype=torch.float64, device=p.device) * c[:, -1:]
    return torch.searchsorted(c, u, right=True).clamp_(max=p.shape[-1] - 1).squeeze(-1)


@dataclass(frozen=True)
class Kernel:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise InputError(
                f"temperature τ={t!r}: expected a finite number > 0 (for τ → 0 use greedy decoding)"
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise InputError(f"top-k={self.top_k!r}: expected an integer ≥ 1")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InputError(f"top-p={self.top_p!r}: expected a number in (0, 1]")

    def shaped_logits(self, z: torch.Tensor) -> torch.Tensor:
        """z/τ with the tokens outside the top-k / top-p sets at −∞. z: [..., V]."""
        z = z.float() / self.temperature
        if self.top_k is not None and self.top_k < z.shape[-1]:
            kth = torch.topk(z, self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_z, order = torch.sort(z, dim=-1, descending=True)
            mass_before = torch.softmax(sorted_z, dim=-1).cumsum(dim=-1) - torch.softmax(sorted_z, dim=-1)
            drop_sorted = mass_before >= self.top_p  # keep a token while the mass before it is < p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            z = z.masked_fill(drop, float("-inf"))
        return z

    def probs(self, z: torch.Tensor) -> torch.Tensor:
        """The reshaped kernel as probabilities over 𝒱 (one-hot for greedy)."""
        if self.greedy:
            return torch.nn.functional.one_hot(z.argmax(dim=-1), z.shape[-1]).float()
        return torch.softmax(self.shaped_logits(z), dim=-1)

    def sample(self, z: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw w ~ p(· | s) for each row of z [B, V]; returns [B] token ids."""
        return self.sample_with_logprob(z, generator)[0]

    def sample_with_logprob(
        self, z: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """w ~ p(· | s) and log p(w | s) under the shaped kernel (0 for greedy), shaping z once."""
        if self.greedy:
            w = z.argmax(dim=-1)
            return w, torch.zeros(w.shape)
        p = torch.softmax(self.shaped_logits(z), dim=-1)
        w = draw(p, generator)
        return w, p.gather(-1, w[:, None]).squeeze(-1).log()

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"τ={self.temperature:g}"]
        if self.top_k is not None:
            parts.append(f"top-k={self.top_k}")
        if self.top_p is not None:
            parts.append(f"top-p={self.top_p:g}")
        return ", ".join(parts)
