"""The token-clock recursion (docs/theory.md §2–§3), as a client of the engine.

    w_{t+1} ~ p_θ(· | s_t),    s_{t+1} = Π_T(s_t ∘ w_{t+1})

an uncontrolled discrete-time stochastic difference equation, run on the KV state:
x_{t+1} = F(x_t, w_{t+1}), z_t = G(x_t). `token_clock` streams one `TokenStep` per tick and
stops at a stop token (end-of-text, end-of-turn), at the end of its constraint, or at the
token budget; `generate` collects them; `generate_batch` runs many sequences in one batch.

With `controllers` (hybridlm.control) the recursion gets inputs (logit inputs and masks on
the kernel, residual inputs on the state, a soft prefix on the context) and each TokenStep
records what they did; with `constraint` (hybridlm.engine.constraint) its mask is the
kernel's hard input. Without them the system is the uncontrolled one.

All three are clients of one `Engine`: a sequence with seed s draws from its own generator,
`torch.Generator().manual_seed(s)`, so it makes the same tokens alone, in a batch, or beside
agents in any mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from hybridlm.engine.arc import HybridArc, Termination, token_logprobs
from hybridlm.engine.engine import Engine
from hybridlm.engine.inputs import ControlLoop
from hybridlm.engine.prefill import ContextPolicy
from hybridlm.engine.sampling import Kernel
from hybridlm.engine.sequence import ArcState, Limits
from hybridlm.engine.system import Generation as GenerationSystem
from hybridlm.errors import InputError


@dataclass(frozen=True)
class TokenStep:
    """One tick of the token clock."""

    t: int  # token step (1 for the first generated token)
    token: int  # w_t
    logprob: float | None  # log p_θ(w_t | s_{t−1}) of the model at τ = 1, before any input
    kernel_logprob: float | None  # log p(w_t | s_{t−1}) under the kernel that drew w_t (0 for greedy)
    n: int  # |s_t|, the context length after the step
    rebuilt: bool  # the context horizon forced a rebuild of the state at this step
    stop: bool  # w_t is a stop token
    wall_s: float  # wall time since the sequence joined the engine
    control: tuple = ()  # what the controllers did at this step (dicts), when any acted


@dataclass
class Generation:
    """The outcome of a run of the recursion."""

    prompt_ids: list[int]
    steps: list[TokenStep] = field(default_factory=list)
    stop_reason: str = Termination.TOKEN_BUDGET.value
    arc: HybridArc | None = None

    @property
    def generated_ids(self) -> list[int]:
        return [s.token for s in self.steps]

    @property
    def token_steps(self) -> int:
        return len(self.steps)


def sequence(model, prompt_ids, *, kernel: Kernel = Kernel(), max_new_tokens: int = 64, seed: int = 0,
             stop_ids: Iterable[int] | None = None, controllers=None, constraint=None, stop: Sequence[str] = (),
             observers=(), name: str = "") -> ArcState:
    """A plain-generation sequence, ready to join an engine."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens!r}: expected an integer ≥ 0")
    prompt = _ids(prompt_ids)
    stops = frozenset(stop_ids if stop_ids is not None else default_stops(model))
    controls = ControlLoop(model, controllers, kernel=kernel, stop_ids=stops) if controllers else None
    return ArcState(GenerationSystem(tuple(stop), getattr(model, "tokenizer", None)), prompt, kernel=kernel,
                    seed=seed, limits=Limits(max_token_steps=max_new_tokens, max_jumps=0), constraint=constraint,
                    controls=controls, stop_ids=stops, observers=list(observers), name=name)


def token_clock(model, prompt_ids: Iterable[int] | torch.Tensor, *, kernel: Kernel = Kernel(),
                max_new_tokens: int = 64, seed: int = 0, stop_ids: Iterable[int] | None = None, state=None,
                controllers=None, constraint=None, context: ContextPolicy | str = ContextPolicy()
                ) -> Iterator[TokenStep]:
    """Run the recursion from s_0 = prompt_ids, yielding each TokenStep as it is made.

    With `state` (already holding the prompt) the prefill is skipped; the state is updated in
    place and on return holds s_t including the last token. The stop token, if reached, is
    yielded (with stop=True) and ends the run. `controllers` close the loop (see
    `hybridlm.control`); `constraint` restricts the tokens (see `hybridlm.constraints`).
    """
    s = sequence(model, prompt_ids, kernel=kernel, max_new_tokens=max_new_tokens, seed=seed, stop_ids=stop_ids,
                 controllers=controllers, constraint=constraint)
    yield from stream(model, s, state=state, context=context)


