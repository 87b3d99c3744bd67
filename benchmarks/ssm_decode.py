"""Per-token decode latency against context length: selective SSM vs transformer of the same width.

The SSM's state c(k, ·) has a fixed size (the survey's (S17), docs/theory.md §5.4), so a decode step costs the
same at any context length n; the transformer's KV state grows with n and each step
attends over all of it (docs/theory.md §3). Both models are random, GPT-2's alphabet, the same
d and L (the transformer is GPT-2's shape with a horizon long enough for the largest
context). For each context n the state is prefilled with n random tokens, then `--steps`
tokens are appended one at a time with F; the latency is the median over repeats of the
mean time per step. Prints a table with the ratios to the smallest context; `--out` writes JSON.

    python benchmarks/ssm_decode.py [--size small] [--contexts 64 1024] [--steps 16] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def models(size: str, horizon: int):
    from hybridlm.lm.config import ModelConfig
    from hybridlm.weights.loading import random_model
    from hybridlm.ssm import preset, random_stack

    ssm = random_stack(preset("ssm", size, n_ctx=horizon))
    c = ssm.config
    transformer = random_model(ModelConfig(d_model=c.d_model, n_layer=c.n_layer, n_head=c.n_head, n_ctx=horizon))
    return {"selective SSM": ssm.eval(), "transformer": transformer.eval()}


@torch.no_grad()
def per_token_s(model, n: int, steps: int, seed: int, prefill_block: int = 128) -> tuple[float, int]:
    """Mean seconds per decode step after a context of n tokens, and the state's bytes there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, n + steps), generator=g)
    x = model.init_state(ids[:, :min(n, prefill_block)], capacity=n + steps)
    for start in range(prefill_block, n, prefill_block):  # prefill in blocks: F continues the state exactly
        model.F(x, ids[:, start:min(n, start + prefill_block)])
    nbytes = x.nbytes()
    t0 = time.perf_counter()
    for i in range(n, n + steps):
        model.F(x, ids[:, i])
    return (time.perf_counter() - t0) / steps, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="tiny | mini | small (small: GPT-2 small's d = 768, L = 12)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = sorted(args.contexts)
    contenders = models(args.size, contexts[-1] + args.steps)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in contexts} for name in contenders}
    state_bytes: dict[tuple[str, int], int] = {}
    for r in range(args.repeats):  # interleaved, so machine noise hits every contender alike
        for name, model in contenders.items():
            for n in contexts:
                seconds, state_bytes[name, n] = per_token_s(model, n, args.steps, seed=r)
                times[name][n].append(seconds)
    rows = []
    for name, per_n in times.items():
        base = statistics.median(per_n[contexts[0]])
        for n in contexts:
            med = statistics.median(per_n[n])
            rows.append({"model": name, "context": n, "ms_per_token": med * 1e3,
                         "ratio": med / base, "state_bytes": state_bytes[name, n]})
    print(f"{'model':<15} {'context':>8} {'ms/token':>9} {f'ratio to n={contexts[0]}':>16} {'state MiB':>10}")
    for row in rows:
        print(f"{row['model']:<15} {row['context']:>8} {row['ms_per_token']:>9.2f} {row['ratio']:>16.2f} "
              f"{row['state_bytes'] / 2**20:>10.2f}")
    if args.out:
        cfg = contenders["selective SSM"].config
        with open(args.out, "w") as fh:
            json.dump({"size": args.size, "d_model": cfg.d_model, "n_layer": cfg.n_layer, "d_state": cfg.d_state,
                       "steps": args.steps, "repeats": args.repeats, "threads": args.threads, "rows": rows,
                       "versions": {"python": platform.python_version(), "torch": torch.__version__}},
                      fh, indent=2)


if __name__ == "__main__":
    main()
