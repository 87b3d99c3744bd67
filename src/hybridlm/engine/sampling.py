"""The sampling kernel p_θ(v | s_t) and the decoding rules that reshape it (docs/theory.md §2).

    p_θ(v | s_t) = exp(z_v/τ) / Σ_u exp(z_u/τ),   τ > 0.

Greedy decoding is the limit τ → 0 (argmax, ties to the lowest id). Top-k keeps the k
largest logits; top-p (nucleus) keeps the smallest set of most likely tokens whose mass
reaches p. Sampling draws from a seeded `torch.Generator`, so a seed fixes the run.

OpenAI's penalties and logit bias are an additive input on the logits that depends on what
the sequence has emitted, applied before any mask and before τ:

    z_t(v) ↦ z_t(v) + b(v) − α_f · c_t(v) − α_p · 1[c_t(v) > 0]

with c_t(v) the number of times the sequence has generated v (injected observations and the
prompt do not count), α_f the frequency penalty, α_p the presence penalty and b the logit
bias. All zero (the default), z is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a mapping is accepted

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
        for name in ("frequency_penalty", "presence_penalty"):
            a = getattr(self, name)
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
                raise InputError(f"{name.replace('_', ' ')} {a!r}: expected a finite number")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    def penalised(self, z: torch.Tensor, counts: Mapping[int, int]) -> torch.Tensor:
        """z + b − α_f·c − α_p·1[c > 0] (the module's equation); z [..., V], counts {token: c(token)}.
        Returns z itself when there is nothing to add."""
        alpha_f, alpha_p = self.frequency_penalty, self.presence_penalty
        penalise = bool(counts) and (alpha_f != 0 or alpha_p != 0)
        if not penalise and not self.logit_bias:
            return z
        z = z.clone()
        vocab = z.shape[-1]
        if self.logit_bias:
            ids = [i for i, _ in self.logit_bias]
            if ids[-1] >= vocab:
                raise InputError(f"logit bias for token {ids[-1]}: expected a token id < {vocab} (the vocabulary)")
            z[..., ids] += torch.tensor([b for _, b in self.logit_bias], dtype=z.dtype, device=z.device)
        if penalise:
            ids = [v for v in counts if v < vocab]
            c = torch.tensor([counts[v] for v in ids], dtype=z.dtype, device=z.device)
            z[..., ids] -= alpha_f * c + alpha_p
        return z

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
            return ", ".join(["greedy", *self._inputs()])
        parts = [f"τ={self.temperature:g}"]
        if self.top_k is not None:
            parts.append(f"top-k={self.top_k}")
        if self.top_p is not None:
            parts.append(f"top-p={self.top_p:g}")
        return ", ".join(parts + self._inputs())

    def _inputs(self) -> list[str]:
        parts = [f"{name} penalty {a:g}" for name, a in (("frequency", self.frequency_penalty),
                                                         ("presence", self.presence_penalty)) if a]
        if self.logit_bias:
            parts.append(f"logit bias on {len(self.logit_bias)} token{'s' if len(self.logit_bias) > 1 else ''}")
        return parts


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias ({token id: bias} or (id, bias) pairs, ids as ints or digit strings, as OpenAI's
    wire carries them) as sorted (int, float) pairs; one line naming the first bad entry."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        items = [tuple(item) for item in items]
    except TypeError:
        raise InputError(f"logit bias {bias!r}: expected a mapping of token ids to numbers") from None
    out = {}
    for item in items:
        if len(item) != 2:
            raise InputError(f"logit bias entry {item!r}: expected a (token id, bias) pair")
        token, b = item
        if isinstance(token, str) and token.strip().isascii() and token.strip().isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InputError(f"logit bias key {token!r}: expected a token id (an integer ≥ 0)")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise InputError(f"logit bias for token {token}: {b!r} is not a finite number")
        out[token] = float(b)
    return tuple(sorted(out.items()))
