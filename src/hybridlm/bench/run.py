"""`hybridlm bench`: hybridlm beside its references, in one process, on the same model and threads.

Sections (each figure a median over interleaved repeats, with min–max, and a ratio to
every reference):

- decode: greedy tokens/s, `new_tokens` new tokens after a `prompt_tokens`-token prompt;
- prefill: tokens/s of a `prefill_tokens`-token prompt entering an empty state
  (`prefill_rounds` rounds at least);
- latency: seconds per decode step at context lengths `contexts` (the state makes a step
  O(n) attention, not a recompute), every context and contender in one shuffled round;
- hooks: the decode step and the prefill with hooks off, in a build without hook points
  (`hooks.without_hook_points`), with every residual state recorded, and with every
  activation recorded (attention patterns included), finely interleaved (`_hook_costs`);
- batch: aggregate tokens/s of B independent sequences (`engine.generate_batch`) vs B = 1;
- agreement: teacher-forced greedy agreement of each reduced-precision path with the
  exact one over a text of `agreement_tokens` tokens;
- rates: the hybrid arc's rates table of one greedy generation (`HybridArc.rates`: token steps/s,
  layer steps/s, prefill vs decode, jumps per token step, wall seconds per q_E visit);
- layers (`--per-layer`): wall time of each block in the prefill and per decode step
  (`hybridlm.bench.layers`);
- memory: resident memory added by loading each contender, the process peak, and the
  bytes of the KV state at the largest context.

References: `transformers` on the same float32 weights (for a GGUF model, read by its GGUF
loader; for GPT-2/GPT-Neo, the hub folder) and llama.cpp through `llama_cpp` on the GGUF
file itself. Repeats are interleaved, in a shuffled order each round, so that machine noise
falls on every contender alike.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from hybridlm.bench.layers import arc_rates
from hybridlm.bench.side import llama_side

TEXT = (
    "The river valley was settled by farmers who came from the hills in the spring. They cleared the "
    "forest along the banks, built houses of stone and timber, and dug channels that carried water to "
    "their fields. In dry years the channels were the difference between a harvest and hunger, so the "
    "villages agreed on rules for sharing the water: each field received its turn, measured by the "
    "shadow of a post in the square, and a council of elders settled every dispute. Over the centuries "
    "the villages grew into towns. Merchants arrived with salt, iron and cloth, and the towns sent grain "
    "and wool down the river to the coast. Bridges replaced the fords, mills were built where the current "
    "was strongest, and a road followed the river from the mountains to the sea. The old rules for sharing "
    "water survived all of these changes. When engineers finally built a dam above the first town, they "
    "wrote the rules into the dam's charter, and the council of elders became a board that still meets "
    "every spring, on the same day the first farmers began to plant. Historians who study the valley "
    "often say that its real foundation was not the stone of its houses but the agreement about water."
)


# ---------------------------------------------------------------------- contenders
@dataclass
class Contender:
    """One way of running the model: each callable runs one measured unit of work."""

    name: str
    decode: Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) → generated ids
    prefill: Callable[[list[int]], None]
    step_time: Callable[[list[int], int], float] | None = None  # (context, steps) → s per step
    kv_bytes: Callable[[list[int]], int | None] | None = None
    rss_mb: float = 0.0  # resident memory added by building it
    reference: bool = False


def hybridlm_contender(model, name: str) -> Contender:
    """hybridlm's own paths, hooks off (`_hook_costs` prices the hook modes)."""
    from hybridlm.engine.sampling import Kernel
    from hybridlm.engine.clock import token_clock

    device = model.W_e.device

    def decode(ids, n):
        steps = token_clock(model, ids, kernel=Kernel(greedy=True), max_new_tokens=n, stop_ids=set())
        return [s.token for s in steps]

    def prefill(ids):
        model.init_state(torch.tensor(ids, device=device))
        _sync(device)

    def step_time(ids, steps):
        x = model.init_state(torch.tensor(ids[:-1], device=device), capacity=len(ids) + steps)
        w = torch.tensor([ids[-1]], device=device)
        model.F(x, w)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            model.F(x, w)
        _sync(device)
        return (time.perf_counter() - t0) / steps

    def kv_bytes(ids):
        return model.init_state(torch.tensor(ids, device=device)).nbytes()

    return Contender(name, decode, prefill, step_time, kv_bytes)


