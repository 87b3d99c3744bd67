"""B independent runs of the token-clock recursion in one batch.

Each sequence b follows its own recursion, w^b_{t+1} ~ p_θ(· | s^b_t) with its own seed, and
stops on its own (stop token or budget); the batch shares each weight read across the B
sequences, which is where the throughput comes from: a decode step reads the weights
once for all of them. Sequence b draws from `torch.Generator().manual_seed(seeds[b])`
exactly as `token_clock(..., seed=seeds[b])` would, so a batched run reproduces the
unbatched runs token for token (the logits agree to float32 round-off).

The KV state holds one length n for the whole batch, so prompts are grouped by length and
each group runs as one batch; a sequence that stops leaves its batch (`KVState.select`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from hybridlm.errors import InputError
from hybridlm.engine.sampling import Kernel
from hybridlm.lm.linear import step_products
from hybridlm.lm.model import DecoderLM
from hybridlm.engine.clock import Generation, TokenStep, _default_stops


def generate_batch(
    model: DecoderLM,
    prompts: Sequence[Sequence[int]],
    *,
    kernel: Kernel = Kernel(),
    max_new_tokens: int = 64,
    seeds: Sequence[int] | None = None,
    stop_ids: Iterable[int] | None = None,
) -> list[Generation]:
    """One `Generation` per prompt, in the order given."""
    if not prompts:
        raise InputError("no prompts: give at least one sequence of token ids")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens}: expected ≥ 0")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise InputError(f"{len(seeds)} seeds for {len(prompts)} prompts: expected one seed per prompt")
    stop = set(stop_ids if stop_ids is not None else _default_stops(model))
    runs = [Generation(prompt_ids=[int(i) for i in p]) for p in prompts]
    groups: dict[int, list[int]] = defaultdict(list)
    for b, run in enumerate(runs):
        if not run.prompt_ids:
            raise InputError(f"prompt {b} is empty: every sequence needs at least one token")
        groups[len(run.prompt_ids)].append(b)
    for members in groups.values():
        _run_group(model, runs, members, kernel, max_new_tokens, seeds, stop)
    return runs


@torch.no_grad()
def _run_group(model, runs, members, kernel, max_new_tokens, seeds, stop) -> None:
    start = time.perf_counter()
    x = model.init_state(torch.tensor([runs[b].prompt_ids for b in members]))
    device = x.device
    generators = [torch.Generator(device=device).manual_seed(seeds[b]) for b in members]
    active = list(members)  # row r of the state is sequence active[r]
    for t in range(1, max_new_tokens + 1):
        if not active:
            return
        with step_products(model, x.batch):
            z = model.G(x)
            draws = [kernel.sample_with_logprob(z[r : r + 1], generators[r]) for r in range(len(active))]
            w = torch.cat([d[0] for d in draws])
            rebuilds = x.rebuilds
            model.F(x, w)
        wall = time.perf_counter() - start
        keep = []
        for r, b in enumerate(active):
            token = int(w[r])
            is_stop = token in stop
            runs[b].steps.append(TokenStep(t=t, token=token, logprob=float(draws[r][1][0]), n=x.n,
                                           rebuilt=x.rebuilds > rebuilds, stop=is_stop, wall_s=wall))
            if is_stop:
                runs[b].stop_reason = "stop_token"
            else:
                keep.append(r)
        if len(keep) < len(active):
            x.select(keep)
            generators = [generators[r] for r in keep]
            active = [active[r] for r in keep]
