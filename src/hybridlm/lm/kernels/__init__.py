"""Compiled kernels: C sources built once per machine with the system's C compiler into one
library, loaded with ctypes. Each has a PyTorch path beside it that computes the same map,
taken wherever the library cannot be built or does not apply.

`int4.c`, the product of the int4 path (`hybridlm.lm.quantize.Int4Linear`). A decode step
reads every weight once; in 4 bits the step is bound less by memory than by how fast the
nibbles turn into products. PyTorch's own int4 kernel (`_weight_int4pack_mm_for_cpu`)
converts them to floats and took 63 % of an int4 decode step of SmolLM2-135M on an AVX2
CPU. This kernel widens the nibbles to 16-bit integers and forms each group's dot product
with integer multiply-adds, against the input in 16 bits per group of 32 (one scale per
group: steps of 1/32767 of the group's largest entry, finer than the bfloat16 input that
PyTorch's kernel reads). llama.cpp takes its input in 8 bits; here that cost the int4 path
its agreement with float32 (94 % of greedy next tokens over 200 positions of SmolLM2,
against 100 % in 16 bits, at the same speed).

`attention.c`, one decode step of attention (`hybridlm.lm.attention.Attention`, one new query
row per sequence, no attention hook attached): rotary phases, the new key and value rows
written into the state, and softmax(q Kᵀ · scale) V over the state, in one call. In PyTorch
that is some 25 small operations and a fused attention kernel per layer, about a third of a
SmolLM2 decode step on this kind of CPU, whose arithmetic is a few microseconds.

`layer.c`, a token step of whole blocks (`hybridlm.lm.step`): the norms, the activations and
the residual sums around the products and attention above, a sublayer in one call and a run of
blocks in one call (writing out the states their hook points see, for hooks that observe).
A token step of SmolLM2 had spent as long again in these small PyTorch operations and the
Python between them as in its products. The staged path (a hook point inside a sublayer)
calls the same norms and activations one at a time, so a block's bits do not depend on what
watches it.

Each source's header states its map exactly. `build` compiles them into one library (once per
machine, cached) that runs its loops on PyTorch's own thread pool.
"""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import torch

from hybridlm.errors import InputError
from hybridlm.lm.kernels import build

STEP_ROWS = 32  # a product of at most this many rows (a token step's) takes the compiled kernels
BLOCK_COLUMNS = 768  # a product of more rows is taken this many output columns at a time (the BLAS's)


class AffineKernel:
    """y = x Wᵀ + b in float32, batch-invariant: each row's result has the same bits whatever
    rows stand beside it (affine.c states the order of the sums). For a token step's few rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._affine = _function(lib.hybridlm_affine, [p, i64, i64, p, i64, p, i64, p], ctypes.c_int)

    @staticmethod
    def applies(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> bool:
        """Float32 CPU tensors, W stored column by column (Wᵀ rows contiguous), outside autograd."""
        return (x.dtype == W.dtype == torch.float32 and x.is_cpu and W.is_cpu
                and W.dim() == 2 and W.stride(0) == 1 and W.stride(1) >= W.shape[0]
                and (b is None or (b.dtype == torch.float32 and b.is_contiguous()))
                and not (torch.is_grad_enabled()
                         and (x.requires_grad or W.requires_grad or (b is not None and b.requires_grad))))

    def __call__(self, x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] → [..., N] for W [N, K] (column by column) and b [N] or None."""
        x = x.contiguous()  # (itself when it already is)
        K, N = x.shape[-1], W.shape[0]
        y = x.new_empty((*x.shape[:-1], N))
        R = x.numel() // K if K else 0
        if R and self._affine(x.data_ptr(), R, K, W.data_ptr(), W.stride(1), None if b is None else b.data_ptr(),
                              N, y.data_ptr()):
            raise MemoryError(f"affine kernel: no memory for a partial sum of {R} × {N} floats")
        return y


