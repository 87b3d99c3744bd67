"""Recording the trajectory over every index: one mechanism for every reader of hook points.

`Recorder` attaches to named hook points (see `hooks.py`) and keeps, at every call of the
generative map while it is attached (a prefill, each decode step of F, each pass of a looped
run), the rows of the selected positions. Everything that reads states goes through it:

- `run_with_cache` (one call, TransformerLens' names and helpers: `ActivationCache`);
- a trajectory recording, in memory or streamed to safetensors shards of bounded size with
  `out=DIR` (`run_with_trace`, `load_trajectory`), so a trajectory larger than memory goes to
  disk as it is produced;
- an observer of one sequence of the engine (`hooks()` gives the pairs the engine attaches
  to that sequence's rows only; `last=True, decode_only=True` keeps h of each new token, and
  `save=` writes them when its arc ends: the agent's `--states`);
- a controller's view of h⁽ᴸ⁾ (`keep="latest"`: only the last record).

Each record is named `{hook name}@{i}`: the i-th time that hook point fired since the
recorder was attached, and the positions of its rows are recorded beside it
(`{hook name}@{i}:pos`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
import json
import numbers
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridlm.errors import InputError
from hybridlm.lm.hooks import HookPoint, observing

_LAYER = re.compile(r"^blocks\.(\d+)\.")
_ATTENTION_MAPS = ("hook_pattern", "hook_attn_scores")  # [B, head, query pos, key pos]


class Recorder:
    def __init__(
        self,
        model,
        names: str | list[str] | Callable[[str], bool] = lambda n: True,
        *,
        layers: Iterable[int] | None = None,
        positions: Iterable[int] | None = None,
        last: bool = False,
        decode_only: bool = False,
        keep: str = "all",
        out: str | Path | None = None,
        shard_mb: float = 256.0,
        save: str | Path | None = None,
        save_as: str = "states",
    ) -> None:
        if keep not in ("all", "latest"):
            raise InputError(f"keep={keep!r}: expected all or latest")
        self.model = model
        chosen = model._select(names)
        wanted_layers = None if layers is None else set(layers)
        config = getattr(model, "config", None)
        L, T = getattr(config, "n_layer", None), getattr(config, "n_ctx", None)
        for what, values, bound in (("layer", wanted_layers, L), ("position", positions, T)):
            for v in values or ():
                if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 or (
                        bound is not None and v >= bound):
                    raise InputError(f"{what} {v!r}: expected an integer 0 ≤ {what} < {bound}"
                                     " (an index nothing would fire on records nothing)")
        self.names = [n for n in chosen if wanted_layers is None or _layer(n) in (None, *wanted_layers)]
        self.positions = None if positions is None else torch.tensor(sorted(set(positions)))
        self.last, self.decode_only, self.keep = last, decode_only, keep
        self.out = None if out is None else Path(out)
        self.save = None if save is None else Path(save)
        self.save_as = save_as
        self.shard_bytes = int(shard_mb * 2**20)
        self.records: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}  # record → token step, when it observes a sequence of the engine
        self.shards: list[str] = []
        self.index: dict[str, str] = {}
        self._buffer_bytes = 0
        self._fired: dict[str, int] = {}
        self._last_pos: tuple | None = None
        self._ctx: AbstractContextManager | None = None
        self._seq = None

    # ------------------------------------------------------------------ hooks
    def hooks(self, model=None) -> list[tuple[str, Callable]]:
        """The (hook point, fn) pairs of this recorder (what the engine attaches to its sequence's rows)."""
        return [(n, self._keep) for n in self.names]

    @observing
    def _keep(self, x: torch.Tensor, hook: HookPoint) -> None:
        name, pos = hook.name, hook.ctx.pos
        rows = x.shape[2] if x.dim() == 4 and name.endswith(_ATTENTION_MAPS) else x.shape[1] if x.dim() >= 2 else 1
        if self.decode_only and (rows != 1 or (self._seq is not None and self._seq.phase == "prefill")):
            return
        i = self._fired[name] = self._fired.get(name, -1) + 1
        dim = 2 if x.dim() == 4 and name.endswith(_ATTENTION_MAPS) else 1
        if pos is not None and pos.dim() == 2:  # a ragged batch: each row its own positions
            pos = pos[0]
        if self.last:
            x, pos_record = x.select(dim, -1), None if pos is None else _own_copy(pos[-1:])
        elif self.positions is not None:
            assert pos is not None  # (a model's forward sets the positions before its hook points fire)
            sel = torch.isin(pos, self.positions.to(pos.device)).nonzero().flatten()
            if sel.numel() == 0:
                return
            x, pos_record = x.index_select(dim, sel), _own_copy(pos[sel])
        else:
            pos_record = None if pos is None else self._positions_of(pos)
        if self.keep == "latest":
            self.records = {k: v for k, v in self.records.items() if not k.startswith(f"{name}@")}
        key = f"{name}@{i}"
        self.records[key] = _own_copy(x)
        if pos_record is not None:
            self.records[key + ":pos"] = pos_record
        if self._seq is not None:
            self.steps[key] = self._seq.t + 1
        if self.out is not None:
            self._buffer_bytes += x.numel() * x.element_size()
            if self._buffer_bytes >= self.shard_bytes:
                self.flush()

    def _positions_of(self, pos: torch.Tensor) -> torch.Tensor:
        """One copy of `pos` per forward call, shared by the records of that call."""
        if self._last_pos is None or self._last_pos[0] is not pos:
            self._last_pos = (pos, _own_copy(pos))
        return self._last_pos[1]

    def __enter__(self) -> "Recorder":
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self._ctx = self.model.hooks(self.hooks())
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._ctx is not None  # (entered)
        self._ctx.__exit__(*exc)
        self.close()

    # ------------------------------------------------------------------ as an observer of the engine
    def on_event(self, s, event) -> None:
        self._seq = s

    def on_end(self, s) -> None:
        self.close()

    def close(self) -> None:
        """Write what the recorder was told to write: its last shard and index, or its `save` file."""
        if self.out is not None:
            self.flush()
            (self.out / "index.json").write_text(json.dumps({"shards": self.shards, "index": self.index}, indent=1))
        if self.save is not None and self.records:
            from safetensors.torch import save_file

            name = self.names[0]
            tensors = {self.save_as: self.stacked(name)}
            if self.steps:
                tensors["t"] = torch.tensor([self.steps[k] for k in sorted(self.steps, key=lambda k: _call_order((k, None)))])
            save_file(tensors, str(self.save), metadata={"hook": name, "rows": "token_step"})
            self.save = None

    # ------------------------------------------------------------------ reading
    def latest(self, name: str) -> torch.Tensor | None:
        keys = [k for k in self.records if k.startswith(f"{name}@") and not k.endswith(":pos")]
        return self.records[max(keys, key=lambda k: _call_order((k, None)))] if keys else None

    def flush(self) -> None:
        """Write the records held in memory as one shard and forget them."""
        if self.out is None or not self.records:
            return
        from safetensors.torch import save_file

        name = f"shard-{len(self.shards):05d}.safetensors"
        tensors, seen = {}, set()
        for k, v in self.records.items():  # a state seen by two hook points is stored twice
            v = v.contiguous()
            tensors[k] = v.clone() if v.data_ptr() in seen else v
            seen.add(v.data_ptr())
        save_file(tensors, str(self.out / name))
        self.shards.append(name)
        self.index.update({k: name for k in self.records})
        self.records.clear()
        self._buffer_bytes = 0

    def stacked(self, name: str) -> torch.Tensor:
        """All calls' records of one hook point concatenated along positions (in-memory mode);
        with `last=True`, stacked along a new first axis of calls."""
        parts = [v for k, v in sorted(self.records.items(), key=_call_order) if k.startswith(f"{name}@")
                 and not k.endswith(":pos")]
        if self.last:
            return torch.stack([p[0] if p.dim() > 1 and p.shape[0] == 1 else p for p in parts])
        return torch.cat(parts, dim=2 if name.endswith(_ATTENTION_MAPS) else 1)

    def cache(self) -> "ActivationCache":
        """The last record of every hook point, by name (what one call of the map produced)."""
        latest = {}
        for k, v in sorted(self.records.items(), key=_call_order):
            if not k.endswith(":pos"):
                latest[k.rsplit("@", 1)[0]] = v
        return ActivationCache(latest, self.model)


TrajectoryRecorder = Recorder  # (the name the recorder had when it recorded trajectories only)


# ---------------------------------------------------------------------- TransformerLens' cache
_ATTN = {"q", "k", "v", "z", "pattern", "attn_scores", "result"}
_MLP = {"pre", "post"}


class ActivationCache(dict):
    """The states of one call by hook name, read the way TransformerLens reads them:
    `cache["blocks.3.hook_resid_post"]`, `cache["resid_post", 3]`, `cache["pattern", 0]`,
    `accumulated_resid()`, `decompose_resid()`, `stack_activation()`, `apply_ln_to_stack()`."""

    def __init__(self, states: dict[str, torch.Tensor], model) -> None:
        super().__init__(states)
        self.model = model

    def __getitem__(self, key):
        return super().__getitem__(self.name(key) if isinstance(key, tuple) else key)

    def __contains__(self, key) -> bool:
        return super().__contains__(self.name(key) if isinstance(key, tuple) else key)

    def name(self, key: tuple) -> str:
        """("resid_post", 3) → "blocks.3.hook_resid_post"; ("pattern", 0) → "blocks.0.attn.hook_pattern"."""
        kind, layer = key[0], key[1]
        L = self.model.config.n_layer
        if isinstance(layer, bool) or not isinstance(layer, int) or not -L <= layer < L:
            raise InputError(f"layer {layer!r}: expected an integer in [-{L}, {L})")
        layer %= L
        part = "attn." if kind in _ATTN else "mlp." if kind in _MLP else ""
        return f"blocks.{layer}.{part}hook_{kind}"

    def stack_activation(self, kind: str, layer: int | None = None) -> torch.Tensor:
        """[layers, ...]: one hook kind over the layers below `layer` (default all)."""
        L = self.model.config.n_layer if layer is None else layer
        return torch.stack([self[kind, ell] for ell in range(L)])

    def stack_head_results(self, layer: int | None = None, *, apply_ln: bool = False, return_labels: bool = False):
        """Every head's write into the residual stream (`attn.hook_result`) in the blocks below `layer`
        (default all), one component per (layer, head): [layers · heads, B, pos, d], labelled
        `L{layer}H{head}` as TransformerLens labels them."""
        L = self.model.config.n_layer if layer is None else layer
        parts = [self["result", ell] for ell in range(L)]  # each [B, pos, head, d]
        if not parts:
            raise InputError("stack_head_results: no layer below 0")
        stack = torch.cat([p.permute(2, 0, 1, 3) for p in parts])
        labels = [f"L{ell}H{m}" for ell, p in enumerate(parts) for m in range(p.shape[2])]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, L)
        return (stack, labels) if return_labels else stack

    def accumulated_resid(self, layer: int | None = None, *, incl_mid: bool = False, apply_ln: bool = False,
                          return_labels: bool = False):
        """The residual stream H⁽ℓ⁾ entering each block ℓ < layer, and after the last block when
        layer = L (the default): [components, batch, pos, d]."""
        L = self.model.config.n_layer
        layer = L if layer is None else layer
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= L:
            raise InputError(f"layer {layer!r}: expected an integer in 0..{L}")
        parts, labels = [], []
        for ell in range(layer):  # the blocks below `layer`: what entered each (and its middle)
            parts.append(self["resid_pre", ell])
            labels.append(f"{ell}_pre")
            if incl_mid:
                parts.append(self["resid_mid", ell])
                labels.append(f"{ell}_mid")
        parts.append(self["resid_pre", layer] if layer < L else self["resid_post", L - 1])
        labels.append(f"{layer}_pre" if layer < L else "final_post")
        stack = torch.stack(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, *, mode: str = "all", incl_embeds: bool = True,
                        apply_ln: bool = False, return_labels: bool = False):
        """The residual stream entering `layer` (default: leaving the last block) as the sum of what
        wrote into it: the embeddings, then every attention and MLP output below it."""
        if mode not in ("all", "attn", "mlp"):
            raise InputError(f"mode={mode!r}: expected all, attn or mlp")
        L = self.model.config.n_layer
        layer = L if layer is None else layer
        parts, labels = [], []
        if incl_embeds:
            for name, label in (("hook_embed", "embed"), ("pos_embed.hook_pos_embed", "pos_embed")):
                if name in self:
                    parts.append(self[name])
                    labels.append(label)
        for ell in range(layer):
            if mode in ("all", "attn"):
                parts.append(self[f"blocks.{ell}.hook_attn_out"] if f"blocks.{ell}.hook_attn_out" in self
                             else self[f"blocks.{ell}.hook_mixer_out"])
                labels.append(f"{ell}_attn_out")
            if mode in ("all", "mlp"):
                parts.append(self["mlp_out", ell])
                labels.append(f"{ell}_mlp_out")
        shape = torch.broadcast_shapes(*(p.shape for p in parts))
        stack = torch.stack([p.expand(shape) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, stack: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Each component as the input of the norm before `layer` (the final norm when L) sees it:
        centred (LayerNorm) and divided by the scale that norm computed from the whole residual
        stream there (the affine part left out, as TransformerLens does)."""
        L = self.model.config.n_layer
        layer = L if layer is None else layer
        resid = self["resid_post", L - 1] if layer == L else self["resid_pre", layer]
        cfg = self.model.config
        if cfg.norm == "layernorm":
            stack = stack - stack.mean(-1, keepdim=True)
            scale = (resid.var(-1, unbiased=False, keepdim=True) + cfg.norm_eps).sqrt()
        else:
            scale = (resid.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt()
        return stack / scale


class Recordable:
    """`run_with_cache`, for a model with hook points."""

    if TYPE_CHECKING:  # the model's own
        def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args, names: str | list[str] | Callable[[str], bool] = lambda n: True, **kwargs
                       ) -> tuple[torch.Tensor, ActivationCache]:
        """Run the model and return its output and the states at the selected hook points."""
        with Recorder(self, names) as rec:
            out = self(*args, **kwargs)
        return out, rec.cache()


def load_trajectory(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every record of a streamed trajectory (all shards)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = json.loads((folder / "index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in meta["shards"]:
        out.update(load_file(str(folder / shard)))
    return out


def run_with_trace(model, ids, names=lambda n: True, *, layers=None, positions=None, out=None, shard_mb=256.0):
    """Run the model once on ids and return (logits, records) for the selection."""
    with Recorder(model, names, layers=layers, positions=positions, out=out, shard_mb=shard_mb) as rec:
        logits = model(ids)
    return logits, (rec.records if out is None else load_trajectory(out))


def _own_copy(x: torch.Tensor) -> torch.Tensor:
    """x on the CPU, detached, kept without a copy where that is safe and compact.

    The model never writes into a tensor after handing it to a hook point (a test checks
    the version counters of every family), so a record may share storage with the
    model's own tensors. A view is copied only when it is under half of the storage it
    keeps alive (k and v of a fused q|k|v product, one row of a prefill), so a record
    never holds more than twice its own bytes; q beside them, gate and up of the fused
    SwiGLU product, the scores and z are kept as they are.
    """
    if x.requires_grad:
        x = x.detach()
    if not x.is_cpu:
        return x.cpu()
    if x._base is not None and 2 * x.numel() < x._base.numel():
        return x.clone()
    return x


def _layer(name: str) -> int | None:
    m = _LAYER.match(name)
    return None if m is None else int(m.group(1))


def _call_order(item: tuple) -> int:
    return int(item[0].rsplit("@", 1)[1].split(":")[0])
