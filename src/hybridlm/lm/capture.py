"""Trajectory capture over every index: states at chosen hook points, layers and positions.

`TrajectoryRecorder` attaches to the named hook points of a model (see `hooks.py`) and
keeps, at every call of the generative map while it is attached (a prefill, each decode
step of F, each pass of a looped run), the rows of the selected positions. The records
stay in memory, or, with `out=DIR`, are streamed to safetensors shards of bounded size,
so a trajectory larger than memory goes to disk as it is produced; `load_trajectory`
reads them back. `run_with_trace` is the one-call form.

Each record is named `{hook name}@{i}`: the i-th time that hook point fired since the
recorder was attached (one per forward call, one per pass of a looped run), and the
positions of its rows are recorded beside it (`{hook name}@{i}:pos`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from hybridlm.lm.hooks import HookPoint

_LAYER = re.compile(r"^blocks\.(\d+)\.")


class TrajectoryRecorder:
    def __init__(
        self,
        model,
        names: str | list[str] | Callable[[str], bool] = lambda n: True,
        *,
        layers: Iterable[int] | None = None,
        positions: Iterable[int] | None = None,
        out: str | Path | None = None,
        shard_mb: float = 256.0,
    ) -> None:
        self.model = model
        chosen = model._select(names)
        wanted_layers = None if layers is None else set(layers)
        self.names = [n for n in chosen if wanted_layers is None or _layer(n) in (None, *wanted_layers)]
        self.positions = None if positions is None else torch.tensor(sorted(set(positions)))
        self.out = None if out is None else Path(out)
        self.shard_bytes = int(shard_mb * 2**20)
        self.records: dict[str, torch.Tensor] = {}
        self.shards: list[str] = []
        self.index: dict[str, str] = {}
        self._buffer_bytes = 0
        self._fired: dict[str, int] = {}
        self._last_pos: tuple | None = None
        self._ctx = None

    # ------------------------------------------------------------------ hooks
    def _keep(self, x: torch.Tensor, hook: HookPoint) -> None:
        name, pos = hook.name, hook.ctx.pos
        i = self._fired[name] = self._fired.get(name, -1) + 1
        if self.positions is not None:
            dim = 2 if x.dim() == 4 and name.endswith(("hook_pattern", "hook_attn_scores")) else 1
            rows = torch.isin(pos, self.positions.to(pos.device)).nonzero().flatten()
            if rows.numel() == 0:
                return
            x, pos_record = x.index_select(dim, rows), _own_copy(pos[rows])
        else:
            pos_record = self._positions_of(pos)
        key = f"{name}@{i}"
        self.records[key] = _own_copy(x)
        self.records[key + ":pos"] = pos_record
        if self.out is not None:
            self._buffer_bytes += x.numel() * x.element_size()
            if self._buffer_bytes >= self.shard_bytes:
                self.flush()

    def _positions_of(self, pos: torch.Tensor) -> torch.Tensor:
        """One copy of `pos` per forward call, shared by the records of that call."""
        if self._last_pos is None or self._last_pos[0] is not pos:
            self._last_pos = (pos, _own_copy(pos))
        return self._last_pos[1]

    def __enter__(self) -> "TrajectoryRecorder":
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self._ctx = self.model.hooks([(n, self._keep) for n in self.names])
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        if self.out is not None:
            self.flush()
            (self.out / "index.json").write_text(json.dumps({"shards": self.shards, "index": self.index}, indent=1))

    # ------------------------------------------------------------------ disk
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
        """All calls' records of one hook point concatenated along positions (in-memory mode)."""
        parts = [v for k, v in sorted(self.records.items(), key=_call_order) if k.startswith(f"{name}@")
                 and not k.endswith(":pos")]
        return torch.cat(parts, dim=2 if name.endswith(("hook_pattern", "hook_attn_scores")) else 1)


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
    with TrajectoryRecorder(model, names, layers=layers, positions=positions, out=out, shard_mb=shard_mb) as rec:
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


def _call_order(item: tuple[str, torch.Tensor]) -> int:
    return int(item[0].rsplit("@", 1)[1].split(":")[0])
