"""The token-clock recursion (SPEC.md §2–3, seed 000).

    w_{t+1} ~ p_θ(· | s_t),    s_{t+1} = Π_T(s_t ∘ w_{t+1})

an uncontrolled discrete-time stochastic difference equation, run on the KV state:
x_{t+1} = F(x_t, w_{t+1}), z_t = G(x_t). `token_clock` streams one `TokenStep` per tick
and stops at a stop token (end-of-text, end-of-turn) or at the token budget.

With `controllers` (hybridlm.control) the recursion gets inputs — logit inputs and masks
on the kernel, residual inputs on the state, a soft prefix on the context — and each
TokenStep records what the controllers did. Without them the code path is the
uncontrolled one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from hybridlm.engine.sampling import Kernel
from hybridlm.lm.linear import step_products
from hybridlm.lm.model import DecoderLM
from hybridlm.lm.state import KVState


@dataclass(frozen=True)
class TokenStep:
    """One tick of the token clock."""

    t: int  # token step (1 for the first generated token)
    token: int  # w_t
    logprob: float  # log p_θ(w_t | s_{t−1}) under the shaped kernel (0 for greedy)
    n: int  # |s_t|, the context length after the step
    rebuilt: bool  # Π_T dropped a token and the state was rebuilt
    stop: bool  # w_t is a stop token
    wall_s: float  # wall time since the recursion started
    control: tuple = ()  # what the controllers did at this step (dicts), when any acted


@dataclass
class Generation:
    """The outcome of a run of the recursion."""

    prompt_ids: list[int]
    steps: list[TokenStep] = field(default_factory=list)
    stop_reason: str = "budget"

    @property
    def generated_ids(self) -> list[int]:
        return [s.token for s in self.steps]

    @property
    def token_steps(self) -> int:
        return len(self.steps)


def token_clock(
    model: DecoderLM,
    prompt_ids: Iterable[int] | torch.Tensor,
    *,
    kernel: Kernel = Kernel(),
    max_new_tokens: int = 64,
    seed: int = 0,
    stop_ids: Iterable[int] | None = None,
    state: KVState | None = None,
    controllers=None,
) -> Iterator[TokenStep]:
    """Run the recursion from s_0 = prompt_ids, yielding each TokenStep as it is made.

    With `state` (already holding the prompt) the prefill is skipped; the state is
    updated in place and on return holds s_t including the last token. The stop token,
    if reached, is yielded (with stop=True) and ends the run. `controllers` close the
    loop (see `hybridlm.control`); their residual inputs stay attached while the
    iterator is open.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected ≥ 0")
    stop = set(stop_ids if stop_ids is not None else _default_stops(model))
    if controllers:
        yield from _controlled_clock(model, prompt_ids, kernel, max_new_tokens, seed, stop, state, controllers)
        return
    start = time.perf_counter()
    x = state if state is not None else model.init_state(prompt_ids)
    device = x.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for t in range(1, max_new_tokens + 1):
        with step_products(model, x.batch):  # (not across the yield: the caller's code runs as usual)
            z = model.G(x)
            w, logprob = kernel.sample_with_logprob(z, generator)
            logprob = float(logprob[0])
            token = int(w[0])
            rebuilds = x.rebuilds
            is_stop = token in stop
            model.F(x, w)
        yield TokenStep(
            t=t, token=token, logprob=logprob, n=x.n,
            rebuilt=x.rebuilds > rebuilds, stop=is_stop, wall_s=time.perf_counter() - start,
        )
        if is_stop:
            return


def _controlled_clock(model, prompt_ids, kernel, max_new_tokens, seed, stop, state, controllers):
    """w_{t+1} ~ p_θ,u(· | s_t), x_{t+1} = F_u(x_t, w_{t+1}): the recursion with inputs."""
    from hybridlm.control.loop import ControlLoop

    loop = ControlLoop(model, controllers, kernel=kernel, stop_ids=stop)
    start = time.perf_counter()
    with loop.attached():
        if state is not None and loop.prefix is not None:
            raise ValueError("a soft prefix enters at the prefill: pass the prompt, not a prefilled state")
        x = state if state is not None else loop.prefill(prompt_ids)
        loop.check_horizon(x.n, max_new_tokens)
        ids = x.tokens[0][x.tokens[0] >= 0].tolist() if state is not None else model._check_ids(prompt_ids)[0].tolist()
        loop.start([[int(i) for i in ids]])
        generator = torch.Generator(device=x.device).manual_seed(seed)
        for t in range(1, max_new_tokens + 1):
            z, records = loop.step(t, model.G(x), x)
            w, logprob = kernel.sample_with_logprob(z, generator)
            token, rebuilds = int(w[0]), x.rebuilds
            model.F(x, w)
            loop.advance(w)
            yield TokenStep(
                t=t, token=token, logprob=float(logprob[0]), n=x.n, rebuilt=x.rebuilds > rebuilds,
                stop=token in stop, wall_s=time.perf_counter() - start, control=tuple(r.row(0) for r in records),
            )
            if token in stop:
                return


def generate(model: DecoderLM, prompt_ids, **kwargs) -> Generation:
    """Run `token_clock` to the end and collect the steps."""
    ids = [int(i) for i in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
    out = Generation(prompt_ids=ids)
    for step in token_clock(model, ids, **kwargs):
        out.steps.append(step)
        if step.stop:
            out.stop_reason = "stop_token"
    return out


def _default_stops(model: DecoderLM) -> set[int]:
    tok = model.tokenizer
    if tok is not None:
        return tok.stop_ids()
    eos = model.config.eos_token_id
    return set() if eos is None else {eos}
