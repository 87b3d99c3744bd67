"""Affine maps x ↦ x Wᵀ + b, and the BLAS that computes their products in a token step.

`Linear` is `torch.nn.Linear` with two changes:

- Its parameters start at zero. `torch.nn.Linear` draws random starting weights that
  hybridlm always replaces (by `init_weights` or by loaded weights); drawing them costs
  over a second for a 135M model.
- W ∈ ℝ^{out×in} is allocated column by column (a transposed view of a contiguous Wᵀ), so
  every loader's in-place copy lands in that layout directly. The map is the same; x Wᵀ
  then reads Wᵀ row by row, which the CPU's matrix-vector kernels stream 5–10 % faster
  during decoding (measured on 30 layers of SmolLM2-shaped matrices).

Which BLAS. A decode step is a chain of matrix-vector products, each reading a weight
matrix once, so their speed is the memory bandwidth a BLAS reaches on a few rows. PyTorch's
CPU build computes them with Intel's MKL, which on other x86 vendors' processors takes
generic code paths: on an AMD EPYC, 30 layers of SmolLM2's products took 51 ms through MKL
and 35 ms through the OpenBLAS that NumPy ships, on the same two threads. So on such a CPU
the products of a token step (the rows of `F`, up to `STEP_ROWS` of them) run through
NumPy's OpenBLAS on the threads PyTorch was given, while PyTorch's own small kernels
(norms, rotary, attention over the state) run meanwhile on one thread: they are too small
to split, and a PyTorch worker thread left spinning after a parallel region would take a
core from OpenBLAS (that costs 4× the step). Everything else (prefill of long blocks,
`model(ids)`, autograd) keeps PyTorch's own products, bit for bit.

The two BLAS differ only in the order of float32 round-off within a dot product (|Δ| of a
few units in the last place); both compute the same map in float32. `HYBRIDLM_BLAS=torch`
or `=openblas` forces one (default `auto`: OpenBLAS on x86 CPUs that are not Intel's, when
NumPy's BLAS is OpenBLAS and PyTorch's is MKL).

Long blocks. A product of many rows (a prefill) is compute-bound; it is taken in blocks of
`BLOCK_COLUMNS` output columns, each written in place into the one result. The BLAS
computes each entry of x Wᵀ as the same dot product whatever the block (a test checks the
numbers against the one product), and the blocks ran faster: a 512-token prefill of
SmolLM2-135M, whose W_gate_up has 3072 columns, took 4.4 % less time (median of 14
interleaved rounds; 1.5–8 % in four runs). Products that autograd records keep the one call.
"""

from __future__ import annotations

import contextlib
import os
import platform

import numpy as np
import torch
from torch import nn

from hybridlm.errors import InputError
from hybridlm.lm.direct import DirectModule

STEP_ROWS = 32  # a token step with at most this many rows (B · m) takes the step BLAS
BLOCK_COLUMNS = 768  # a product of more rows than STEP_ROWS is taken in blocks of this many columns


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


def affine(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b, through the step BLAS inside a token step (`step_products`), else PyTorch's
    (in column blocks for a long block of rows)."""
    if _step.active and x.dtype == torch.float32 and W.dtype == torch.float32 and x.device.type == "cpu":
        try:
            return _openblas_affine(x, W, b)
        except (RuntimeError, TypeError):  # a tensor NumPy cannot view (a functorch wrapper, ...)
            pass
    elif W.shape[0] > BLOCK_COLUMNS and x.numel() > STEP_ROWS * x.shape[-1] and _plain(x, W, b):
        return _column_blocks(x, W, b)
    return torch.nn.functional.linear(x, W, b)


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


def _openblas_affine(x, W, b):
    rows = x.reshape(-1, x.shape[-1])
    y = torch.empty(rows.shape[0], W.shape[0])
    np.matmul(rows.numpy(), W.detach().numpy().T, out=y.numpy())
    if b is not None:
        y += b
    return y.view(*x.shape[:-1], W.shape[0])


# ---------------------------------------------------------------------- the step BLAS
class _StepProducts:
    """While active, float32 CPU products go through NumPy's OpenBLAS (see the module text)."""

    def __init__(self) -> None:
        self.active = False
        self.openblas_threads = None  # what we last set OpenBLAS to
        self._controllers = None

    def set_openblas_threads(self, n: int) -> None:
        if n == self.openblas_threads:
            return
        if self._controllers is None:
            from threadpoolctl import ThreadpoolController

            self._controllers = [c for c in ThreadpoolController().lib_controllers if c.internal_api == "openblas"]
        for c in self._controllers:
            c.set_num_threads(n)
        self.openblas_threads = n


_step = _StepProducts()


def _detect_backend() -> str:
    choice = os.environ.get("HYBRIDLM_BLAS", "auto").lower()
    if choice not in ("auto", "torch", "openblas"):
        raise InputError(f"HYBRIDLM_BLAS={choice!r}: expected auto, torch or openblas")
    if choice != "auto":
        return choice if choice == "torch" or _numpy_has_openblas() else "torch"
    if platform.machine().lower() not in ("x86_64", "amd64") or cpuinfo("vendor_id") == "GenuineIntel":
        return "torch"
    if "BLAS_INFO=mkl" not in torch.__config__.show() or not _numpy_has_openblas():
        return "torch"
    return "openblas"


def cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (vendor_id, flags, ...); None where unknown."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _numpy_has_openblas() -> bool:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except (TypeError, KeyError):
        return False
    return "openblas" in str(blas.get("name", "")).lower()


BACKEND = _detect_backend()  # the BLAS of a token step's products: "openblas" or "torch"


def step_products(model, rows: int):
    """The context of one token step of `model` with `rows` rows (B · m).

    When the step BLAS is OpenBLAS and the model's products are exact float32 affine maps on
    the CPU, PyTorch's pool runs on one thread inside, OpenBLAS on the pool's former count;
    otherwise nothing changes. Nested calls reuse the outer one. The thread count is
    process-wide, so other Python threads' PyTorch work runs on one thread meanwhile.
    """
    if (BACKEND != "openblas" or _step.active or rows > STEP_ROWS or getattr(model, "precision", None) != "float32"
            or model.W_e.device.type != "cpu"):
        return contextlib.nullcontext()
    return _step_window()


@contextlib.contextmanager
def _step_window():
    threads = torch.get_num_threads()
    _step.set_openblas_threads(threads)
    torch.set_num_threads(1)
    _step.active = True
    try:
        yield
    finally:
        _step.active = False
        torch.set_num_threads(threads)