def stream(model, s: ArcState, *, state=None, context: ContextPolicy | str = ContextPolicy()) -> Iterator[TokenStep]:
    """Step an engine holding the one sequence s, streaming its TokenSteps; its error is raised.
    (`s.arc` holds the whole arc afterwards, its termination cause included.)"""
    if state is not None:
        if s.controls is not None and s.controls.prefix is not None:
            raise InputError("a soft prefix enters at the prefill: pass the prompt, not a prefilled state")
        s.x = state
    engine = Engine(model, context=context)
    engine.add(s)
    seen = 0
    try:
        while not s.done:
            engine.step()
            events, seen = s.arc.events[seen:], len(s.arc.events)
            yield from steps_of(events)
    finally:
        engine.close()
    if s.error is not None:
        raise s.error


def steps_of(events) -> Iterator[TokenStep]:
    """The TokenSteps of a run of events (each with the control events of its token step)."""
    control: list[dict] = []
    for e in events:
        if e.kind == "control":
            control.append(dict(e.data))
        elif e.kind == "token":
            logprob, kernel_logprob = token_logprobs(e)
            yield TokenStep(t=e.t, token=e["token"], logprob=logprob, kernel_logprob=kernel_logprob, n=e.get("n"),
                            rebuilt=e.get("rebuilt", False), stop=e.get("stop", False), wall_s=e.wall_s,
                            control=tuple(control))
            control = []


def generate(model, prompt_ids, *, state=None, context: ContextPolicy | str = ContextPolicy(), **kwargs) -> Generation:
    """Run the recursion to its end and collect the steps (the arguments of `token_clock`)."""
    s = sequence(model, prompt_ids, **kwargs)
    steps = list(stream(model, s, state=state, context=context))
    return Generation(prompt_ids=list(s.prompt), steps=steps, stop_reason=_cause(s), arc=s.arc)


def generate_batch(model, prompts: Sequence[Sequence[int]], *, kernel: Kernel = Kernel(), max_new_tokens: int = 64,
                   seeds: Sequence[int] | None = None, stop_ids: Iterable[int] | None = None,
                   max_batch: int = 64, context: ContextPolicy | str = ContextPolicy()) -> list[Generation]:
    """B independent runs of the recursion in one batch, one `Generation` per prompt in order.

    Sequence b draws from its own generator seeded with seeds[b] (default b), so it reproduces
    `generate(..., seed=seeds[b])` token for token; prompts of any lengths share the batch.
    """
    if not prompts:
        raise InputError("no prompts: give at least one sequence of token ids")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise InputError(f"{len(seeds)} seeds for {len(prompts)} prompts: expected one seed per prompt")
    for b, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {b} is empty: every sequence needs at least one token")
    seqs = [sequence(model, p, kernel=kernel, max_new_tokens=max_new_tokens, seed=seed, stop_ids=stop_ids)
            for p, seed in zip(prompts, seeds)]
    Engine(model, max_batch=max_batch, context=context).solve(seqs)
    return [Generation(prompt_ids=list(s.prompt), steps=list(steps_of(s.arc.events)),
                       stop_reason=_cause(s), arc=s.arc) for s in seqs]


def _cause(s: ArcState) -> str:
    """The termination cause of an arc that has ended."""
    if s.arc.termination is None:
        raise RuntimeError(f"the arc of {s.name} has not ended")
    return s.arc.termination.value


def default_stops(model) -> set[int]:
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        return tok.stop_ids()
    eos = model.config.eos_token_id
    return set() if eos is None else {eos}


def _ids(prompt_ids) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.is_floating_point():
            raise InputError(f"token ids must be integers, got a {prompt_ids.dtype} tensor")
        prompt_ids = prompt_ids.reshape(-1).tolist()
    out = []
    for i in prompt_ids:
        if isinstance(i, bool) or not isinstance(i, (int, torch.Tensor)) and not hasattr(i, "__index__"):
            raise InputError(f"token id {i!r}: expected an integer")
        out.append(int(i))
    return out