class Int4Kernel:
    """y = x Ŵᵀ + b through the compiled library (int4.c states the map exactly).

    A few rows (a token step: at most `STEP_ROWS`) take the kernel itself. More rows (a
    prefill) are compute-bound rather than bound by the weights' bytes, and there the
    BLAS wins: Ŵ is dequantised `BLOCK_COLUMNS` output channels at a time and multiplied
    in float32 (a 512-row product of SmolLM2's 3072 × 576 W_gate_up: 24 ms against 43 ms
    in the kernel, 2 threads).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._affine = _function(lib.hybridlm_int4_affine, [p, i64, i64, p, p, p, p, i64, p], ctypes.c_int)
        self._dequantise = _function(lib.hybridlm_int4_dequantise, [p, p, p, i64, i64, i64, p])

    def affine(self, x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
               b: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] float32 → [..., N]; packed [N, K/2] uint8, d and m [N, K/32] (the bits of
        float16 numbers, any 2-byte dtype), b [N] or None; all contiguous on the CPU."""
        if not x.is_contiguous():
            x = x.contiguous()
        if b is not None and b.dtype != torch.float32:
            b = b.float()
        K, N = x.shape[-1], packed.shape[0]
        R = x.numel() // K if K else 0
        y = x.new_empty(x.shape[:-1] + (N,))
        if R > STEP_ROWS:
            return self._blocks(x.view(R, K), packed, d, m, b, y.view(R, N)).view(y.shape)
        if R and self._affine(x.data_ptr(), R, K, packed.data_ptr(), d.data_ptr(), m.data_ptr(),
                              None if b is None else b.data_ptr(), N, y.data_ptr()):
            raise MemoryError(f"int4 kernel: no memory for the 16-bit copy of a [{R}, {K}] input")
        return y

    def dequantise(self, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, start: int, stop: int,
                   out: torch.Tensor) -> torch.Tensor:
        """Rows start..stop of Ŵ into out [stop − start, K] (contiguous float32)."""
        self._dequantise(packed.data_ptr(), d.data_ptr(), m.data_ptr(), packed.shape[1] * 2, start, stop,
                         out.data_ptr())
        return out

    def _blocks(self, rows, packed, d, m, b, y):
        w = rows.new_empty(min(BLOCK_COLUMNS, packed.shape[0]), rows.shape[1])
        for i in range(0, packed.shape[0], BLOCK_COLUMNS):
            j = min(i + BLOCK_COLUMNS, packed.shape[0])
            block = self.dequantise(packed, d, m, i, j, w[: j - i])
            if b is None:
                torch.mm(rows, block.t(), out=y[:, i:j])
            else:
                torch.addmm(b[i:j], rows, block.t(), out=y[:, i:j])
        return y


class Segment(ctypes.Structure):
    """Rows of GGUF blocks as blockquant.c reads them: `rows` rows of ggml type `type`, each
    `row_bytes` long, from address `data` on."""

    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64)]


