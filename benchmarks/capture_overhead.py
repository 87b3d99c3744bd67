"""Cost of observability: a forward pass with hooks off, with every residual state recorded,
and with every activation recorded (attention patterns included), beside transformers'
forward on the same weights. GPT-2-small shapes (random weights), one prompt of 512 tokens.

    python benchmarks/capture_overhead.py [--tokens 512] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import GPT2LMHeadModel

    from hybridlm import load_model
    from hybridlm.lm.capture import TrajectoryRecorder
    from hybridlm.weights.hub import save_gpt2_folder

    ours = load_model("random:gpt2", seed=0)
    with tempfile.TemporaryDirectory() as folder:
        save_gpt2_folder(ours, folder)
        ref = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.randint(0, 50257, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def plain():
        ours(ids)

    def residuals():
        with TrajectoryRecorder(ours, lambda n: "resid" in n):
            ours(ids)

    def everything():
        with TrajectoryRecorder(ours):
            ours(ids)

    def transformers_forward():
        ref(ids)

    contenders = {"transformers forward": transformers_forward, "hybridlm, hooks off": plain,
                  "hybridlm, all residual states": residuals, "hybridlm, every activation": everything}
    with torch.no_grad():
        for run in contenders.values():
            run()
        times = {k: [] for k in contenders}
        for _ in range(args.repeats):
            for name, run in contenders.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"forward of {args.tokens} tokens, GPT-2-small shapes, {args.threads} threads, "
          f"median of {args.repeats} (min–max), ratio to hooks off / to transformers")
    for k, v in times.items():
        print(f"  {k:<32} {med[k] * 1e3:8.1f} ms ({min(v) * 1e3:.1f}–{max(v) * 1e3:.1f})  "
              f"{med[k] / med['hybridlm, hooks off']:.3f}×  {med[k] / med['transformers forward']:.3f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
