"""Multi-objective decoding (survey, "Safety and Alignment", ref. [111]).

The next token maximises a weighted combination of the base model and scoring terms,

    log p_λ(w | s_t) = λ_0 log p_θ(w | s_t) + Σ_i λ_i r_i(w, s_t) − log Z_t,

a variable-gain controller: the weights λ may be changed between token steps
(`set_weight`), "tuned on the fly". With λ_0 = 1 and every other λ_i = 0 the input is
zero and the kernel is the base one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hybridlm.control.controllers import Controller, Observation, register
from hybridlm.control.inputs import KernelInput
from hybridlm.errors import InputError

Score = Callable[[Observation], torch.Tensor]  # r_i(·, s_t) for every token: [B, V]


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"weight {name}={value!r}: expected a finite number")
    return float(value)


@dataclass
class Objective:
    name: str
    score: Score
    weight: float = 1.0


@register("objectives")
class MultiObjective(Controller):
    """v_t = (λ_0 − 1) log p_θ + Σ_i λ_i r_i, so that z + v_t = λ_0 log p_θ + Σ_i λ_i r_i + const."""

    order = 50

    def __init__(self, objectives: Iterable[Objective], *, base_weight: float = 1.0):
        self.objectives = {o.name: o for o in objectives}
        if not self.objectives:
            raise InputError("multi-objective decoding needs at least one objective")
        self.base_weight = _finite("base", base_weight)
        for o in self.objectives.values():
            o.weight = _finite(o.name, o.weight)

    def set_weight(self, name: str, weight: float) -> None:
        """Change λ_i (or λ_0 with name "base") between token steps."""
        if name == "base":
            self.base_weight = _finite(name, weight)
        elif name in self.objectives:
            self.objectives[name].weight = _finite(name, weight)
        else:
            raise InputError(f"objective {name!r}: expected 'base' or one of {sorted(self.objectives)}")

    @property
    def weights(self) -> dict[str, float]:
        return {"base": self.base_weight, **{n: o.weight for n, o in self.objectives.items()}}

    def act(self, obs: Observation) -> KernelInput | None:
        terms = [o.weight * o.score(obs).to(obs.z.dtype) for o in self.objectives.values() if o.weight != 0]
        if self.base_weight != 1.0:
            terms.append((self.base_weight - 1.0) * torch.log_softmax(obs.z.float(), dim=-1).to(obs.z.dtype))
        if not terms:
            return None
        v = torch.stack(terms).sum(dim=0)
        return KernelInput(v=torch.nan_to_num(v, nan=0.0, neginf=0.0, posinf=0.0) if self.base_weight != 1.0 else v)

    def describe(self) -> dict:
        return {"controller": self.name, "weights": self.weights}


def lexicon_score(tokenizer, words: Iterable[str], value: float = 1.0) -> Score:
    """r(w) = value for tokens whose text, stripped and lower-cased, is one of the words; else 0."""
    table = tokenizer.table
    keys = {w.strip().lower() for w in words if w.strip()}
    if not keys:
        raise InputError("an empty lexicon: expected at least one word")
    r = torch.tensor([value if s.strip().lower() in keys else 0.0 for s in table.texts])

    def score(obs: Observation) -> torch.Tensor:
        V = obs.z.shape[-1]
        row = r[:V] if r.numel() >= V else torch.cat([r, r.new_zeros(V - r.numel())])
        return row.to(obs.z.device).expand(obs.z.shape[0], -1)

    return score


def model_score(other) -> Score:
    """r(w) = log p_other(w | s_t): another model over the same alphabet (e.g. a reward LM)."""

    @torch.no_grad()
    def score(obs: Observation) -> torch.Tensor:
        ids = obs.state.tokens
        if bool((ids < 0).any()):
            raise InputError("a model score cannot re-run a context that holds a soft prefix")
        z = other(ids, last_only=True)[:, -1]
        if z.shape[-1] != obs.z.shape[-1]:
            raise InputError(f"scoring model has V={z.shape[-1]}, the controlled one V={obs.z.shape[-1]}")
        return torch.log_softmax(z.float(), dim=-1)

    return score
