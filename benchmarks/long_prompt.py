"""A prompt far beyond the context horizon T under both context policies (issue: hostile input).

The prompt (130,000 characters by default) is cut to the last T − δ tokens (block policy) or
T tokens (exact policy); the exact policy then rebuilds the state from Π_T(s ∘ w) at every
step (a prefill of T tokens), the block policy once every δ steps. Prints the prefill time
and the time per token step of each.

    python benchmarks/long_prompt.py [--chars 130000] [--new 64] [--exact-steps 3]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from hybridlm import Kernel, generate, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chars", type=int, default=130_000)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--exact-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model()
    rng = random.Random(0)
    words = "the hybrid system flows in its flow set and jumps in its jump set while the clock runs".split()
    text = " ".join(rng.choice(words) for _ in range(args.chars // 3))[: args.chars]
    ids = model.tokenizer.encode(text)
    report = {"chars": len(text), "prompt_tokens": len(ids), "T": model.config.n_ctx}
    for policy, n in (("block", args.new), ("exact", args.exact_steps)):
        out = generate(model, ids, kernel=Kernel(greedy=True), max_new_tokens=n, stop_ids=(), context=policy)
        walls = [s.wall_s for s in out.steps]
        per_step = (walls[-1] - walls[0]) / (len(walls) - 1) if len(walls) > 1 else None
        report[policy] = {"steps": len(out.steps), "first_token_s": round(walls[0], 2),
                          "per_step_s": round(per_step, 4), "rebuilds": sum(s.rebuilt for s in out.steps),
                          "context_events": len(out.arc.of("context"))}
        print(f"{policy}: {len(out.steps)} steps; first token after {walls[0]:.1f} s (the prefill); "
              f"then {per_step:.3f} s per step; {report[policy]['rebuilds']} rebuilds")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
