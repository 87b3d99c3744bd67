"""Affine maps on the file's own grid: x ↦ x Ŵᵀ + b with Ŵ held as a GGUF file stores it.

A GGUF matrix of a block-quantised type (Q4_0 … Q8_0, Q2_K … Q6_K) is rows of blocks: a block
holds 32 or 256 weights as small integer codes with half-float scales (and minima), and gguf-py's
and llama.cpp's dequantisers turn them into float32 numbers Ŵ. `BlockQuantLinear` keeps the
blocks' bytes (a 4–8.5 bit grid instead of float32's 32 bits) and computes with exactly those Ŵ:

- `weight` is Ŵ, dequantised with the file's own arithmetic (gguf-py's bits, a test);
- the product of a token step's rows (at most `kernels.STEP_ROWS`) reads each weight byte once
  for all of them, the input in 16 bits per group of 32 (`kernels/blockquant.c` states the map:
  within the input's rounding and float32 accumulation of the float32 product on Ŵ, and
  batch-invariant: a row's bits do not depend on the rows beside it);
- the product of more rows (a prefill) takes the same 16-bit input with AVX-512 VNNI's multiply-adds
  across output channels (each row's bits independent of the other rows, in another order than a
  token step's), or, without them, multiplies blocks of dequantised Ŵ in float32 (the BLAS);
- elsewhere (another device or dtype, autograd through x, no compiled library) x Ŵᵀ with Ŵ
  dequantised once and kept.

Why 16 bits for x: the decode product must stream the weights as fast as memory brings them. With
x in float32 each code had to become a float before its multiply-add, and a row of Q5_0 (the
commonest type of a Q4_K_M file) went at 8.6 GB/s on one core of the AVX-512 host, below the
memory's rate for two cores; with 16-bit codes against 16-bit x it went at 14.6 GB/s (Q8_0: 23.2
against 28.4). llama.cpp takes x in 8 bits, which cost the int4 path its agreement with float32
(`hybridlm.lm.quantize`).

A matrix may be a stack of row segments of different types: hybridlm fuses W_qkv = [W_q; W_k; W_v]
and W_gate_up = [W_gate; W_up], and a Q4_K_M file stores W_v (or a layer's W_down) on another grid
than its neighbours. Each segment keeps its own blocks, and the product writes each one's outputs
in its columns.

For the loader (`--precision auto`: the file's grid, tensor by tensor):

    file_grid_linear(segments, bias=None) -> BlockQuantLinear, or a float32 Linear

`segments` lists the stacked matrix's parts top to bottom, each a `Rows(data, kind, shape,
order=None)` (or the same plain tuple): `data` the stored bytes as a uint8 array [rows, bytes per
row] (`gguf_header.TensorInfo.data()`), `kind` its ggml type, `shape` its [rows, columns], and
`order` a row permutation applied at load (row i of the map is stored row order[i]; rows are whole
blocks, so llama.cpp's permuted W_q/W_k come back with the order `unpermute_rotary` gives an
arange column). `bias` is a float32 vector of all rows, or None. Where a segment is on a grid this
module does not read (F32, F16, BF16, the IQ types), the whole map becomes a float32 `Linear` on
the dequantised weights instead (the same map, in float32's bytes). `BlockQuantLinear.rows(ids)`
looks rows of Ŵ up (an embedding W_e kept on its grid, tied to the readout or not).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from hybridlm.errors import InputError
from hybridlm.lm import kernels
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.linear import Linear, affine

#: ggml types read on their own grid: (weights, bytes) of a block.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


class Rows(NamedTuple):
    """One segment of a stacked matrix as the file stores it (see the module's docstring)."""

    data: np.ndarray | torch.Tensor  # uint8 [rows, bytes per row]
    kind: int | str  # ggml type (gguf.GGMLQuantizationType, its number or its name)
    shape: tuple[int, int]  # [rows, columns]
    order: Sequence[int] | torch.Tensor | None = None  # map row i = stored row order[i]


def _kind(kind):
    """A ggml type from its number, its name or itself."""
    import gguf

    try:
        return gguf.GGMLQuantizationType[kind] if isinstance(kind, str) else gguf.GGMLQuantizationType(int(kind))
    except (KeyError, ValueError, TypeError):
        raise InputError(f"ggml type {kind!r}: not a type GGUF defines") from None


def file_grid_linear(segments: Sequence, bias: torch.Tensor | None = None):
    """The affine map of stacked `segments` (and `bias`) on the file's grid: a `BlockQuantLinear`
    where every segment is a block type it reads, else a float32 `Linear` holding Ŵ."""
    parts = [Rows(*s) for s in segments]
    if all(_kind(p.kind).name in BLOCKS for p in parts):
        return BlockQuantLinear(parts, bias)
    import gguf

    dense = []
    for p in parts:
        rows, cols = (int(n) for n in p.shape)
        kind = _kind(p.kind)
        data = p.data.numpy() if isinstance(p.data, torch.Tensor) else np.asarray(p.data)
        w = np.asarray(gguf.quants.dequantize(data.reshape(rows, -1), kind), dtype=np.float32).reshape(rows, cols)
        dense.append(torch.from_numpy(w if p.order is None else w[np.asarray(p.order)]))
    weight = torch.cat(dense)
    lin = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.requires_grad_(False)
    return lin


class BlockQuantLinear(DirectModule):
    """x ↦ x Ŵᵀ + b with Ŵ a stack of row segments stored as GGUF blocks (see the module).

    Buffers: `rows_0`, `rows_1`, … the segments' bytes, uint8 [rows, bytes per row] each (integers:
    `.to(dtype)` and `.half()` leave them alone), and `bias` (float32 [out] or None). `kinds` and
    `splits` name each segment's ggml type and number of rows.
    """

    bias: torch.Tensor | None

    def __init__(self, segments: Sequence, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        parts = [Rows(*s) for s in segments]
        if not parts:
            raise InputError("a block-quantised map needs at least one segment")
        kinds, splits, widths = [], [], set()
        for i, p in enumerate(parts):
            kind = _kind(p.kind)
            if kind.name not in BLOCKS:
                raise InputError(f"segment {i} is stored as {kind.name}: expected one of {', '.join(BLOCKS)}")
            rows, cols = (int(n) for n in p.shape)
            weights, size = BLOCKS[kind.name]
            if cols <= 0 or cols % weights:
                raise InputError(f"segment {i} ({kind.name}) has {cols} columns: expected a multiple of {weights}")
            data = p.data if isinstance(p.data, torch.Tensor) else torch.from_numpy(np.array(p.data, dtype=np.uint8))
            if data.dtype != torch.uint8 or data.numel() != rows * cols // weights * size:
                raise InputError(f"segment {i} ({kind.name}, {rows} × {cols}) holds {data.numel()} "
                                 f"{str(data.dtype).removeprefix('torch.')} elements: expected "
                                 f"{rows * cols // weights * size} bytes")
            data = data.reshape(rows, cols // weights * size)
            if p.order is not None:
                order = torch.as_tensor(p.order, dtype=torch.long).flatten()
                if not torch.equal(order.sort().values, torch.arange(rows)):
                    raise InputError(f"segment {i}: its row order is not a permutation of its {rows} rows")
                data = data[order]
            self.register_buffer(f"rows_{i}", data.contiguous())
            kinds.append(kind)
            splits.append(rows)
            widths.add(cols)
        if len(widths) != 1:
            raise InputError(f"the segments of one map must have one width: got {sorted(widths)} columns")
        self.kinds, self.splits = tuple(kinds), tuple(splits)
        self.in_features, self.out_features = widths.pop(), sum(splits)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise InputError(f"bias of shape {tuple(bias.shape)}: expected ({self.out_features},)")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous().clone())

    def segments(self) -> list[torch.Tensor]:
        return [getattr(self, f"rows_{i}") for i in range(len(self.kinds))]

    def _table(self):
        """The segments as the compiled kernel reads them (a ctypes array, rebuilt where a buffer moved)."""
        data = self.segments()
        key = tuple(t.data_ptr() for t in data)
        cached = self.__dict__.get("_table_cache")
        if cached is None or cached[0] != key:
            table = (kernels.Segment * len(data))(*(kernels.Segment(t.data_ptr(), int(kind), t.shape[0], t.shape[1])
                                                   for t, kind in zip(data, self.kinds)))
            cached = self.__dict__["_table_cache"] = (key, table)
        return cached[1]

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_table_cache", None)  # (addresses and a ctypes array: rebuilt on use)
        state.pop("_dense_cache", None)
        return state

    def _kernel(self, x: torch.Tensor):
        kernel = kernels.blockquant()
        if (kernel is None or x.dtype != torch.float32 or not x.is_cpu or (x.requires_grad and torch.is_grad_enabled())
                or not all(t.is_cpu and t.is_contiguous() for t in self.segments())):
            return None
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._kernel(x)
        b = self.bias
        if kernel is not None:
            return kernel.affine(x, self._table(), self.in_features, self.out_features,
                                 None if b is None else b.float().contiguous())
        W = self.__dict__.get("_dense_cache")
        if W is None:
            W = self.weight.to(x.device)
            if kernels.blockquant() is None:  # (no compiled kernel here: Ŵ once, kept)
                self.__dict__["_dense_cache"] = W
        W = W.to(x.dtype)
        b = None if b is None else b.to(x.dtype)
        if x.is_cpu and x.dtype == torch.float32:
            return affine(x, W, b)  # (a token step's rows one by one: batch-invariant)
        return F.linear(x, W, b)

    @property
    def weight(self) -> torch.Tensor:
        """Ŵ in float32 [out, in], dequantised as gguf-py does (for analysis, and products off the kernel)."""
        return torch.cat([self._dequantised(i, data) for i, data in enumerate(self.segments())])

    def _dequantised(self, i: int, data: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (all where None) of segment i's Ŵ."""
        kernel = kernels.blockquant()
        n = data.shape[0] if ids is None else ids.numel()
        if kernel is not None and data.is_cpu and data.is_contiguous():
            out = torch.empty(n, self.in_features)
            segment = self._table()[i]
            if ids is None:
                return kernel.dequantise(segment, self.in_features, 0, n, out)
            return kernel.rows(segment, self.in_features, ids.contiguous(), out)
        import gguf

        raw = data.cpu().numpy() if ids is None else data[ids].cpu().numpy()
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, self.kinds[i]), dtype=np.float32))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of Ŵ (any shape of indices) → [*ids.shape, in] float32: an embedding's lookups."""
        flat = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise InputError(f"row ids from {int(flat.min())} to {int(flat.max())}: expected ids in "
                             f"[0, {self.out_features})")
        out = torch.empty(flat.numel(), self.in_features)
        start = 0
        for i, (data, rows) in enumerate(zip(self.segments(), self.splits)):
            inside = (flat >= start) & (flat < start + rows)
            if inside.any():
                out[inside] = self._dequantised(i, data, flat[inside] - start)
            start += rows
        return out.view(*torch.as_tensor(ids).shape, self.in_features)

    def kernel_tensors(self) -> tuple | None:
        """What the compiled blocks read of this map (`hybridlm.lm.step`); None for a subclass."""
        return (*self.segments(), self.bias) if type(self) is BlockQuantLinear else None

    def kernel_product(self) -> kernels.Product | None:
        """This map as the compiled blocks read it (the address of its segment table and bias), or
        None where its bytes are not contiguous on the CPU or the bias not a float32 vector."""
        if not all(t.is_cpu and t.is_contiguous() for t in self.segments()) or not kernels.plain_vector(
                self.bias, self.out_features):
            return None
        table = self._table()
        return kernels.Product(segments=ctypes.addressof(table), nseg=len(table), bias=kernels.address(self.bias),
                               K=self.in_features, N=self.out_features)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{kind.name} × {rows}" for kind, rows in zip(self.kinds, self.splits))
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{parts}], " \
               f"bias={self.bias is not None}"
