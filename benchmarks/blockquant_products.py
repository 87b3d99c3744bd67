"""Products on GGUF's block grids, matrix by matrix: hybridlm's kernel beside llama.cpp's, float32
and the memory's bound, interleaved in time.

For each model's matrices (Qwen2.5-0.5B: d = 896, d_mlp = 4864, vocab 151,936; Gemma 3 270M:
d = 640, heads 4 × 256, d_mlp = 2048, vocab 262,144) and each block type that fits their width,
one matrix of random valid blocks is multiplied by

- hybridlm: `BlockQuantLinear` (a token step's row: the compiled kernel; 512 rows: dequantised
  blocks through the BLAS);
- llama.cpp: ggml's own `mul_mat` on the same bytes (the library that `llama_cpp` ships, called
  through ctypes, on as many threads; it takes x in 8 bits);
- float32: the exact path on the dequantised weights (`linear.affine`: one row through the
  batch-invariant kernel, 512 rows through the BLAS);
- the bound: the matrix's bytes over the memory bandwidth measured in the same run (one row only:
  a 512-row product is bound by arithmetic, not bytes).

Each round takes every contender once (the best of a few calls), in shuffled order; a figure is the
median over rounds with its spread, and a ratio is the median of the per-round ratios (the machine
is shared: its drift between minutes cancels within a round). The readout's matrix is timed for one
row only (a prefill needs the last row's logits).

    python benchmarks/blockquant_products.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from hybridlm.lm import kernels
from hybridlm.lm.blockquant import BLOCKS, BlockQuantLinear
from hybridlm.lm.linear import affine, column_major_zeros

MODELS = {  # name: [(matrix, N outputs, K inputs)]
    "qwen2.5-0.5b": [("W_qkv", 1152, 896), ("W_O", 896, 896), ("W_gate_up", 9728, 896), ("W_down", 896, 4864),
                     ("W_u", 151936, 896)],
    "gemma-3-270m": [("W_qkv", 1536, 640), ("W_O", 640, 1024), ("W_gate_up", 4096, 640), ("W_down", 640, 2048),
                     ("W_u", 262144, 640)],
}
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, N: int, K: int, rng) -> np.ndarray:
    weights, size = BLOCKS[kind]
    raw = rng.integers(0, 256, size=(N, K // weights, size), dtype=np.uint8)
    for at in HALVES[kind]:
        h = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[:, :, at : at + 2] = h.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(N, -1)


class GGML:
    """ggml's matrix product from the library llama_cpp ships: C = X Wᵀ on the stored bytes."""

    class _Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self, threads: int) -> None:
        import llama_cpp

        folder = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for lib, name, args, res in [(base, "ggml_init", [self._Params], p), (base, "ggml_free", [p], None),
                                     (base, "ggml_new_tensor_2d", [p, ctypes.c_int, i64, i64], p),
                                     (base, "ggml_get_data", [p], p), (base, "ggml_mul_mat", [p, p, p], p),
                                     (base, "ggml_new_graph", [p], p), (base, "ggml_build_forward_expand", [p, p], None),
                                     (cpu, "ggml_graph_compute_with_ctx", [p, p, ctypes.c_int], ctypes.c_int),
                                     (cpu, "ggml_cpu_init", [], None)]:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
            setattr(self, name, fn)
        self.ggml_cpu_init()
        self.threads = threads

    def product(self, raw: np.ndarray, kind: str, K: int, R: int):
        """A function computing X Wᵀ for W the blocks `raw` [N, bytes] of `kind` and X [R, K], and X's memory."""
        N = raw.shape[0]
        ctx = self.ggml_init(self._Params(raw.nbytes + 8 * R * (K + N) + (256 << 20), None, False))
        W = self.ggml_new_tensor_2d(ctx, int(gguf.GGMLQuantizationType[kind]), K, N)
        X = self.ggml_new_tensor_2d(ctx, 0, K, R)
        ctypes.memmove(self.ggml_get_data(W), raw.ctypes.data, raw.nbytes)
        C = self.ggml_mul_mat(ctx, W, X)
        graph = self.ggml_new_graph(ctx)
        self.ggml_build_forward_expand(graph, C)
        x = np.frombuffer((ctypes.c_float * (R * K)).from_address(self.ggml_get_data(X)), np.float32).reshape(R, K)
        out = np.frombuffer((ctypes.c_float * (R * N)).from_address(self.ggml_get_data(C)), np.float32).reshape(R, N)

        def run():
            if self.ggml_graph_compute_with_ctx(ctx, graph, self.threads):
                raise RuntimeError("ggml_graph_compute failed")
            return out

        run.x, run.free = x, lambda: self.ggml_free(ctx)
        return run


