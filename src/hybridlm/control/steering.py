"""Activation steering with a contrast vector (a residual input u(ℓ, t); survey, "Safety and Alignment").

The vector is the difference of mean residual states at layer ℓ over two prompt sets,

    v = mean_{s ∈ S₊} h̄⁽ℓ⁾(s) − mean_{s ∈ S₋} h̄⁽ℓ⁾(s),   h̄⁽ℓ⁾(s) = mean over positions i ≥ 2 of H⁽ℓ⁾_i(s)

(position 1 is left out when a prompt has more: its state is an outlier of large norm in
many models). The steering controller applies the constant input u(ℓ, t) = α v at every
position, prompt included: H⁽ℓ⁾ ← H⁽ℓ⁾ + α v. α = 0 attaches nothing.

File format: safetensors with the tensor "vector" [d] and metadata
{"layer", "model", "d_model", "positive", "negative"} (the prompts as JSON lists).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridlm.control.controllers import Controller, register
from hybridlm.control.inputs import residual_hook, residual_point
from hybridlm.errors import InputError


@dataclass
class ContrastVector:
    vector: torch.Tensor  # v ∈ ℝ^d
    layer: int  # ℓ: v lives in H⁽ℓ⁾ (0 = embedding, L = after the last block)
    model: str = ""
    positive: list[str] = field(default_factory=list)
    negative: list[str] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {"layer": str(self.layer), "model": self.model, "d_model": str(self.vector.numel()),
                "positive": json.dumps(self.positive), "negative": json.dumps(self.negative)}
        save_file({"vector": self.vector.detach().float().contiguous().cpu()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "ContrastVector":
        from safetensors import safe_open

        p = Path(path)
        if not p.is_file():
            raise InputError(f"steering file {str(p)!r} not found: build one with `hybridlm steer build`")
        try:
            with safe_open(str(p), framework="pt") as fh:
                meta = fh.metadata() or {}
                vector = fh.get_tensor("vector")
            layer = int(meta["layer"])
            positive, negative = json.loads(meta.get("positive", "[]")), json.loads(meta.get("negative", "[]"))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds for a damaged file
            raise InputError(f"steering file {str(p)!r} is corrupt or not a steering vector "
                             f"(expected safetensors with a 'vector' tensor and a 'layer'): {exc}") from None
        if vector.dim() != 1 or not bool(torch.isfinite(vector).all()):
            raise InputError(f"steering file {str(p)!r}: expected one finite vector, got shape {tuple(vector.shape)}")
        return cls(vector, layer, meta.get("model", ""), positive, negative)

    def check(self, model) -> None:
        d = model.config.d_model
        if self.vector.numel() != d:
            raise InputError(f"steering vector of width {self.vector.numel()} (model {self.model or '?'}): "
                             f"expected d = {d} for {model.source}")
        residual_point(model, self.layer)


def _mean_state(model, prompts: Sequence[str], layer: int) -> torch.Tensor:
    point = residual_point(model, layer)
    rows = []
    for text in prompts:
        ids = model.tokenizer.encode(text)
        if not ids:
            raise InputError(f"prompt {text!r} encodes to no tokens")
        _, cache = model.run_with_cache(torch.tensor([ids]), names=[point])
        h = cache[point][0].float()
        rows.append(h[1:].mean(dim=0) if h.shape[0] > 1 else h[0])
    return torch.stack(rows).mean(dim=0)


@torch.no_grad()
def contrast_vector(model, positive: Sequence[str], negative: Sequence[str], layer: int) -> ContrastVector:
    """v = mean h̄⁽ℓ⁾ over the positive prompts − mean over the negative ones."""
    if model.tokenizer is None:
        raise InputError("building a contrast vector needs a model with a tokenizer")
    positive, negative = [p for p in positive if p.strip()], [n for n in negative if n.strip()]
    if not positive or not negative:
        raise InputError(f"contrast prompts: expected ≥ 1 positive and ≥ 1 negative, got {len(positive)} and {len(negative)}")
    residual_point(model, layer)
    v = _mean_state(model, positive, layer) - _mean_state(model, negative, layer)
    return ContrastVector(v, layer, getattr(model, "source", ""), list(positive), list(negative))


@register("steering")
class Steering(Controller):
    """u(ℓ, t) = α v at every position ≥ from_pos (default: all)."""

    order = 0
    vector: ContrastVector
    layer: int
    scale: float
    from_pos: int

    def __init__(self, vector: ContrastVector | torch.Tensor, *, layer: int | None = None, scale: float = 1.0,
                 from_pos: int = 0):
        if isinstance(vector, torch.Tensor):
            if layer is None:
                raise InputError("a raw steering tensor needs a layer")
            vector = ContrastVector(vector, layer)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InputError(f"steering scale {scale!r}: expected a finite number")
        if not torch.is_tensor(vector.vector) or not torch.isfinite(vector.vector).all():
            raise InputError("steering vector: expected finite numbers (it holds NaN or ±inf)")
        if isinstance(from_pos, bool) or not isinstance(from_pos, numbers.Integral) or from_pos < 0:
            raise InputError(f"from_pos={from_pos!r}: expected a position, an integer ≥ 0")
        self.vector = vector
        self.layer = vector.layer if layer is None else layer
        self.scale = float(scale)
        self.from_pos = int(from_pos)

    def hooks(self, model):
        ContrastVector(self.vector.vector, self.layer, self.vector.model).check(model)
        if self.scale == 0.0:
            return []  # a zero input is no input
        u = self.scale * self.vector.vector.to(model.W_e.device)
        return [(residual_point(model, self.layer), residual_hook(u, from_pos=self.from_pos))]

    def describe(self) -> dict:
        return {"controller": self.name, "layer": self.layer, "scale": self.scale,
                "norm": round(float(self.vector.vector.norm()), 4), "model": self.vector.model}
