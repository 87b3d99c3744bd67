"""One side of the real-model bench (`hybridlm.bench.real`), run as its own process so that its peak
resident memory is its own: `python side.py SIDE FILE THREADS JSON` with SIDE `hybridlm` or `llama.cpp`
and JSON the work ({"prompt": ids, "new_tokens": n, "prefill": ids, "contexts": {n: ids}, "steps": k});
prints one JSON line of figures. Run by path, not as a module: llama.cpp's side must not import
hybridlm (nor PyTorch), whose memory would count against it."""

from __future__ import annotations

import json
import resource
import sys
import time


def hybridlm_side(path: str, threads: int):
    import torch

    from hybridlm.engine.clock import token_clock
    from hybridlm.engine.sampling import Kernel
    from hybridlm.memory import configure
    from hybridlm.weights.loading import load_model

    configure()
    torch.set_num_threads(threads)
    model = load_model(path, precision="auto")

    def decode(ids, n):
        return [s.token for s in token_clock(model, ids, kernel=Kernel(greedy=True), max_new_tokens=n, stop_ids=set())]

    def prefill(ids):
        model.init_state(torch.tensor(ids))

    def step_time(ids, steps):
        x = model.init_state(torch.tensor(ids[:-1]), capacity=len(ids) + steps)
        w = torch.tensor([ids[-1]])
        model.F(x, w)
        t0 = time.perf_counter()
        for _ in range(steps):
            model.F(x, w)
        return (time.perf_counter() - t0) / steps

    return f"hybridlm ({model.precision})", decode, prefill, step_time


def llama_side(path: str, threads: int, n_ctx: int):
    """llama.cpp on the file: (name, decode, prefill, step_time), the one llama.cpp runner of the
    benches (`hybridlm.bench.run` takes it too). ImportError without llama_cpp."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    def decode(ids, n):
        out = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return out

    def prefill(ids):
        llm.reset()
        llm.eval(ids)

    def step_time(ids, steps):
        llm.reset()
        llm.eval(ids[:-1])
        llm.eval([ids[-1]])
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.eval([ids[-1]])
        return (time.perf_counter() - t0) / steps

    return "llama.cpp", decode, prefill, step_time


def main(side: str, path: str, threads: int, work: dict) -> dict:
    t0 = time.perf_counter()
    longest = max(len(v) for v in work["contexts"].values())
    name, decode, prefill, step_time = (hybridlm_side(path, threads) if side == "hybridlm" else
                                        llama_side(path, threads, max(longest, len(work["prefill"])) + 64))
    load_s = time.perf_counter() - t0
    decode(work["prompt"], 4)  # (warm: the first products fault their pages in)
    t0 = time.perf_counter()
    tokens = decode(work["prompt"], work["new_tokens"])
    decode_s = time.perf_counter() - t0
    prefill(work["prefill"][:64])
    t0 = time.perf_counter()
    prefill(work["prefill"])
    prefill_s = time.perf_counter() - t0
    latency = {n: step_time(ids, work["steps"]) for n, ids in work["contexts"].items()}
    return {"name": name, "load_s": load_s, "decode_tok_s": len(tokens) / decode_s, "tokens": tokens,
            "prefill_tok_s": len(work["prefill"]) / prefill_s, "latency_s": latency,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))))