def hook_context(model, mode: str):
    """The context of a hook mode: off | stripped (no hook points) | residuals | all (recorded)."""
    from hybridlm.lm.capture import TrajectoryRecorder
    from hybridlm.bench.hookfree import without_hook_points

    if mode == "stripped":
        return without_hook_points(model)
    if mode == "residuals":
        return TrajectoryRecorder(model, lambda n: "resid" in n)
    if mode == "all":
        return TrajectoryRecorder(model)
    return _Null()


def transformers_contender(model, device: str) -> Contender | None:
    """transformers on the same float32 weights; None when it cannot be built here."""
    try:
        ref = _transformers_model(model)
    except ImportError:
        return None
    if ref is None:
        return None
    ref = ref.to(device).eval()

    def decode(ids, n):
        with torch.no_grad():
            x = torch.tensor([ids], device=device)
            out = ref.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    def prefill(ids):
        with torch.no_grad():
            ref(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
        _sync(device)

    def step_time(ids, steps):
        with torch.no_grad():
            out = ref(torch.tensor([ids[:-1]], device=device), use_cache=True, logits_to_keep=1)
            cache, w = out.past_key_values, torch.tensor([[ids[-1]]], device=device)
            out = ref(w, past_key_values=cache, use_cache=True)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = ref(w, past_key_values=out.past_key_values, use_cache=True)
            _sync(device)
            return (time.perf_counter() - t0) / steps

    def kv_bytes(ids):
        with torch.no_grad():
            cache = ref(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1).past_key_values
        return _cache_bytes(cache)

    return Contender("transformers (float32)", decode, prefill, step_time, kv_bytes, reference=True)


def llama_cpp_contender(model, threads: int, n_ctx: int) -> Contender | None:
    """llama.cpp on the GGUF file the model came from (CPU); None without a file or llama_cpp."""
    path = getattr(model, "gguf_path", None)
    if path is None:
        return None
    try:
        _, decode, prefill, step_time = llama_side(str(path), threads, n_ctx)  # (the real-model bench's runner)
    except ImportError:
        return None
    quant = Path(path).stem.split(".")[-1].split("-")[-1]

    def kv_bytes(ids):  # llama.cpp keeps K and V in float16 for each held position
        c = model.config
        return 2 * c.n_layer * c.n_kv_head * c.d_head * len(ids) * 2

    return Contender(f"llama.cpp ({quant})", decode, prefill, step_time, kv_bytes, reference=True)


# ---------------------------------------------------------------------- measuring
Key = TypeVar("Key", bound=Hashable)  # what names a run: a contender, or (contender, context)


@dataclass
class Figure:
    values: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        v = self.values
        return {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v} if v else {}


def interleaved(runs: Mapping[Key, Callable[[], float]], repeats: int, *, shuffle_seed: int | None = None
                ) -> dict[Key, Figure]:
    """Each run returns a figure; one warm-up, then `repeats` rounds over all contenders (in a
    fresh seeded shuffle each round when `shuffle_seed` is given)."""
    order, rng = list(runs), random.Random(shuffle_seed)
    for run in runs.values():
        run()
    figures = {name: Figure() for name in runs}
    for _ in range(repeats):
        if shuffle_seed is not None:
            rng.shuffle(order)
        for name in order:
            figures[name].values.append(runs[name]())
    return figures


def _timed(fn: Callable[[], object], work: int) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return work / (time.perf_counter() - t0)

    return run


# ---------------------------------------------------------------------- the benchmark
@dataclass
class BenchConfig:
    model: str | None = None
    threads: int = 2
    repeats: int = 3
    new_tokens: int = 256
    prompt_tokens: int = 64
    prefill_tokens: int = 512
    contexts: tuple[int, ...] = (64, 256, 1024)
    prefill_rounds: int = 8  # a prefill is short beside this kind of machine's drift: more rounds
    latency_steps: int = 16
    precisions: tuple[str, ...] = ("bfloat16", "int8", "int4")
    batch: int = 8
    batch_new_tokens: int = 64
    agreement_tokens: int = 200
    hook_rounds: int = 100
    hook_steps: int = 4
    hook_prefill_rounds: int = 12
    references: bool = True
    sections: tuple[str, ...] = ("decode", "prefill", "latency", "hooks", "batch", "agreement", "rates")
    all_sections = (*sections, "layers")
    device: str | None = None


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    from hybridlm.lm import kernels
    from hybridlm.weights.loading import load_model
    from hybridlm.lm.quantize import agreement, set_precision
    from hybridlm.memory import configure

    configure()
    torch.set_num_threads(cfg.threads)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rss0 = _rss_mb()
    exact = load_model(cfg.model, device=device, dtype=torch.float32)
    exact_name = "hybridlm (float32)"
    contenders = [hybridlm_contender(exact, exact_name)]
    contenders[0].rss_mb = _rss_mb() - rss0
    tok = exact.tokenizer
    text_ids = _text_ids(tok, exact.config.vocab_size, max(cfg.contexts + (cfg.prefill_tokens, cfg.agreement_tokens)))
    prompt, prefill_ids = text_ids[: cfg.prompt_tokens], text_ids[: cfg.prefill_tokens]

    reduced = {}
    for p in cfg.precisions:
        rss = _rss_mb()
        m = set_precision(load_model(cfg.model, device=device, dtype=torch.float32), p)
        reduced[p] = m
        c = hybridlm_contender(m, f"hybridlm ({p})")
        c.rss_mb = _rss_mb() - rss
        contenders.append(c)
    if device == "cpu" and "bfloat16" in reduced and not _cpu_has_bf16():
        log("note: this CPU has no bfloat16 arithmetic (avx512_bf16 / amx_bf16); the bfloat16 path is emulated "
            "here and slower than float32")
    if device == "cuda" and "bfloat16" not in reduced:
        log("note: on CUDA bfloat16 is the default path; add it with --precisions bfloat16")
    if cfg.references:
        rss = _rss_mb()
        ref = transformers_contender(exact, device)
        if ref is not None:
            ref.rss_mb = _rss_mb() - rss
            contenders.append(ref)
        else:
            log("transformers reference not available for this model: skipped")
        rss = _rss_mb()
        llama = llama_cpp_contender(exact, cfg.threads, n_ctx=max(cfg.contexts + (cfg.prefill_tokens,)) + 64)
        if llama is not None:
            llama.rss_mb = _rss_mb() - rss
            contenders.append(llama)
    log(f"device {device} ({_device_name(device)}), {cfg.threads} threads, torch {torch.__version__}, "
        f"model {exact.source}, {len(contenders)} contenders, {cfg.repeats} repeats")
    kernels_used = kernels.status() if device == "cpu" else None
    if kernels_used:
        log(f"compiled kernels: {kernels_used}")

    report: dict = {
        "device": device, "device_name": _device_name(device), "threads": cfg.threads,
        "kernels": kernels_used,
        "torch": torch.__version__, "python": platform.python_version(), "model": exact.source,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "contenders": {c.name: {"rss_load_mb": round(c.rss_mb, 1), "reference": c.reference} for c in contenders},
    }
    if device == "cuda":
        report["note"] = "on CUDA load_model defaults to bfloat16; the exact path here is float32"

    def section(name: str, unit: str, runs: dict[str, Callable[[], float]], higher_better: bool = True,
                rounds: int | None = None) -> None:
        log(f"[{name}] ...")
        figs = {k: f.as_dict() for k, f in interleaved(runs, rounds or cfg.repeats, shuffle_seed=0).items()}
        report[name] = {"unit": unit, "figures": figs,
                        "ratios": _ratios(figs, contenders, exact_name, higher_better)}
        _print_section(name, unit, report[name], log)

    if "decode" in cfg.sections:
        section("decode", "tokens/s", {c.name: _timed(partial(c.decode, prompt, cfg.new_tokens), cfg.new_tokens)
                                       for c in contenders})
        outputs = {c.name: c.decode(prompt, 32) for c in contenders}
        report["decode"]["same_tokens_as_exact_first_32"] = {k: v == outputs[exact_name] for k, v in outputs.items()}
    if "prefill" in cfg.sections:
        section("prefill", "tokens/s", {c.name: _timed(partial(c.prefill, prefill_ids), len(prefill_ids))
                                        for c in contenders}, rounds=max(cfg.repeats, cfg.prefill_rounds))
    if "latency" in cfg.sections:
        _latency(report, contenders, text_ids, cfg, exact_name, log)
    if "hooks" in cfg.sections:
        report["hooks"] = _hook_costs(exact, prompt, prefill_ids, cfg, log)
    if "batch" in cfg.sections:
        report["batch"] = _batch(exact, text_ids, cfg, log)
    if "agreement" in cfg.sections and reduced:
        ids = text_ids[: cfg.agreement_tokens]
        report["agreement"] = {p: agreement(m, exact, ids) for p, m in reduced.items()}
        for p, a in report["agreement"].items():
            log(f"  agreement {p} vs float32 over {a['positions']} teacher-forced positions: "
                f"{a['agreement'] * 100:.1f}%  (max |Δz| {a['max_abs_logit_diff']:.3g})")
    if "rates" in cfg.sections:
        from hybridlm.engine.arc import format_rates

        report["rates"] = arc_rates(exact, prompt, cfg.new_tokens)
        log(f"[rates] {format_rates(report['rates'])}")
    if "layers" in cfg.sections:
        from hybridlm.bench.layers import format_layer_times, layer_times

        report["layers"] = layer_times(exact, prefill_ids, cfg.new_tokens)
        log("[layers] wall time per block, hybridlm (float32)")
        for line in format_layer_times(report["layers"]):
            log(line)
    big = text_ids[: max(cfg.contexts)]
    report["memory"] = {
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "kv_bytes_at": len(big),
        "kv_bytes": {c.name: c.kv_bytes(big) for c in contenders
                     if c.kv_bytes is not None},
        "rss_load_mb": {c.name: round(c.rss_mb, 1) for c in contenders},
    }
    log(f"[memory] peak RSS {report['memory']['peak_rss_mb']} MB; KV bytes at n={len(big)}: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in report["memory"]["kv_bytes"].items() if v))
    return report


def _latency(report: dict, contenders: list[Contender], text_ids, cfg: BenchConfig, exact_name: str, log) -> None:
    """Seconds per decode step at each context length. Every (contender, context) pair takes
    its turn in one shuffled round, so the growth from the shortest to the longest context,
    the median over rounds of that round's ratio, is not a difference between two stretches
    of a drifting machine."""
    timed = [c for c in contenders if c.step_time is not None]
    runs = {(c.name, n): partial(c.step_time, text_ids[:n], cfg.latency_steps)
            for c in contenders if c.step_time is not None for n in cfg.contexts}
    log(f"[latency] {len(cfg.contexts)} contexts × {len(timed)} contenders, {cfg.latency_steps} steps each, "
        f"{cfg.repeats} shuffled rounds ...")
    figs = interleaved(runs, cfg.repeats, shuffle_seed=1)
    for n in cfg.contexts:
        figures = {c.name: figs[c.name, n].as_dict() for c in timed}
        sec = {"unit": "s/token", "figures": figures,
               "ratios": _ratios(figures, contenders, exact_name, higher_better=False)}
        report[f"latency@{n}"] = sec
        log(f"[latency@{n}]")
        _print_section(f"latency@{n}", "s/token", sec, log)
    lo, hi = min(cfg.contexts), max(cfg.contexts)
    report["latency_growth"] = {
        c.name: statistics.median(a / b for a, b in zip(figs[c.name, hi].values, figs[c.name, lo].values))
        for c in timed}
    log(f"  latency at {hi} / latency at {lo} (median of per-round ratios): "
        + ", ".join(f"{k} {v:.2f}×" for k, v in report["latency_growth"].items()))


def _batch(model, text_ids, cfg: BenchConfig, log) -> dict:
    from hybridlm.engine.clock import generate_batch
    from hybridlm.engine.sampling import Kernel

    prompts = [text_ids[i : i + cfg.prompt_tokens] for i in range(cfg.batch)]
    kernel = Kernel(greedy=True)

    def run(bs: int) -> float:
        t0 = time.perf_counter()
        generate_batch(model, prompts[:bs], kernel=kernel, max_new_tokens=cfg.batch_new_tokens, stop_ids=set())
        return bs * cfg.batch_new_tokens / (time.perf_counter() - t0)

    log(f"[batch] B=1 vs B={cfg.batch}, {cfg.batch_new_tokens} new tokens each ...")
    figs = interleaved({"B=1": lambda: run(1), f"B={cfg.batch}": lambda: run(cfg.batch)}, cfg.repeats)
    figures = {k: f.as_dict() for k, f in figs.items()}
    one, many = figures["B=1"]["median"], figures[f"B={cfg.batch}"]["median"]
    log(f"  B=1 {one:.1f} tok/s, B={cfg.batch} {many:.1f} tok/s: {many / one:.2f}×")
    return {"unit": "tokens/s (aggregate)", "figures": figures, "ratio": many / one}


HOOK_MODES = {"off": "hooks off", "stripped": "no hook points", "residuals": "all residual states",
              "all": "every activation"}


def _hook_costs(model, prompt, prefill_ids, cfg: BenchConfig, log) -> dict:
    """The price of observability on the exact path, as time ratios between hook modes.

    A 5 % difference is smaller than this kind of machine's drift (bandwidth shared with
    other tenants moves a decode step by ±20 % within seconds), so the modes take turns
    finely instead: one KV state, continued by every mode in a shuffled order, a block of
    `hook_steps` decode steps each, `hook_rounds` rounds (the state is reset to the prompt
    before it fills); prefills take turns the same way, `hook_prefill_rounds` rounds. A
    ratio is the median over rounds of that round's ratio, so drift slower than a round
    cancels.
    """
    device = model.W_e.device
    log(f"[hooks] {cfg.hook_rounds} rounds of {cfg.hook_steps} decode steps, and {cfg.hook_prefill_rounds} of one "
        f"{len(prefill_ids)}-token prefill, per mode, in shuffled order ...")
    capacity = len(prompt) + 256
    start = model.init_state(torch.tensor(prompt, device=device), capacity=capacity)
    w = torch.tensor([prompt[-1]], device=device)
    state = [start.clone()]

    def decode_block(mode: str) -> float:
        if state[0].n + cfg.hook_steps > capacity:
            state[0] = start.clone()
        x = state[0]
        with hook_context(model, mode):
            t0 = time.perf_counter()
            for _ in range(cfg.hook_steps):
                model.F(x, w)
            _sync(device)
            return (time.perf_counter() - t0) / cfg.hook_steps

    def prefill(mode: str) -> float:
        ids = torch.tensor(prefill_ids, device=device)
        with hook_context(model, mode):
            t0 = time.perf_counter()
            model.init_state(ids)
            _sync(device)
            return time.perf_counter() - t0

    pairs = {"hooks off / no hook points": ("off", "stripped"),
             "all residual states / hooks off": ("residuals", "off"),
             "every activation / hooks off": ("all", "off")}
    out: dict = {"modes": HOOK_MODES, "decode_rounds": cfg.hook_rounds, "decode_steps_per_round": cfg.hook_steps,
                 "prefill_rounds": cfg.hook_prefill_rounds}
    for name, run, rounds, unit in (("decode", decode_block, cfg.hook_rounds, "s/token"),
                                    ("prefill", prefill, cfg.hook_prefill_rounds, "s")):
        times = interleaved({m: partial(run, m) for m in HOOK_MODES}, rounds, shuffle_seed=0)
        out[name] = {"unit": unit, "figures": {HOOK_MODES[m]: f.as_dict() for m, f in times.items()}}
        ratios = {label: Figure([x / y for x, y in zip(times[a].values, times[b].values)]).as_dict()
                  for label, (a, b) in pairs.items()}
        out[f"{name} time ratio"] = {k: r["median"] for k, r in ratios.items()}
        out[f"{name} time ratio per round"] = ratios
        log(f"  {name}: " + ", ".join(f"{HOOK_MODES[m]} {f.as_dict()['median'] * 1e3:.2f} ms" for m, f in times.items()))
        log(f"  {name} time ratio: " + ", ".join(f"{k} {r['median']:.3f}× ({r['min']:.2f}–{r['max']:.2f})"
                                                   for k, r in ratios.items()))
    return out


def _ratios(figs: dict, contenders: list[Contender], exact: str, higher_better: bool) -> dict:
    """hybridlm path / reference, as a speed ratio (> 1: hybridlm faster)."""
    out = {}
    for c in contenders:
        if c.name not in figs or c.reference:
            continue
        for r in contenders:
            if r.reference and r.name in figs:
                a, b = figs[c.name]["median"], figs[r.name]["median"]
                out[f"{c.name} / {r.name}"] = a / b if higher_better else b / a
    return out


def _print_section(name: str, unit: str, sec: dict, log) -> None:
    log(f"  {'':<44} {unit:>12}   (min–max)")
    for k, f in sec["figures"].items():
        scale, u = (1e3, "ms") if unit == "s/token" else (1, "")
        log(f"  {k:<44} {f['median'] * scale:>10.2f}{u}   ({f['min'] * scale:.2f}–{f['max'] * scale:.2f})")
    for k, r in sec["ratios"].items():
        log(f"    speed {k}: {r:.2f}×")


# ---------------------------------------------------------------------- helpers
class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _text_ids(tok, vocab_size: int, n: int) -> list[int]:
    """n token ids of English text (repeated as needed), or seeded random ids without a tokenizer."""
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()
    ids = tok.encode(TEXT)
    while len(ids) < n:
        ids = ids + tok.encode(" " + TEXT)
    return ids[:n]


def _transformers_model(model):
    """transformers' model of the same weights: from the GGUF file, or through a hub folder."""
    from transformers import AutoModelForCausalLM

    path = getattr(model, "gguf_path", None)
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(Path(path).parent, gguf_file=Path(path).name,
                                                    torch_dtype=torch.float32)
    if model.config.family not in ("gpt2", "gpt-neo"):
        return None
    from hybridlm.weights.hub import save_hub_folder

    with tempfile.TemporaryDirectory() as folder:
        save_hub_folder(model, folder)
        return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)


def _cache_bytes(cache) -> int | None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None)
    try:
        return sum(t.nbytes for pair in cache for t in pair)
    except TypeError:
        return None


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _cpu_has_bf16() -> bool:
    from hybridlm.lm.cpu import cpuinfo

    flags = cpuinfo("flags")
    return flags is None or "avx512_bf16" in flags.split() or "amx_bf16" in flags.split()  # unknown: say nothing


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def write_report(report: dict, out: str | Path) -> None:
    Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `hybridlm bench` or `python benchmarks/bench.py`")