class BlockQuantKernel:
    """y = x Ŵᵀ + b for Ŵ a stack of segments of GGUF block rows (blockquant.c states the map
    exactly), and Ŵ itself, dequantised with the file's own arithmetic.

    A few rows (a token step: at most `STEP_ROWS`) take the kernel, which reads each weight byte
    once for all of them. More rows (a prefill) are bound by arithmetic: where the build has
    AVX-512 VNNI they take its 16-bit multiply-adds across output channels (`many_rows`; twice the
    products per instruction of float32's), elsewhere `BLOCK_COLUMNS` output channels at a time,
    dequantised, then multiplied by the BLAS in float32.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._affine = _function(lib.hybridlm_blockquant_affine, [p, i64, i64, p, i64, p, i64, p], ctypes.c_int)
        self._dequantise = _function(lib.hybridlm_blockquant_dequantise, [p, i64, i64, i64, p])
        self._rows = _function(lib.hybridlm_blockquant_rows, [p, i64, p, i64, p])
        self._many = _function(lib.hybridlm_blockquant_many, [p, i64, i64, p, i64, p, i64, p], ctypes.c_int)
        self.many_rows = bool(lib.hybridlm_blockquant_gemm())  # the compiled prefill product (AVX-512 VNNI)
        self._type = _function(lib.hybridlm_blockquant_type, [i64, p, p], ctypes.c_int)

    def block(self, kind: int) -> tuple[int, int] | None:
        """(weights, bytes) of a block of ggml type `kind`, or None where the kernel does not read it."""
        weights, size = ctypes.c_int64(), ctypes.c_int64()
        return (weights.value, size.value) if self._type(kind, ctypes.byref(weights), ctypes.byref(size)) else None

    def affine(self, x: torch.Tensor, segments, K: int, N: int, b: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] float32 → [..., N]; `segments` a ctypes array of `Segment` (N rows together,
        whose memory the caller keeps), b [N] contiguous float32 or None."""
        if not x.is_contiguous():
            x = x.contiguous()
        R = x.numel() // K if K else 0
        y = x.new_empty(x.shape[:-1] + (N,))
        if R > STEP_ROWS and not self.many_rows:
            return self._blocks(x.view(R, K), segments, K, b, y.view(R, N)).view(y.shape)
        product = self._affine if R <= STEP_ROWS else self._many
        if R and product(x.data_ptr(), R, K, ctypes.addressof(segments), len(segments), address(b), N, y.data_ptr()):
            raise MemoryError(f"block-quantised kernel: no memory for the 16-bit copy of a [{R}, {K}] input")
        return y

    def dequantise(self, segment: Segment, K: int, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows start..stop of one segment's Ŵ into out [stop − start, K] (contiguous float32)."""
        self._dequantise(ctypes.addressof(segment), K, start, stop, out.data_ptr())
        return out

    def rows(self, segment: Segment, K: int, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows ids (contiguous int64, in range) of one segment's Ŵ into out [len(ids), K]."""
        self._rows(ctypes.addressof(segment), K, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def _blocks(self, rows, segments, K, b, y):
        w = rows.new_empty(min(BLOCK_COLUMNS, max(s.rows for s in segments)), K)
        col = 0
        for segment in segments:
            for i in range(0, segment.rows, BLOCK_COLUMNS):
                j = min(i + BLOCK_COLUMNS, segment.rows)
                block = self.dequantise(segment, K, i, j, w[: j - i])
                out = y[:, col + i : col + j]
                if b is None:
                    torch.mm(rows, block.t(), out=out)
                else:
                    torch.addmm(b[col + i : col + j], rows, block.t(), out=out)
            col += segment.rows
        return y


class DecodeAttention:
    """One decode step of attention through the compiled library (attention.c states the map):
    in one call (`__call__`), or in stages between which hooks may look and replace (`scores`,
    `pattern`, `output`; with nothing replaced they give the one call's bits).

    Every tensor is contiguous float32 on the CPU; K and V are a layer's [B, H_kv, cap, d]
    buffers, cos and sin the rotary tables [T, d] whose row n is used (None: no rotary).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._step = _function(lib.hybridlm_decode_attention,
                               [p, i64, i64, i64, i64, p, p, i64, i64, i64, p, p, f32, p], ctypes.c_int)
        self._scores = _function(lib.hybridlm_attention_scores,
                                 [p, p, p, i64, i64, i64, i64, p, p, i64, i64, i64, p, p, f32, p], ctypes.c_int)
        self._batch = _function(lib.hybridlm_decode_attention_batch,
                                [p, i64, i64, i64, i64, p, i64, i64, p, p, f32, p, p, p], ctypes.c_int)
        self._fork = _function(lib.hybridlm_fork_attention,
                               [p, i64, i64, i64, i64, p, p, i64, i64, i64, p, p, f32, p, p, p], ctypes.c_int)
        self._pattern = _function(lib.hybridlm_attention_pattern, [p, i64, i64, i64, p])
        self._output = _function(lib.hybridlm_attention_output, [p, i64, i64, i64, i64, p, i64, i64, i64, p])

    def __call__(self, heads: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n: int, start: int,
                 cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float, n_kv_head: int) -> torch.Tensor:
        """heads [B, 1, H + 2·H_kv, d] → O [B, 1, H, d]; writes row n of K and V; keys start..n are read."""
        B, _, width, d = heads.shape
        H = width - 2 * n_kv_head
        out = heads.new_empty(B, 1, H, d)
        if self._step(heads.data_ptr(), B, H, n_kv_head, d, K.data_ptr(), V.data_ptr(), K.shape[2], n, start,
                      *_rotary_rows(cos, sin, n, d), scale, out.data_ptr()):
            raise MemoryError(f"decode attention: no memory for the scores over {n + 1 - start} keys")
        return out

    def batch(self, heads: torch.Tensor, rows: torch.Tensor, layer: int, window: int | None,
              cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float, n_kv_head: int) -> torch.Tensor:
        """A ragged batch in one call: heads [B, 1, H + 2·H_kv, d] → O [B, 1, H, d], row b against
        its own state (`rows`: the [5, B] table of `hybridlm.lm.state.step_rows`); cos and sin the
        whole rotary tables [T, d] or None."""
        B, _, width, d = heads.shape
        H = width - 2 * n_kv_head
        out = heads.new_empty(B, 1, H, d)
        if self._batch(heads.data_ptr(), B, H, n_kv_head, d, rows.data_ptr(), layer, window or 0,
                       None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                       scale, out.data_ptr(), None, None):
            raise MemoryError("decode attention: no memory for the scores of a batch")
        return out

    def fork(self, heads: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n: int, start: int,
             cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float,
             n_kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """B candidates continuing one state at position n (a fork): heads [B, 1, H + 2·H_kv, d]
        against the parent's keys start..n − 1 of K and V ([1, H_kv, cap, d], only read) and each
        its own row n → (O [B, 1, H, d], the rotated k [B, H_kv, d], v [B, H_kv, d])."""
        B, _, width, d = heads.shape
        H = width - 2 * n_kv_head
        out, k, v = heads.new_empty(B, 1, H, d), heads.new_empty(B, n_kv_head, d), heads.new_empty(B, n_kv_head, d)
        if self._fork(heads.data_ptr(), B, H, n_kv_head, d, K.data_ptr(), V.data_ptr(), K.shape[2], n, start,
                      *_rotary_rows(cos, sin, n, d), scale, k.data_ptr(), v.data_ptr(), out.data_ptr()):
            raise MemoryError(f"fork attention: no memory for the scores over {n + 1 - start} keys")
        return out, k, v

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n: int,
               start: int, cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float) -> torch.Tensor:
        """q [B, 1, H, d], k and v [B, 1, H_kv, d] → row n of K and V, and S [B, H, 1, n + 1], the
        scaled scores of the keys start..n (−∞ before start)."""
        B, _, H, d = q.shape
        S = q.new_empty(B, H, 1, n + 1)
        if self._scores(q.data_ptr(), k.data_ptr(), v.data_ptr(), B, H, k.shape[2], d, K.data_ptr(), V.data_ptr(),
                        K.shape[2], n, start, *_rotary_rows(cos, sin, n, d), scale, S.data_ptr()):
            raise MemoryError("decode attention: no memory for a rotated query")
        return S

    def pattern(self, S: torch.Tensor, start: int) -> torch.Tensor:
        """A: the softmax of each row of S over its columns start.. (0 before)."""
        A = torch.empty_like(S)
        self._pattern(S.data_ptr(), S.numel() // S.shape[-1], S.shape[-1], start, A.data_ptr())
        return A

    def output(self, A: torch.Tensor, V: torch.Tensor, n: int, start: int) -> torch.Tensor:
        """O [B, 1, H, d] = A V over the keys start..n (A [B, H, 1, n + 1])."""
        B, H = A.shape[:2]
        d = V.shape[3]
        O = A.new_empty(B, 1, H, d)
        self._output(A.data_ptr(), B, H, V.shape[1], d, V.data_ptr(), V.shape[2], n, start, O.data_ptr())
        return O


class Product(ctypes.Structure):
    """One affine map as layer.c reads it: float32 Wᵀ [K, ldw] (`wt`), int4 (`packed`, `d`, `m`),
    or `nseg` segments of GGUF block rows (`segments`, the address of an array of `Segment`)."""

    _fields_ = [("wt", ctypes.c_void_p), ("ldw", ctypes.c_int64), ("packed", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("segments", ctypes.c_void_p),
                ("nseg", ctypes.c_int64)]


class BlockSpec(ctypes.Structure):
    """One block's parameters as layer.c reads them (the addresses of its tensors, not copies)."""

    _fields_ = [("rms", ctypes.c_int64), ("mlp", ctypes.c_int64), ("layer", ctypes.c_int64),
                ("window", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("g1", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("g2", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("gq", ctypes.c_void_p), ("gk", ctypes.c_void_p), ("p1", ctypes.c_void_p), ("p2", ctypes.c_void_p),
                ("local", ctypes.c_int64), ("qkv", Product), ("out", Product), ("up", Product), ("down", Product)]


MLP_KINDS = {"gelu": 0, "swiglu": 1, "geglu": 2}  # BlockSpec.mlp (layer.c's MLP_GELU, MLP_SWIGLU, MLP_GEGLU)


class Tables(ctypes.Structure):
    """The rotary tables as layer.c reads them (addresses; None: no rotation): the global blocks',
    and the local blocks' (the same where they rotate with the same base)."""

    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("cos_local", ctypes.c_void_p),
                ("sin_local", ctypes.c_void_p)]


class Sizes(ctypes.Structure):
    """The sizes a model's blocks share: width D, heads H and H_kv, head width d, MLP width."""

    _fields_ = [("D", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("d", ctypes.c_int64),
                ("d_mlp", ctypes.c_int64)]


class BlockKernel:
    """A token step of the blocks through the compiled library (layer.c states the map): its norms
    and activations alone (what the staged path calls), each sublayer in one call, or a run of
    whole blocks in one call. All of them give the same bits for the same rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._norm = _function(lib.hybridlm_norm, [p, i64, i64, i64, f32, p, p, p])
        self._swiglu = _function(lib.hybridlm_swiglu, [p, i64, p, i64, i64, i64, p])
        self._gelu = _function(lib.hybridlm_gelu, [p, i64, i64, p])
        self._attention = _function(lib.hybridlm_attention_sublayer, [p, p, p, i64, p, p, p], ctypes.c_int)
        self._mlp = _function(lib.hybridlm_mlp_sublayer, [p, p, p, i64, p], ctypes.c_int)
        self._blocks = _function(lib.hybridlm_decode_blocks, [p, i64, p, p, i64, p, p, p, i64, p], ctypes.c_int)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether x is a token step's rows (`token_rows`) of float32 on the CPU outside autograd:
        what these kernels compute for."""
        return (x.dtype == torch.float32 and x.is_cpu and token_rows(x)
                and not (x.requires_grad and torch.is_grad_enabled())
                and not torch._C._functorch.is_functorch_wrapped_tensor(x))

    def norm(self, h: torch.Tensor, rms: bool, eps: float, g: torch.Tensor | None,
             b: torch.Tensor | None) -> torch.Tensor:
        """LayerNorm or RMSNorm of each row of h (γ, β: contiguous float32, or None for x̂ alone)."""
        h = h.contiguous()
        out = torch.empty_like(h)
        D = h.shape[-1]
        self._norm(h.data_ptr(), h.numel() // D if D else 0, D, int(rms), eps, address(g), address(b),
                   out.data_ptr())
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) ⊙ up, both [..., n] (slices of the fused product are read where they lie)."""
        n = gate.shape[-1]
        out = gate.new_empty(gate.shape)
        if out.numel():
            g, u = _matrix(gate, n), _matrix(up, n)
            self._swiglu(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), g.shape[0], n, out.data_ptr())
        return out

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        self._gelu(x.data_ptr(), x.numel() // n if n else 0, n, out.data_ptr())
        return out

    def attention(self, spec, sizes: Sizes, h: torch.Tensor, rows: torch.Tensor, tables: Tables) -> torch.Tensor:
        """The attention sublayer of one block (`spec`) for the rows h [R, 1, D]: Attn(LN₁(h)) W_O + b_O
        (normed where the block has a post-norm)."""
        h = h.contiguous()
        out = torch.empty_like(h)
        if self._attention(ctypes.addressof(spec), ctypes.addressof(sizes), h.data_ptr(), rows.shape[1],
                           rows.data_ptr(), ctypes.addressof(tables), out.data_ptr()):
            raise MemoryError("attention sublayer: no scratch memory")
        return out

    def mlp(self, spec, sizes: Sizes, h: torch.Tensor) -> torch.Tensor:
        """The MLP sublayer of one block for the rows h [R, 1, D]: MLP(LN₂(h))."""
        h = h.contiguous()
        out = torch.empty_like(h)
        if self._mlp(ctypes.addressof(spec), ctypes.addressof(sizes), h.data_ptr(), h.shape[0], out.data_ptr()):
            raise MemoryError("MLP sublayer: no scratch memory")
        return out

    def blocks(self, specs: int, count: int, sizes: Sizes, h: torch.Tensor, rows: torch.Tensor, tables: Tables,
               taps: torch.Tensor | None = None, inner: bool = False, own: torch.Tensor | None = None) -> None:
        """`count` consecutive blocks (their specs from address `specs` on) for the rows h [R, 1, D],
        contiguous, advanced in place. taps (None: none) receive the states the blocks' hook points
        see, block after block in layer.c's layout (`hybridlm.lm.step.tap_layout`): the residual
        stream's alone, or with `inner` every one. own ([count, 2, R, H_kv, d] or None): the rows are
        a fork's candidates of the one state in `rows`, and their new keys and values go there."""
        if self._blocks(specs, count, ctypes.addressof(sizes), h.data_ptr(), h.shape[0], rows.data_ptr(),
                        ctypes.addressof(tables), address(taps), int(inner), address(own)):
            raise MemoryError("decode blocks: no scratch memory")


def token_rows(x: torch.Tensor) -> bool:
    """Whether x [..., D] holds a token step's rows: one position per sequence ([..., 1, D], or
    [R, D]) and at most `STEP_ROWS` of them."""
    return (x.dim() < 3 or x.shape[-2] == 1) and x.numel() <= STEP_ROWS * x.shape[-1]


def step_kernel(states: tuple, params: tuple = ()) -> BlockKernel | None:
    """The compiled norms and activations for `states` (one shape, each a token step's rows that
    `BlockKernel.takes`) with the gains and biases `params` (None, or contiguous float32 vectors of
    the rows' width outside autograd): the ones a compiled block runs. None elsewhere."""
    kernel = blocks()
    if kernel is None or any(s.shape != states[0].shape or not kernel.takes(s) for s in states):
        return None
    grad = torch.is_grad_enabled()
    if any(not plain_vector(p, states[0].shape[-1]) or (grad and p is not None and p.requires_grad) for p in params):
        return None
    return kernel


def rotary_tables(rotary) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """(cos, sin) of a `Rotary` as the compiled kernels read them, (None, None) without one, and
    None where the tables are not contiguous float32 on the CPU."""
    if rotary is None:
        return None, None
    cos, sin = rotary.cos, rotary.sin
    if cos.dtype != torch.float32 or not (cos.is_cpu and cos.is_contiguous() and sin.is_contiguous()):
        return None
    return cos, sin


def address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def plain_vector(t: torch.Tensor | None, n: int) -> bool:
    """Whether t is None or a contiguous float32 vector of n entries on the CPU (a gain or a bias)."""
    return t is None or (t.dtype == torch.float32 and t.is_cpu and t.dim() == 1 and t.shape[0] == n
                         and t.is_contiguous())


def _matrix(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as an [R, n] matrix of contiguous rows, evenly spaced (a view where one exists)."""
    try:
        m = t.view(-1, n)
    except RuntimeError:
        m = t.contiguous().view(-1, n)
    return m if m.stride(1) == 1 else m.contiguous()


def plain(t: torch.Tensor, shape: tuple, what: str) -> torch.Tensor:
    """What a hook handed back, as contiguous float32 on the CPU once its shape is checked
    (−1: any size there): the compiled stages read it in C, which trusts the shape."""
    if t.dim() != len(shape) or any(e not in (-1, a) for a, e in zip(t.shape, shape)):
        raise InputError(f"{what} has shape {tuple(t.shape)}: expected {tuple('*' if e < 0 else e for e in shape)}")
    return t.to(device="cpu", dtype=torch.float32).contiguous()


def _function(fn, argtypes, restype=None):
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _rotary_rows(cos, sin, n: int, d: int) -> tuple:
    """Addresses of row n of the rotary tables, or (None, None)."""
    if cos is None:
        return None, None
    return cos.data_ptr() + 4 * d * n, sin.data_ptr() + 4 * d * n


class Library:
    """The loaded library and its kernels."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.vectorised = bool(lib.hybridlm_vectorised())
        self.team = lib.hybridlm_team  # () -> the threads its loops get (PyTorch's count)
        self.affine = AffineKernel(lib)
        self.int4 = Int4Kernel(lib)
        self.blockquant = BlockQuantKernel(lib)
        self.decode_attention = DecodeAttention(lib)
        self.blocks = BlockKernel(lib)


_state: dict = {}


def library() -> Library | None:
    """The compiled library, built on first call; None where it cannot be used here."""
    if "library" not in _state:
        try:
            _state["library"], _state["why"] = build.load(Library), "compiled"
        except build.Unavailable as exc:
            _state["library"], _state["why"] = None, str(exc)
    return _state["library"]


def affine() -> AffineKernel | None:
    """The batch-invariant float32 product, or None (then a token step's rows go one by one)."""
    lib = library()
    return None if lib is None else lib.affine


def int4() -> Int4Kernel | None:
    """The int4 product, or None (then `Int4Linear` uses PyTorch's)."""
    lib = library()
    return None if lib is None else lib.int4


def blockquant() -> BlockQuantKernel | None:
    """The product on GGUF's block grids, or None (then `BlockQuantLinear` dequantises in PyTorch)."""
    lib = library()
    return None if lib is None else lib.blockquant


def decode_attention() -> DecodeAttention | None:
    """One decode step of attention, or None (then `Attention` uses PyTorch's)."""
    lib = library()
    return None if lib is None else lib.decode_attention


def blocks() -> BlockKernel | None:
    """A token step's norms, activations, sublayers and blocks, or None (then PyTorch's operations)."""
    lib = library()
    return None if lib is None else lib.blocks


def status() -> str:
    """What this process computes with, and why (for reports and the bench)."""
    lib = library()
    if lib is None:
        return f"PyTorch's kernels ({_state['why']})"
    vectors = ("AVX2 and AVX-512" if "-mavx512f" in build.cpu_flags() else "AVX2") if lib.vectorised else "portable C"
    return (f"hybridlm's kernels ({vectors}): batch-invariant float32 and int4 products (int4 with 16-bit input "
            f"per group of 32), decode and fork attention, compiled blocks")


def warn_unavailable() -> None:
    """Say once, where a user asked for int4, that a slower product stands in for the kernel."""
    if _state.get("warned") or library() is not None:
        return
    why = _state.get("why", "not loaded")
    if why != "HYBRIDLM_KERNELS=off":
        _state["warned"] = True
        warnings.warn(f"hybridlm: the compiled kernels are unavailable ({why}); the int4 path falls back to a "
                      "slower product", stacklevel=3)
