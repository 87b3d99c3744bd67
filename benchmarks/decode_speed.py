"""Decode speed of the embedded model: hybridlm against transformers and llama.cpp, in one run.

All three decode greedily from the same prompt with the same thread count; repeats are
interleaved so that machine noise hits every contender alike. hybridlm and transformers
run the same float32 weights (dequantised from the GGUF file); llama.cpp runs the GGUF
file itself (Q4_1). Prints tokens/s (median, min–max) and the ratios.

    python benchmarks/decode_speed.py [--new-tokens 128] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

PROMPT = "The history of the river valley begins with the first farmers who settled along its banks"


def hybridlm_decoder(new_tokens: int):
    from hybridlm import Kernel, load_model, token_clock

    model = load_model()
    ids = model.tokenizer.encode(PROMPT)

    def run() -> list[int]:
        steps = token_clock(model, ids, kernel=Kernel(greedy=True), max_new_tokens=new_tokens, stop_ids=set())
        return [s.token for s in steps]

    return run, ids


def transformers_decoder(new_tokens: int, ids: list[int]):
    from transformers import AutoModelForCausalLM

    from hybridlm.gguf_file import smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    x = torch.tensor([ids])

    def run() -> list[int]:
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
        return out[0, len(ids):].tolist()

    return run


def llama_cpp_decoder(new_tokens: int, ids: list[int], threads: int):
    from llama_cpp import Llama

    from hybridlm.gguf_file import smollm2_path

    llm = Llama(model_path=str(smollm2_path()), n_ctx=512, n_threads=threads, n_batch=512, verbose=False)

    def run() -> list[int]:
        llm.reset()
        out = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == new_tokens:
                break
        return out

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    ours, ids = hybridlm_decoder(args.new_tokens)
    contenders = {"hybridlm (float32)": ours, "transformers (float32)": transformers_decoder(args.new_tokens, ids)}
    try:
        contenders["llama.cpp (Q4_1)"] = llama_cpp_decoder(args.new_tokens, ids, args.threads)
    except ImportError:
        print("llama_cpp not installed: skipping llama.cpp", file=sys.stderr)

    for run in contenders.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, run in contenders.items():
            t0 = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - t0)

    rate = {k: [args.new_tokens / t for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in rate.items()}
    print(f"decode, greedy, {args.new_tokens} new tokens after a {len(ids)}-token prompt, "
          f"{args.threads} threads, {args.repeats} repeats (median, min–max)")
    for k, v in rate.items():
        print(f"  {k:<24} {med[k]:8.1f} tok/s  ({min(v):.1f}–{max(v):.1f})")
    base = med["hybridlm (float32)"]
    for k in med:
        if not k.startswith("hybridlm"):
            print(f"  hybridlm / {k:<24} {base / med[k]:.2f}×")
    same = outputs["hybridlm (float32)"] == outputs["transformers (float32)"]
    print(f"  hybridlm and transformers greedy tokens identical: {same}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"tokens_per_s": rate, "median": med, "threads": args.threads,
                       "new_tokens": args.new_tokens, "identical_to_transformers": same}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