def best_of(fn, budget: float = 0.05, most: int = 50) -> float:
    """The least time of a few calls (at least 2, until `budget` seconds have passed)."""
    times = []
    start = time.perf_counter()
    while len(times) < 2 or (time.perf_counter() - start < budget and len(times) < most):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bandwidth(threads: int) -> float:
    """Bytes per second a full read of 512 MB reaches (torch's sum of float32, best of 5)."""
    big = torch.ones(128 << 20)
    big.sum()
    return big.numel() * 4 / min(best_of(big.sum, 0, 1) for _ in range(5))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    p.add_argument("--rows", default="1,512", help="rows of x: a token step's and a prefill's")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.blockquant() is None:
        raise SystemExit(f"no compiled kernel: {kernels.status()}")
    ggml, rng = GGML(args.threads), np.random.default_rng(0)
    print(f"{kernels.status()}; {args.threads} threads")
    report = []
    for model in args.models.split(","):
        for matrix, N, K in MODELS[model]:
            dense = None
            for kind in args.types.split(","):
                if K % BLOCKS[kind][0]:
                    continue
                raw = random_blocks(kind, N, K, rng)
                lin = BlockQuantLinear([(raw, kind, (N, K))])
                if dense is None or dense.shape != (N, K):
                    dense = column_major_zeros(N, K)
                dense.copy_(lin.weight)
                for R in map(int, args.rows.split(",")):
                    if matrix == "W_u" and R > 1:
                        continue
                    report.append(measure(model, matrix, kind, raw, lin, dense, R, ggml, args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def measure(model, matrix, kind, raw, lin, dense, R, ggml, args) -> dict:
    N, K = dense.shape
    x = torch.randn(R, K)
    llama = ggml.product(raw, kind, K, R)
    llama.x[:] = x.numpy()
    runs = {"hybridlm": lambda: lin(x), "llama.cpp": llama, "float32": lambda: affine(x, dense)}
    agree = float((torch.from_numpy(llama().copy()) - lin(x)).abs().max() / lin(x).abs().max())
    times = {name: [] for name in runs}
    order = list(runs)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(best_of(runs[name]))
    llama.free()
    rate = bandwidth(args.threads) if R == 1 else None
    fig = {"model": model, "matrix": matrix, "type": kind, "N": N, "K": K, "rows": R, "bytes": raw.nbytes,
           "us": {name: statistics.median(t) * 1e6 for name, t in times.items()},
           "spread_us": {name: [min(t) * 1e6, max(t) * 1e6] for name, t in times.items()},
           "vs_llama": statistics.median(a / b for a, b in zip(times["llama.cpp"], times["hybridlm"])),
           "vs_float32": statistics.median(a / b for a, b in zip(times["float32"], times["hybridlm"])),
           "max_rel_diff_vs_llama": agree}
    line = (f"{model:13} {matrix:9} {kind:4} {N:6}x{K:<5} R={R:<3} hybridlm {fig['us']['hybridlm']:9.1f} us "
            f"llama.cpp {fig['us']['llama.cpp']:9.1f} ({fig['vs_llama']:.2f}x) float32 {fig['us']['float32']:9.1f} "
            f"({fig['vs_float32']:.2f}x)")
    if rate:
        fig["bound_us"] = raw.nbytes / rate * 1e6
        line += f"  bound {fig['bound_us']:8.1f} us ({fig['bound_us'] / fig['us']['hybridlm']:.0%} of it)"
    print(line, flush=True)
    return fig


if __name__ == "__main__":
    main()
