"""Decode speed of the working tree beside an earlier commit, interleaved in time.

Each round runs one short process per version (the commit checked out into a temporary work
tree, the working tree itself), shuffled, each loading the default model and timing greedy
decoding of `--new` tokens after a `--prompt`-token prompt on `--threads` threads, float32
and int4. The ratio per round is this tree's tokens/s over the commit's; the report is the
median over rounds (the machine's drift between minutes cancels within a round).

    python benchmarks/before_after.py --ref HEAD~5 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys, time, torch
try:
    from hybridlm.memory import configure
    configure()
except ImportError:
    pass
import hybridlm
try:
    from hybridlm.lm.quantize import set_precision
except ImportError:
    from hybridlm.quantize import set_precision
threads, prompt_len, new, precision = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
model = hybridlm.load_model()
if precision != "float32":
    model = set_precision(model, precision)
text = "The hybrid system flows along the token clock and jumps when a tool is called. " * 40
ids = model.tokenizer.encode(text)[:prompt_len]
kernel = hybridlm.Kernel(greedy=True)
list(hybridlm.token_clock(model, ids, kernel=kernel, max_new_tokens=8, stop_ids=()))  # warm
t0 = time.perf_counter()
steps = list(hybridlm.token_clock(model, ids, kernel=kernel, max_new_tokens=new, stop_ids=()))
dt = time.perf_counter() - t0
print(json.dumps({"tok_s": len(steps) / dt, "tokens": [s.token for s in steps]}))
"""


def run(src: Path, args, precision: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(args.threads), str(args.prompt), str(args.new), precision],
                         env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise SystemExit(f"{src}: {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="the earlier commit")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--precisions", default="float32,int4")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "ref"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.ref], check=True,
                       capture_output=True)
        try:
            versions = {"ref": old / "src", "tree": ROOT / "src"}
            report = {}
            for precision in args.precisions.split(","):
                rates = {name: [] for name in versions}
                same = True
                for _ in range(args.rounds):
                    order = list(versions)
                    random.shuffle(order)
                    got = {name: run(versions[name], args, precision) for name in order}
                    for name in versions:
                        rates[name].append(got[name]["tok_s"])
                    same &= got["ref"]["tokens"] == got["tree"]["tokens"]
                ratios = [t / r for t, r in zip(rates["tree"], rates["ref"])]
                report[precision] = {"ref_tok_s": statistics.median(rates["ref"]),
                                     "tree_tok_s": statistics.median(rates["tree"]),
                                     "ratio_median": statistics.median(ratios), "ratios": ratios,
                                     "same_greedy_tokens": same}
                r = report[precision]
                print(f"{precision}: {args.ref} {r['ref_tok_s']:.2f} tok/s, tree {r['tree_tok_s']:.2f} tok/s, "
                      f"tree/ref {r['ratio_median']:.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)}); "
                      f"greedy tokens {'identical' if same else 'differ'}")
            print(json.dumps(report))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)


if __name__ == "__main__":
    main()
