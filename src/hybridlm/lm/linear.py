"""Affine maps x ↦ x Wᵀ + b: every projection of the generative map (docs/theory.md §2).

`Linear` is `torch.nn.Linear` with two changes:

- Its parameters start at zero. `torch.nn.Linear` draws random starting weights that
  hybridlm always replaces (by `init_weights` or by loaded weights); drawing them costs
  over a second for a 135M model.
- W ∈ ℝ^{out×in} is allocated column by column (a transposed view of a contiguous Wᵀ), so
  every loader's in-place copy lands in that layout directly. The map is the same; x Wᵀ
  then reads Wᵀ row by row, the order in which a matrix-vector product streams it fastest.

Which product. A token step of the engine is a chain of matrix-vector products on a few
rows (B sequences, one token each), each reading a weight matrix once for all of them. Its
rows (at most `STEP_ROWS`, one position per sequence) go through hybridlm's own float32
product (`kernels.affine`),
whose every output is summed in one fixed order whatever the rows beside it: a sequence
gets the same bits alone or in any batch, which a BLAS does not promise (it chooses its
kernels and splits by the shape). Where the library is not built, the rows go through
PyTorch's product one at a time, with the same guarantee at B times the cost. A prefill
(several positions of one sequence) is not a batch of sequences and takes the BLAS, faster
on many rows; so do products that autograd records, other dtypes and other devices.

Long blocks. A product of many rows (a prefill) is compute-bound; it is taken in blocks of
`BLOCK_COLUMNS` output columns, each written in place into the one result. The BLAS
computes each entry of x Wᵀ as the same dot product whatever the block (a test checks the
numbers against the one product), and the blocks ran faster: a 512-token prefill of
SmolLM2-135M, whose W_gate_up has 3072 columns, took 4.4 % less time (median of 14
interleaved rounds).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.lm import kernels
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.kernels import BLOCK_COLUMNS
from hybridlm.lm.kernels import STEP_ROWS as STEP_ROWS  # the rows of one step's product, read by its callers


def column_major_zeros(rows: int, cols: int, **kwargs) -> torch.Tensor:
    """A zero [rows, cols] matrix laid out column by column (the transpose of a contiguous
    [cols, rows] one), so that x Wᵀ streams Wᵀ row by row."""
    return torch.zeros(cols, rows, **kwargs).t()


class Linear(DirectModule, nn.Linear):
    def reset_parameters(self) -> None:
        w = self.weight
        self.weight = nn.Parameter(
            column_major_zeros(*w.shape, dtype=w.dtype, device=w.device), requires_grad=w.requires_grad
        )
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return affine(x, self.weight, self.bias)

    def kernel_tensors(self) -> tuple | None:
        """What the compiled blocks read of this map (`hybridlm.lm.step`): W and b; None for a
        subclass, whose forward may compute something else."""
        return (self.weight, self.bias) if type(self) is Linear else None

    def kernel_product(self) -> kernels.Product | None:
        """This map as the compiled blocks read it (the addresses of W, stored column by column,
        and b), or None where its tensors are not plain float32 on the CPU in that layout."""
        W, b = self.weight, self.bias
        if (W.dtype != torch.float32 or not W.is_cpu or W.dim() != 2 or W.stride(0) != 1
                or W.stride(1) < W.shape[0] or not kernels.plain_vector(b, W.shape[0])):
            return None
        return kernels.Product(wt=W.data_ptr(), ldw=W.stride(1), bias=kernels.address(b), K=W.shape[1], N=W.shape[0])


def affine(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b: a token step's few rows batch-invariant, a long block in column blocks."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if kernels.token_rows(x):  # one token per sequence
        product = kernels.affine()
        # (one test each, no more: a step calls this some 120 times)
        if product is not None and not _wrapped(x, W, b) and product.applies(x, W, b):
            return product(x, W, b)
        if rows > 1 and _plain(x, W, b):  # one row at a time: each row's bits as if it were alone
            flat = x.reshape(rows, x.shape[-1])
            out = torch.cat([torch.nn.functional.linear(flat[r : r + 1], W, b) for r in range(rows)])
            return out.view(*x.shape[:-1], W.shape[0])
    elif W.shape[0] > BLOCK_COLUMNS and _plain(x, W, b):
        return _column_blocks(x, W, b)
    return torch.nn.functional.linear(x, W, b)


def _wrapped(*tensors) -> bool:
    """Whether a functorch transform wraps any of the tensors."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(t is not None and wrapped(t) for t in tensors)


def _plain(*tensors) -> bool:
    """Float32 CPU tensors outside autograd and functorch (what an out= product may write)."""
    grad = torch.is_grad_enabled()
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and not (grad and t.requires_grad)
                             and not torch._C._functorch.is_functorch_wrapped_tensor(t)) for t in tensors)


def _column_blocks(x, W, b):
    """x Wᵀ + b for many rows, BLOCK_COLUMNS output columns at a time, into one result."""
    rows = x.reshape(-1, x.shape[-1])
    y = rows.new_empty(rows.shape[0], W.shape[0])
    for i in range(0, W.shape[0], BLOCK_COLUMNS):
        j = min(i + BLOCK_COLUMNS, W.shape[0])
        if b is None:
            torch.mm(rows, W[i:j].t(), out=y[:, i:j])
        else:
            torch.addmm(b[i:j], rows, W[i:j].t(), out=y[:, i:j])
    return y.view(*x.shape[:-1], W.shape[0])
