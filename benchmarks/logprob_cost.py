"""The cost of recording log p_θ(w | s) at τ = 1 per token step, interleaved in one process.

Round r: 32 greedy token steps of the default model with the engine's recording as it is (`after`), and
32 with it stubbed to the kernel's value only (`before`, what a greedy step recorded earlier), in
alternating order; the ratio per round is after/before seconds per step. Also: the recording alone
(one logsumexp over the vocabulary and a gather) against the step time."""
import statistics
import sys
import time

import torch

import hybridlm
from hybridlm.engine import engine as E

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
model = hybridlm.load_model()
ids = model.tokenizer.encode("The hybrid system flows along the token clock and jumps when a tool is called. " * 8)[:64]
real = E._logprobs


def before(z, w, kernel_logprob, k):
    return {"kernel_logprob": round(kernel_logprob, 6)}


def per_step(n=32):
    t0 = time.perf_counter()
    list(hybridlm.token_clock(model, ids, kernel=hybridlm.Kernel(greedy=True), max_new_tokens=n, stop_ids=()))
    return (time.perf_counter() - t0) / n


per_step(8)  # warm
ratios, steps = [], []
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
    order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
    got = {}
    for name in order:
        E._logprobs = before if name == "before" else real
        got[name] = per_step()
    E._logprobs = real
    ratios.append(got["after"] / got["before"])
    steps.append(got["before"])
z = torch.randn(1, model.config.vocab_size)
real(z, 5, 0.0, None)
t0 = time.perf_counter()
for _ in range(2000):
    real(z, 5, 0.0, None)
alone = (time.perf_counter() - t0) / 2000
print(f"per round after/before: {', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}")
print(f"step (before) median {statistics.median(steps) * 1e3:.1f} ms; the recording alone {alone * 1e6:.1f} µs "
      f"(V = {model.config.vocab_size}): {alone / statistics.median(steps):.2%} of a step")
