"""The hidden-state barrier's cost per token step beside an unfiltered step, at context n.

The barrier (hybridlm.control.HiddenBarrier inside a SafetyFilter) needs h⁽ᴸ⁾ of s ∘ w for its k
candidate tokens w: one decode step of k rows forked from the state (they share its rows).
Steps with and without the filter alternate in shuffled rounds on the same prompt; the report
is the median time per step of each and their ratio.

    python benchmarks/barrier_fork.py [--n 200] [--k 16] [--steps 16] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from hybridlm import Kernel, generate, load_model
from hybridlm.control import HiddenBarrier, SafetyFilter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="context length when the steps start")
    p.add_argument("--k", type=int, default=16, help="candidates the barrier verifies per step")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model()
    d = model.config.d_model
    w = torch.randn(d, generator=torch.Generator().manual_seed(0))
    barrier = SafetyFilter(HiddenBarrier(model, lambda h: h.float() @ w + 1e3, candidates=args.k))  # a half-space
    text = "A hybrid automaton flows in its flow set and jumps in its jump set. " * 40
    ids = model.tokenizer.encode(text)[: args.n]
    kernel = Kernel(temperature=1.0)
    runs = {"unfiltered": None, "barrier": [barrier]}
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        order = list(runs)
        random.shuffle(order)
        for name in order:
            generate(model, ids, kernel=kernel, max_new_tokens=2, stop_ids=(), controllers=runs[name])  # warm
            out = generate(model, ids, kernel=kernel, max_new_tokens=args.steps + 1, stop_ids=(),
                           controllers=runs[name])
            walls = [s.wall_s for s in out.steps]  # (from the first token on: the prefill is not a step)
            times[name].append((walls[-1] - walls[0]) / (len(walls) - 1))
    step = {name: statistics.median(v) for name, v in times.items()}
    ratio = step["barrier"] / step["unfiltered"]
    print(f"n = {args.n}, k = {args.k}: unfiltered step {step['unfiltered'] * 1e3:.1f} ms, with the hidden-state "
          f"barrier {step['barrier'] * 1e3:.1f} ms: {ratio:.2f}x (a re-prefill would run k·(n+1) = "
          f"{args.k * (args.n + 1)} rows per step)")
    print(json.dumps({"n": args.n, "k": args.k, "unfiltered_ms": step["unfiltered"] * 1e3,
                      "barrier_ms": step["barrier"] * 1e3, "ratio": ratio}))


if __name__ == "__main__":
    main()
