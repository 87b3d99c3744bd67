"""A learnable soft prefix: an input on the context, tuned by gradient (survey, "Safety and Alignment", ref. [109]).

A one-token (or p-token) prefix P ∈ ℝ^{p×d} is prepended to H⁽⁰⁾ and chosen to solve a
small open-loop optimal-control problem over the model's dynamics,

    max_P  J(P) = σ Σ_j log p_θ(y_j | P ∘ s ∘ y_{<j}),   σ = +1 (raise y) or −1 (push y down),

by gradient ascent, the gradient ∂J/∂P coming from backpropagation through the blocks —
the discrete adjoint of the survey's (0.24)–(0.31). The weights stay fixed; only P moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridlm.control.controllers import Controller, register
from hybridlm.errors import InputError


def target_logprob(model, prompt_ids, target_ids, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_j log p_θ(y_j | P ∘ s ∘ y_{<j}) as a scalar (differentiable in P)."""
    prompt, target = list(prompt_ids), list(target_ids)
    if not prompt or not target:
        raise InputError(f"prompt ({len(prompt)} tokens) and target ({len(target)} tokens) must both be non-empty")
    ids = torch.tensor([prompt + target])
    p = 0 if prefix is None else prefix.shape[-2]
    logits = model(ids) if prefix is None else model(ids, prefix=prefix)
    rows = logits[0, p + len(prompt) - 1 : p + len(prompt) + len(target) - 1].float()
    return torch.log_softmax(rows, dim=-1).gather(-1, torch.tensor(target)[:, None]).sum()


@dataclass
class PrefixResult:
    prefix: torch.Tensor  # the tuned P [p, d]
    objective_before: float  # J at the initial prefix
    objective_after: float  # J at the tuned prefix
    logprob_no_prefix: float  # Σ log p(y | s) without any prefix, for reference
    steps: int
    sign: int
    history: list[float] = field(default_factory=list)  # J before each step

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "prefix"} | {"prefix_norm": float(self.prefix.norm())}


def initial_prefix(model, length: int = 1, token: int | None = None) -> torch.Tensor:
    """P⁰: the embedding row of `token`, or the mean token embedding, repeated `length` times."""
    if getattr(model, "embedding_rows", None) is not None:  # W_e on the file's grid: no float rows to start from
        from hybridlm.errors import InputError

        raise InputError(f"a soft prefix needs the float embedding; load the model with precision='float32' "
                         f"(it runs at {model.precision!r})")
    W = model.W_e.detach()
    row = W.mean(dim=0) if token is None else W[int(token)]
    return row.float().expand(length, -1).clone()


def optimise_prefix(model, prompt_ids, target_ids, *, steps: int = 30, lr: float = 0.05, sign: int = 1,
                    length: int = 1, init: torch.Tensor | None = None, max_norm: float | None = None) -> PrefixResult:
    """Adam on J(P) for a fixed budget of `steps`; optionally keep ‖P_i‖ ≤ max_norm (an input constraint)."""
    if sign not in (1, -1):
        raise InputError(f"sign={sign!r}: expected +1 (raise the target) or −1 (lower it)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InputError(f"steps={steps!r}: expected an integer ≥ 0")
    P = (initial_prefix(model, length) if init is None else init.detach().float().clone()).requires_grad_(True)
    with torch.no_grad():
        base = float(target_logprob(model, prompt_ids, target_ids))
        before = sign * float(target_logprob(model, prompt_ids, target_ids, P))
    opt = torch.optim.Adam([P], lr=lr)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        J = sign * target_logprob(model, prompt_ids, target_ids, P)
        (-J).backward()
        opt.step()
        if max_norm is not None:
            with torch.no_grad():
                P.mul_(torch.clamp(max_norm / P.norm(dim=-1, keepdim=True).clamp_min(1e-12), max=1.0))
        history.append(float(J.detach()))
    with torch.no_grad():
        after = sign * float(target_logprob(model, prompt_ids, target_ids, P))
    return PrefixResult(P.detach(), before, after, base, steps, sign, history)


@register("prefix")
class SoftPrefix(Controller):
    """The context input P, held for a run (prefilled before the prompt)."""

    order = 0
    prefix: torch.Tensor  # always set, unlike a controller's default None

    def __init__(self, prefix: torch.Tensor):
        if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2 or not bool(torch.isfinite(prefix).all()):
            raise InputError("a soft prefix must be a finite [p, d] tensor")
        self.prefix = prefix.detach()

    def describe(self) -> dict:
        return {"controller": self.name, "rows": self.prefix.shape[0], "norm": round(float(self.prefix.norm()), 4)}
