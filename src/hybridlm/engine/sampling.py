"""The sampling kernel p_θ(v | s_t) and the decoding rules that reshape it (docs/theory.md §2).

    p_θ(v | s_t) = exp(z_v/τ) / Σ_u exp(z_u/τ),   τ > 0.

Greedy decoding is the limit τ → 0 (argmax, ties to the lowest id). Sampling draws from a
seeded `torch.Generator`, so a seed fixes the run.

The kernel's inputs act on the readout z_t in one fixed order:

1. logit bias b and penalties, which depend on what the context holds (`penalised`):

       z ↦ z + b
       z(v) ↦ z(v)/ρ if z(v) > 0, z(v)·ρ otherwise,   for v in the last n tokens of the context
       z(v) ↦ z(v) − α_f · c_t(v) − α_p · 1[c_t(v) > 0]

   ρ is the repeat penalty (llama.cpp's `repeat_penalty` over its last `repeat_last_n = n` tokens
   of prompt and output; n = −1 is the whole context, vLLM's and transformers' `repetition_penalty`);
   c_t(v) counts the times the sequence generated v (OpenAI's frequency and presence penalties:
   injected observations and the prompt do not count), α_f and α_p their weights. Bias before
   penalties, and ρ before α_f, α_p, is the order of llama.cpp's sampler chain and of vLLM's;
2. the hard inputs (a constraint's mask, the controllers' inputs; the engine applies them);
3. the temperature τ, then the truncations on z/τ: top-k (the k largest), top-p (the smallest
   set of most likely tokens whose mass reaches p), min-p (the tokens with p(v) ≥ m · max_u p(u)),
   each on what the one before kept — transformers' order; vLLM takes min-p first, llama.cpp takes
   all three before τ. Truncating after τ means top-p and min-p see the distribution that is
   sampled, as OpenAI's and vLLM's top-p does (this kernel's top-p always has); at τ = 1 the chain
   is llama.cpp's default one.

Every truncation keeps the most likely token, so greedy decoding (the argmax after step 2) is the
same whatever k, p and m are. All inputs at their defaults leave z untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
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
    top_k: int | None = None  # None or 0: no top-k
    top_p: float | None = None
    greedy: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a mapping is accepted
    min_p: float = 0.0  # 0: no min-p
    repeat_penalty: float = 1.0  # ρ; 1: none
    repeat_last_n: int = 64  # the repeat penalty's window: the last n tokens of the context (−1: all, 0: none)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise InputError(
                f"temperature τ={t!r}: expected a finite number > 0 (for τ → 0 use greedy decoding)"
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0):
            raise InputError(f"top-k={self.top_k!r}: expected an integer ≥ 1 (0: no top-k)")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", None)
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InputError(f"top-p={self.top_p!r}: expected a number in (0, 1]")
        for name in ("frequency_penalty", "presence_penalty", "min_p", "repeat_penalty"):
            a = getattr(self, name)
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
                raise InputError(f"{name.replace('_', ' ')} {a!r}: expected a finite number")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min-p={self.min_p!r}: expected a number in [0, 1] (0: no min-p)")
        if self.repeat_penalty <= 0:
            raise InputError(f"repeat penalty {self.repeat_penalty!r}: expected a number > 0 (1: none)")
        n = self.repeat_last_n
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise InputError(f"repeat last n {n!r}: expected an integer ≥ 0, or −1 for the whole context")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def repeat_window(self) -> int | None:
        """How many of the context's last tokens the repeat penalty reads: None for all of them, 0 when it is off."""
        if self.repeat_penalty == 1 or self.repeat_last_n == 0:
            return 0
        return None if self.repeat_last_n == -1 else self.repeat_last_n

    def penalised(self, z: torch.Tensor, counts: Mapping[int, int], recent: Iterable[int] = ()) -> torch.Tensor:
        """Step 1 of the module's order: bias, repeat penalty, frequency and presence penalties. z [..., V];
        counts {token: c(token)}; recent: the tokens of the repeat window (the context's last n).
        Returns z itself when there is nothing to apply."""
        alpha_f, alpha_p = self.frequency_penalty, self.presence_penalty
        penalise = bool(counts) and (alpha_f != 0 or alpha_p != 0)
        repeated = set(recent) if self.repeat_window != 0 else set()
        if not penalise and not repeated and not self.logit_bias:
            return z
        z = z.clone()
        vocab = z.shape[-1]
        if self.logit_bias:
            ids = [i for i, _ in self.logit_bias]
            if ids[-1] >= vocab:
                raise InputError(f"logit bias for token {ids[-1]}: expected a token id < {vocab} (the vocabulary)")
            z[..., ids] += torch.tensor([b for _, b in self.logit_bias], dtype=z.dtype, device=z.device)
        if repeated:
            ids = sorted(v for v in repeated if 0 <= v < vocab)
            seen = z[..., ids]
            z[..., ids] = torch.where(seen > 0, seen / self.repeat_penalty, seen * self.repeat_penalty)
        if penalise:
            ids = [v for v in counts if v < vocab]
            c = torch.tensor([counts[v] for v in ids], dtype=z.dtype, device=z.device)
            z[..., ids] -= alpha_f * c + alpha_p
        return z

    def shaped_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Step 3 of the module's order: z/τ with the tokens outside the top-k, top-p and min-p sets at −∞.
        z: [..., V]."""
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
        if self.min_p > 0:  # p(v) ≥ m · max p  ⇔  z(v)/τ ≥ max z/τ + log m (the set kept so far has the same max)
            z = z.masked_fill(z < z.amax(dim=-1, keepdim=True) + math.log(self.min_p), float("-inf"))
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
        if self.min_p:
            parts.append(f"min-p={self.min_p:g}")
        return ", ".join(parts + self._inputs())

    def _inputs(self) -> list[str]:
        parts = []
        if self.repeat_window != 0:
            window = "the context" if self.repeat_window is None else f"the last {self.repeat_window} tokens"
            parts.append(f"repeat penalty {self.repeat_penalty:g} over {window}")
        parts += [f"{name} penalty {a:g}" for name, a in (("frequency", self.frequency_penalty),
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
