"""The real-model bench: hybridlm beside llama.cpp on the same GGUF file and the same threads.

Each side runs in its own process (`side.py`), so each peak resident memory (getrusage's maxrss,
what `/usr/bin/time` reports) is that side's alone, load included. Rounds alternate which side goes
first; a figure is the median over rounds, and a ratio the median of the per-round ratios, with the
machine's load average beside each round (other work on the machine moves both sides alike within a
round). The work, per side and round: greedy decode of `new_tokens` after a `prompt_tokens` prompt,
a prefill of `prefill_tokens`, and the time per token of a decode step at each context length. The
token ids are the bench's English text in the file's own vocabulary (llama.cpp's tokenizer of it),
the same ids for both sides.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from hybridlm.bench.run import TEXT

SIDES = ("hybridlm", "llama.cpp")


def work_ids(path: Path, n: int) -> list[int]:
    """n token ids of the bench's text in the file's vocabulary (its text repeated as needed)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    ids = vocab.tokenize(TEXT.encode(), add_bos=False, special=False)
    while len(ids) < n:
        ids += vocab.tokenize((" " + TEXT).encode(), add_bos=False, special=False)
    return ids[:n]


def run_side(side: str, path: Path, threads: int, work: dict) -> dict:
    """One side's figures from its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("side.py")), side, str(path), str(threads),
                          json.dumps(work)], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"the {side} side on {path.name} failed: {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def real_bench(names: list[str], *, threads: int = 2, rounds: int = 3, new_tokens: int = 256, prompt_tokens: int = 64,
               prefill_tokens: int = 512, contexts: tuple[int, ...] = (64, 1024), steps: int = 16,
               log: Callable[[str], None] = print) -> dict:
    """The four figures (decode, prefill, latency per token at each context, peak RSS) of each real
    model (registry names or GGUF paths) for both sides, and hybridlm's ratios to llama.cpp."""
    from hybridlm.weights.loading import _gguf_file

    report: dict = {"threads": threads, "rounds": rounds, "models": {}}
    for name in names:
        path = _gguf_file(name)
        if path is None:
            raise ValueError(f"model {name!r}: expected a registry name of a GGUF file or a .gguf path")
        ids = work_ids(path, max(prefill_tokens, *contexts, prompt_tokens))
        work = {"prompt": ids[:prompt_tokens], "new_tokens": new_tokens, "prefill": ids[:prefill_tokens],
                "contexts": {str(n): ids[:n] for n in contexts}, "steps": steps}
        runs: list[dict] = []
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            load = os.getloadavg()[0]
            got = {side: run_side(side, path, threads, work) for side in order}
            runs.append({"load_average": load, **got})
            log(f"{path.name} round {r + 1}/{rounds} (load average {load:.2f}): "
                + "; ".join(f"{s} decode {got[s]['decode_tok_s']:.1f} tok/s, prefill {got[s]['prefill_tok_s']:.1f} "
                            f"tok/s, RSS {got[s]['peak_rss_mb']:.0f} MB" for s in SIDES))
        report["models"][path.name] = summary = _summary(runs, contexts)
        summary["rounds"] = runs
        _print(path.name, summary, log)
    return report


def _latency_ms(context: int, side: dict) -> float:
    return 1e3 * side["latency_s"][str(context)]


def _summary(runs: list[dict], contexts) -> dict:
    figures: dict[str, Callable[[dict], float]] = {
        "decode tok/s": lambda f: f["decode_tok_s"], "prefill tok/s": lambda f: f["prefill_tok_s"],
        **{f"latency@{n} ms/token": partial(_latency_ms, n) for n in contexts},
        "peak RSS MB": lambda f: f["peak_rss_mb"]}
    out: dict = {"names": {s: runs[0][s]["name"] for s in SIDES}, "figures": {}}
    for label, get in figures.items():
        values = {s: [get(run[s]) for run in runs] for s in SIDES}
        ratio = statistics.median(a / b for a, b in zip(values["hybridlm"], values["llama.cpp"]))
        out["figures"][label] = {**{s: statistics.median(v) for s, v in values.items()}, "ratio": ratio}
    out["same_tokens"] = all(run["hybridlm"]["tokens"] == run["llama.cpp"]["tokens"] for run in runs)
    out["load_average"] = [run["load_average"] for run in runs]
    return out


def _print(name: str, summary: dict, log) -> None:
    log(f"[real model: {name}] {summary['names']['hybridlm']} against {summary['names']['llama.cpp']} "
        f"(load averages {', '.join(f'{x:.2f}' for x in summary['load_average'])})")
    for label, f in summary["figures"].items():
        log(f"  {label:<22} hybridlm {f['hybridlm']:10.2f}   llama.cpp {f['llama.cpp']:10.2f}   ratio {f['ratio']:.2f}×")
    log(f"  greedy tokens identical to llama.cpp's: {summary['same_tokens']}")
