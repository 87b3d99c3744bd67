"""The clocks of one generation side by side: the arc's rates table, and wall time per layer.

`arc_rates` runs one greedy generation through the engine and reads its hybrid arc's rates
(`HybridArc.rates`: token steps/s, layer steps/s, prefill vs decode, jumps per token step, wall
seconds per q_E visit). `layer_times` times every block ℓ from its `hook_resid_pre` to its
`hook_resid_post`, split into the prefill and the decode steps. Those two hooks are ordinary
(not `observing`): they must fire while the block runs, so each block takes its own forward with
compiled sublayers instead of joining a compiled run of blocks (hybridlm.lm.step); the same
generation untimed, run beside it, gives what the timing itself costs.
"""

from __future__ import annotations

import time

import torch


def arc_rates(model, prompt_ids: list[int], new_tokens: int) -> dict:
    """The rates table of one greedy generation of `new_tokens` after `prompt_ids`."""
    from hybridlm.engine.clock import generate
    from hybridlm.engine.sampling import Kernel

    g = generate(model, prompt_ids, kernel=Kernel(greedy=True), max_new_tokens=new_tokens, stop_ids=set())
    assert g.arc is not None, "generate records the arc"
    return g.arc.rates(layers=model.config.n_layer)


def layer_times(model, prompt_ids: list[int], new_tokens: int) -> dict:
    """Wall seconds of each block over one greedy generation: `prefill_s[ℓ]` (the prompt's one
    forward) and `decode_s[ℓ]` (summed over the decode steps), with `timed_s` the whole generation
    so timed and `untimed_s` the same generation without the hooks (run first)."""
    from hybridlm.engine.clock import generate
    from hybridlm.engine.sampling import Kernel

    L = model.config.n_layer
    device = model.W_e.device
    prefill, decode = [0.0] * L, [0.0] * L
    started: dict[int, float] = {}
    calls = [0]  # forwards seen: the first is the prefill

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def enter(layer: int):
        def fn(h, hook):
            if layer == 0:
                calls[0] += 1
            sync()
            started[layer] = time.perf_counter()
        return fn

    def leave(layer: int):
        def fn(h, hook):
            sync()
            (prefill if calls[0] == 1 else decode)[layer] += time.perf_counter() - started.pop(layer)
        return fn

    def run() -> float:
        t0 = time.perf_counter()
        generate(model, prompt_ids, kernel=Kernel(greedy=True), max_new_tokens=new_tokens, stop_ids=set())
        sync()
        return time.perf_counter() - t0

    untimed = run()
    hooks = [(f"blocks.{ell}.hook_resid_pre", enter(ell)) for ell in range(L)]
    hooks += [(f"blocks.{ell}.hook_resid_post", leave(ell)) for ell in range(L)]
    with model.hooks(hooks):
        timed = run()
    return {"layers": L, "prompt_tokens": len(prompt_ids), "decode_steps": max(calls[0] - 1, 0),
            "prefill_s": prefill, "decode_s": decode, "timed_s": timed, "untimed_s": untimed}


def format_layer_times(t: dict) -> list[str]:
    """The per-layer table as lines of text: each block's share of the blocks' time, and per decode step."""
    steps = max(t["decode_steps"], 1)
    total_p, total_d = sum(t["prefill_s"]) or 1.0, sum(t["decode_s"]) or 1.0
    lines = [f"  {'layer':>5} {'prefill ms':>11} {'share':>6} {'decode ms/step':>15} {'share':>6}"]
    for ell, (p, d) in enumerate(zip(t["prefill_s"], t["decode_s"])):
        lines.append(f"  {ell:>5} {p * 1e3:>11.2f} {p / total_p:>6.1%} {d / steps * 1e3:>15.3f} {d / total_d:>6.1%}")
    lines.append(f"  blocks: prefill {sum(t['prefill_s']) * 1e3:.1f} ms ({t['prompt_tokens']} tokens), decode "
                 f"{sum(t['decode_s']) / steps * 1e3:.2f} ms/step ({t['decode_steps']} steps); the generation took "
                 f"{t['timed_s']:.2f} s timed per layer, {t['untimed_s']:.2f} s untimed")
    return lines
