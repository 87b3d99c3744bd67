"""The sampling kernel against closed forms."""

import math

import pytest
from hypothesis import given, settings, strategies as st
import torch

from hybridlm import Kernel
from hybridlm.errors import InputError

z = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])


def test_temperature_softmax_closed_form():
    for tau in (0.5, 1.0, 3.0):
        p = Kernel(temperature=tau).probs(z)[0]
        expect = torch.tensor([math.exp(v / tau) for v in z[0].tolist()])
        assert torch.allclose(p, expect / expect.sum(), atol=1e-7)


def test_greedy_is_argmax():
    k = Kernel(greedy=True)
    assert k.sample(z).tolist() == [0]
    assert torch.equal(k.probs(z)[0], torch.tensor([1.0, 0, 0, 0, 0]))


def test_top_k_keeps_k_largest():
    p = Kernel(top_k=2).probs(z)[0]
    e = torch.tensor([math.e**2, math.e, 0, 0, 0])
    assert torch.allclose(p, e / e.sum(), atol=1e-7)


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # mass before each token: 0, .5, .8, .95 → p = 0.8 keeps the first two, p = 0.81 the first three
    assert torch.allclose(Kernel(top_p=0.8).probs(logits)[0], torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    kept = Kernel(top_p=0.81).probs(logits)[0]
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)
    assert torch.allclose(Kernel(top_p=1.0).probs(logits), probs, atol=1e-6)


def test_sampling_frequencies_match_kernel():
    k = Kernel(temperature=1.5)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([k.sample(z, g) for _ in range(20000)]).flatten()
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert torch.allclose(freq, k.probs(z)[0], atol=0.015)


def test_same_generator_seed_same_draws():
    k = Kernel()
    a = [int(k.sample(z, torch.Generator().manual_seed(9))) for _ in range(3)]
    b = [int(k.sample(z, torch.Generator().manual_seed(9))) for _ in range(3)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top-k"),
        ({"top_k": 2.0}, "top-k"),
        ({"min_p": -0.1}, "min-p"),
        ({"min_p": 1.5}, "min-p"),
        ({"min_p": float("nan")}, "min p"),
        ({"repeat_penalty": 0.0}, "repeat penalty"),
        ({"repeat_penalty": float("inf")}, "repeat penalty"),
        ({"repeat_last_n": -2}, "repeat last n"),
        ({"repeat_last_n": 1.5}, "repeat last n"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(InputError, match=match):
        Kernel(**kwargs)


def test_a_zero_probability_token_is_never_drawn_and_rows_draw_alone():
    from hybridlm.engine.sampling import draw

    p = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    g = torch.Generator().manual_seed(1)
    draws = torch.cat([draw(p.expand(500, 5), g) for _ in range(40)])
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert freq[0] == freq[2] == freq[4] == 0 and abs(freq[1] - 0.25) < 0.01
    # a row's draw depends on its own generator only: one uniform number per row
    alone = [int(draw(p, torch.Generator().manual_seed(s))) for s in range(20)]
    assert alone == [int(draw(p, torch.Generator().manual_seed(s))) for s in range(20)]
    last = torch.tensor([[0.0, 0.0, 1.0]])
    assert {int(draw(last, g)) for _ in range(100)} == {2}


# ---------------------------------------------------------------------- penalties and logit bias
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"frequency_penalty": float("nan")}, "frequency penalty"),
        ({"presence_penalty": "1"}, "presence penalty"),
        ({"logit_bias": {"x": 1.0}}, "logit bias key 'x'"),
        ({"logit_bias": {"\u00b2": 1.0}}, "logit bias key"),
        ({"logit_bias": {-3: 1.0}}, "logit bias key -3"),
        ({"logit_bias": {5: float("inf")}}, "token 5"),
        ({"logit_bias": [(1, 2, 3)]}, "pair"),
    ],
)
def test_bad_penalties_and_bias(kwargs, match):
    with pytest.raises(InputError, match=match):
        Kernel(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=6, max_size=6),
    counts=st.dictionaries(st.integers(0, 5), st.integers(1, 9), max_size=6),
    bias=st.dictionaries(st.integers(0, 5), st.floats(-100, 100), max_size=6),
    alpha_f=st.floats(-2, 2), alpha_p=st.floats(-2, 2),
)
def test_penalties_and_bias_closed_form(logits, counts, bias, alpha_f, alpha_p):
    """z(v) + b(v) − α_f·c(v) − α_p·1[c(v) > 0], written out token by token (OpenAI's definition)."""
    z = torch.tensor([logits], dtype=torch.float64)
    k = Kernel(frequency_penalty=alpha_f, presence_penalty=alpha_p, logit_bias={str(i): b for i, b in bias.items()})
    got = k.penalised(z, counts)[0].tolist()
    for v, zv in enumerate(logits):
        c = counts.get(v, 0)
        expect = zv + bias.get(v, 0.0) - alpha_f * c - alpha_p * (c > 0)
        assert got[v] == pytest.approx(expect, abs=1e-9)
    assert z[0].tolist() == logits  # the readout itself is not changed


def test_no_penalty_and_no_bias_leave_the_readout_alone():
    assert Kernel().penalised(z, {0: 3}) is z
    assert Kernel(frequency_penalty=1.0).penalised(z, {}) is z


def test_a_bias_beyond_the_vocabulary_is_named():
    with pytest.raises(InputError, match="token 9: expected a token id < 5"):
        Kernel(logit_bias={9: 1.0}).penalised(z, {})


@torch.no_grad()
def test_penalised_greedy_decoding_matches_transformers_written_out(toy_hub, toy_model):
    """Greedy decoding with frequency and presence penalties and a logit bias equals a loop that
    applies OpenAI's definition to transformers' logits, token by token; the inputs change the
    output (so the comparison says something)."""
    from hybridlm.engine.clock import generate

    _, ref = toy_hub
    prompt = [464, 3290, 318, 257, 1332, 13]
    bias = {13: -100.0, 11: 4.0}
    kernel = Kernel(greedy=True, frequency_penalty=0.7, presence_penalty=0.4, logit_bias=bias)

    def reference(alpha_f, alpha_p, b, n):
        ids, counts = list(prompt), {}
        for _ in range(n):
            zl = ref(torch.tensor([ids])).logits[0, -1].double()
            for v, bv in b.items():
                zl[v] += bv
            for v, c in counts.items():
                zl[v] -= alpha_f * c + alpha_p
            w = int(zl.argmax())
            ids.append(w)
            counts[w] = counts.get(w, 0) + 1
        return ids[len(prompt):]

    got = generate(toy_model, prompt, kernel=kernel, max_new_tokens=24, stop_ids=[]).generated_ids
    assert got == reference(0.7, 0.4, bias, 24)
    plain = generate(toy_model, prompt, kernel=Kernel(greedy=True), max_new_tokens=24, stop_ids=[]).generated_ids
    assert plain == reference(0.0, 0.0, {}, 24) and plain != got
    assert 13 not in got


# ---------------------------------------------------------------------- min-p, top-k and the repeat penalty
def _llama_chain(z, kernel: Kernel, window=()):
    """llama.cpp's own samplers (through the llama_cpp binding) on the logits z [V], chained in this kernel's
    order: logit bias, penalties (ρ over the tokens accepted into its window), τ, top-k, top-p, min-p.
    Returns the kept tokens' probabilities as a vector over the vocabulary."""
    import ctypes

    import llama_cpp as L

    V = len(z)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if kernel.logit_bias:
        bias = (L.llama_logit_bias * len(kernel.logit_bias))(*[L.llama_logit_bias(i, b) for i, b in kernel.logit_bias])
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(V, len(kernel.logit_bias), bias))
    last_n = kernel.repeat_last_n if kernel.repeat_last_n != -1 else 1 << 20  # llama.cpp's −1 is n_ctx, set by its caller
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(V, last_n, kernel.repeat_penalty, 0.0, 0.0))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(kernel.temperature))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(kernel.top_k or 0))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(kernel.top_p or 1.0, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(kernel.min_p, 1))
    try:
        for token in window:
            L.llama_sampler_accept(chain, token)
        data = (L.llama_token_data * V)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(z)])
        cur = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=V, selected=-1, sorted=False)
        L.llama_sampler_apply(chain, ctypes.byref(cur))
        kept = {cur.data[i].id: cur.data[i].logit for i in range(cur.size)}
    finally:
        L.llama_sampler_free(chain)
    ids = torch.tensor(sorted(kept))
    logits = torch.tensor([kept[i] for i in sorted(kept)], dtype=torch.float64)
    p = torch.zeros(V, dtype=torch.float64)
    p[ids] = torch.softmax(logits, dim=-1)
    return p


def _our_chain(z, kernel: Kernel, window=()):
    """The kernel's distribution for readout z [V] with `window` as the context (the engine's order)."""
    from collections import deque

    recent = deque(window, maxlen=kernel.repeat_window)  # as the engine keeps it
    return kernel.probs(kernel.penalised(z[None].float(), {}, recent))[0].double()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 300), tau=st.sampled_from([1.0, 0.7, 1.6]),
       top_k=st.integers(0, 40), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 1.0),
       rho=st.floats(0.5, 2.0), last_n=st.sampled_from([0, 1, 8, 64, -1]), n_context=st.integers(0, 120),
       n_bias=st.integers(0, 3))
def test_the_kernel_equals_llama_cpps_samplers_on_the_same_logits(seed, vocab, tau, top_k, top_p, min_p, rho,
                                                                   last_n, n_context, n_bias):
    """Bias, repeat penalty (llama.cpp's rule over its last n accepted tokens), τ, top-k, top-p and min-p against
    llama.cpp's sampler chain built in the same order (at τ = 1 the order of llama.cpp's own default chain): the
    same kept set and the same probabilities. Logits from a continuous law (no ties: llama.cpp's top-k cuts ties
    by its sort, this kernel keeps them)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(vocab, generator=g, dtype=torch.float64).float() * 3
    window = torch.randint(0, vocab, (n_context,), generator=g).tolist()
    bias = {int(i): float(b) for i, b in zip(torch.randint(0, vocab, (n_bias,), generator=g),
                                              torch.randn(n_bias, generator=g) * 4)}
    kernel = Kernel(temperature=tau, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=rho, repeat_last_n=last_n,
                    logit_bias=bias)
    ours, theirs = _our_chain(z, kernel, window), _llama_chain(z.tolist(), kernel, window)
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 300), tau=st.floats(0.2, 3.0),
       top_k=st.integers(0, 40), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 1.0), rho=st.floats(0.5, 2.0),
       n_context=st.integers(0, 60))
def test_the_kernel_equals_transformers_logits_processors(seed, vocab, tau, top_k, top_p, min_p, rho, n_context):
    """vLLM's and transformers' repetition penalty (the same rule over the whole context: repeat_last_n = −1),
    then transformers' warpers in their order: temperature, top-k, top-p, min-p."""
    from transformers import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(vocab, generator=g, dtype=torch.float64).float() * 3
    context = torch.randint(0, vocab, (1, n_context), generator=g)
    kernel = Kernel(temperature=tau, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=rho, repeat_last_n=-1)
    scores = z[None].clone()
    processors = [RepetitionPenaltyLogitsProcessor(rho), TemperatureLogitsWarper(tau)]
    processors += [TopKLogitsWarper(top_k)] if top_k else []
    processors += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    processors += [MinPLogitsWarper(min_p)] if min_p > 0 else []
    for proc in processors:
        scores = proc(context, scores)
    theirs = torch.softmax(scores.double(), dim=-1)[0]
    ours = _our_chain(z, kernel, context[0].tolist())
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-5)


@settings(max_examples=120, deadline=None)
@given(logits=st.lists(st.floats(-30, 30), min_size=1, max_size=12), tau=st.floats(0.1, 5.0),
       m1=st.floats(0.0, 1.0), m2=st.floats(0.0, 1.0), k=st.integers(0, 14), top_p=st.none() | st.floats(0.01, 1.0))
def test_min_p_and_top_k_laws(logits, tau, m1, m2, k, top_p):
    """min-p = 0 and top-k ∈ {0, V} change nothing; the kept set shrinks as min-p grows; the argmax is always
    kept (greedy decoding does not see min-p or top-k); every distribution sums to 1."""
    z = torch.tensor([logits])
    V = len(logits)
    base = Kernel(temperature=tau, top_p=top_p)
    plain = base.probs(z)
    for same in (Kernel(temperature=tau, top_p=top_p, min_p=0.0), Kernel(temperature=tau, top_p=top_p, top_k=0),
                 Kernel(temperature=tau, top_p=top_p, top_k=V)):
        assert torch.equal(same.probs(z), plain)
    lo, hi = sorted((m1, m2))
    kept_lo = Kernel(temperature=tau, top_p=top_p, top_k=k, min_p=lo).probs(z)[0] > 0
    kept_hi = Kernel(temperature=tau, top_p=top_p, top_k=k, min_p=hi).probs(z)[0] > 0
    assert not (kept_hi & ~kept_lo).any()  # a subset
    argmax = int(z[0].argmax())
    for kernel in (Kernel(temperature=tau, top_p=top_p, top_k=k, min_p=m1), Kernel(temperature=tau, min_p=m2)):
        p = kernel.probs(z)[0]
        assert abs(float(p.sum()) - 1) < 1e-5
        assert p[argmax] > 0 and p[argmax] == p.max()
        greedy = Kernel(greedy=True, top_k=k, min_p=m1, top_p=top_p)
        assert int(greedy.sample(z)) == argmax


@settings(max_examples=60, deadline=None)
@given(logits=st.lists(st.floats(-20, 20), min_size=4, max_size=4), rho=st.floats(0.1, 10.0),
       window=st.lists(st.integers(0, 3), max_size=10))
def test_repeat_penalty_closed_form(logits, rho, window):
    """z(v)/ρ where z(v) > 0 and z(v)·ρ elsewhere, for each token of the window once however often it occurs."""
    z = torch.tensor([logits], dtype=torch.float64)
    got = Kernel(repeat_penalty=rho).penalised(z, {}, window)[0].tolist()
    for v, zv in enumerate(logits):
        expect = (zv / rho if zv > 0 else zv * rho) if v in window else zv
        assert got[v] == pytest.approx(expect, rel=1e-12, abs=1e-12)
    assert Kernel(repeat_penalty=1.0).penalised(z, {}, window) is z


def test_the_window_and_the_description():
    assert Kernel().repeat_window == 0  # ρ = 1: nothing is kept
    assert Kernel(repeat_penalty=1.1).repeat_window == 64
    assert Kernel(repeat_penalty=1.1, repeat_last_n=-1).repeat_window is None
    assert Kernel(repeat_penalty=1.1, repeat_last_n=0).repeat_window == 0
    assert Kernel(top_k=0).top_k is None
    assert Kernel(temperature=0.8, top_k=40, min_p=0.05, repeat_penalty=1.1).describe() == \
        "τ=0.8, top-k=40, min-p=0.05, repeat penalty 1.1 over the last 64 tokens"
    assert Kernel(greedy=True, repeat_penalty=1.3, repeat_last_n=-1).describe() == \
        "greedy, repeat penalty 1.3 over the context"


@torch.no_grad()
@pytest.mark.parametrize("last_n", [8, -1])
def test_repeat_penalised_greedy_decoding_matches_llama_cpps_sampler_on_transformers_logits(toy_hub, toy_model,
                                                                                           last_n):
    """Greedy decoding with a repeat penalty in the engine equals a loop that runs llama.cpp's penalties sampler
    (fed the prompt, then each token, as llama.cpp's server feeds it) on transformers' logits and takes the
    argmax; the window matters (8 tokens and the whole context differ from no penalty)."""
    import ctypes

    import llama_cpp as L

    from hybridlm.engine.clock import generate

    _, ref = toy_hub
    prompt = [464, 3290, 318, 257, 1332, 13, 464, 3290]
    V = ref.config.vocab_size

    def reference(rho, n):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        window = last_n if last_n != -1 else 1 << 20  # llama.cpp's −1 is n_ctx, which its caller sets
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(V, window, rho, 0.0, 0.0))
        ids = list(prompt)
        for token in prompt:
            L.llama_sampler_accept(chain, token)
        try:
            for _ in range(n):
                zl = ref(torch.tensor([ids])).logits[0, -1].tolist()
                data = (L.llama_token_data * V)(*[L.llama_token_data(i, v, 0.0) for i, v in enumerate(zl)])
                cur = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=V, selected=-1,
                                               sorted=False)
                L.llama_sampler_apply(chain, ctypes.byref(cur))
                w = max(range(cur.size), key=lambda i: (cur.data[i].logit, -cur.data[i].id))
                w = cur.data[w].id
                L.llama_sampler_accept(chain, w)
                ids.append(w)
        finally:
            L.llama_sampler_free(chain)
        return ids[len(prompt):]

    kernel = Kernel(greedy=True, repeat_penalty=1.8, repeat_last_n=last_n)
    got = generate(toy_model, prompt, kernel=kernel, max_new_tokens=20, stop_ids=[]).generated_ids
    assert got == reference(1.8, 20)
    plain = generate(toy_model, prompt, kernel=Kernel(greedy=True), max_new_tokens=20, stop_ids=[]).generated_ids
    assert plain != got


@torch.no_grad()
def test_sampling_with_min_p_and_top_k_draws_what_transformers_warpers_give(toy_hub, toy_model):
    """Sampled decoding (τ = 0.8, top-k 30, min-p 0.05, a repeat penalty over the context) in the engine draws
    the tokens a loop draws from transformers' processors on transformers' logits with the same uniform numbers
    (the sequence's generator, one per step)."""
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper

    from hybridlm.engine.clock import generate
    from hybridlm.engine.sampling import draw

    _, ref = toy_hub
    prompt = [464, 3290, 318, 257, 1332, 13]
    kernel = Kernel(temperature=0.8, top_k=30, min_p=0.05, repeat_penalty=1.3, repeat_last_n=-1)
    got = generate(toy_model, prompt, kernel=kernel, max_new_tokens=24, stop_ids=[], seed=5).generated_ids
    procs = [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8), TopKLogitsWarper(30),
             MinPLogitsWarper(0.05)]
    g = torch.Generator().manual_seed(5)
    ids = list(prompt)
    for _ in range(24):
        scores = ref(torch.tensor([ids])).logits[:, -1]
        for proc in procs:
            scores = proc(torch.tensor([ids]), scores)
        ids.append(int(draw(torch.softmax(scores, dim=-1), g)))
    assert got == ids[len(prompt):]


# ---------------------------------------------------------------------- what a token event records
class _Allowed:
    """A constraint that allows a fixed set of tokens at every step (the engine's Constraint protocol)."""

    def __init__(self, vocab: int, allowed):
        self.allowed = torch.zeros(vocab, dtype=torch.bool)
        self.allowed[list(allowed)] = True
        self.finished = False

    def mask(self):
        return self.allowed

    def advance(self, token):
        assert self.allowed[token]

    def describe(self):
        return {"kind": "a fixed set"}


@torch.no_grad()
@pytest.mark.parametrize("kernel, constrained", [
    (Kernel(greedy=True), False),
    (Kernel(greedy=True), True),
    (Kernel(temperature=0.7, top_k=20, min_p=0.05), False),
    (Kernel(temperature=1.4, top_p=0.9), True),
    (Kernel(greedy=True, repeat_penalty=1.5, repeat_last_n=-1), False),
])
def test_every_token_records_the_models_logprob_and_the_kernels_beside_it(toy_hub, toy_model, kernel, constrained):
    """`logprob` is log p_θ(w | s) at τ = 1 of transformers' logits (the unmasked model) whatever drew w, and
    `kernel_logprob` is log p(w | s) under the kernel that drew it, written out with transformers' processors:
    0 under greedy decoding, the masked, tempered, truncated distribution otherwise."""
    from transformers import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from hybridlm.engine.clock import generate

    _, ref = toy_hub
    prompt = [464, 3290, 318, 257, 1332, 13]
    allowed = range(200, 700) if constrained else None
    constraint = _Allowed(ref.config.vocab_size, allowed) if constrained else None
    run = generate(toy_model, prompt, kernel=kernel, max_new_tokens=12, stop_ids=[], seed=3, constraint=constraint)
    events = run.arc.of("token")
    assert len(events) == 12
    ids = list(prompt)
    for step, e in zip(run.steps, events):
        z = ref(torch.tensor([ids])).logits[0, -1]
        w = step.token
        assert e["logprob"] == step.logprob == pytest.approx(float(torch.log_softmax(z.double(), -1)[w]), abs=2e-4)
        scores = z[None].clone()
        if kernel.repeat_penalty != 1:
            scores = RepetitionPenaltyLogitsProcessor(kernel.repeat_penalty)(torch.tensor([ids]), scores)
        if constrained:
            scores[0, [v for v in range(scores.shape[-1]) if v not in allowed]] = float("-inf")
        if kernel.greedy:
            assert w == int(scores.argmax()) and e["kernel_logprob"] == step.kernel_logprob == 0.0
        else:
            procs = [TemperatureLogitsWarper(kernel.temperature)]
            procs += [TopKLogitsWarper(kernel.top_k)] if kernel.top_k else []
            procs += [TopPLogitsWarper(kernel.top_p)] if kernel.top_p else []
            procs += [MinPLogitsWarper(kernel.min_p)] if kernel.min_p else []
            for proc in procs:
                scores = proc(torch.tensor([ids]), scores)
            expect = float(torch.log_softmax(scores[0].double(), -1)[w])
            assert e["kernel_logprob"] == pytest.approx(expect, abs=2e-4)
        ids.append(w)
    assert any(e["logprob"] < -1e-3 for e in events)  # the model's own probability is not the greedy kernel's 1


def test_token_probabilities_of_traces_of_every_version():
    """A token event written before `kernel_logprob` holds the kernel's value under `logprob` (and the model's,
    when asked, under `model_logprob`); `token_logprobs` reads both kinds."""
    from hybridlm.engine.arc import Event, token_logprobs

    assert token_logprobs({"logprob": -0.25, "kernel_logprob": 0.0}) == (-0.25, 0.0)
    assert token_logprobs({"logprob": 0.0}) == (None, 0.0)  # an old greedy trace: the model's is unknown
    assert token_logprobs({"logprob": -0.1, "model_logprob": -0.7}) == (-0.7, -0.1)
    assert token_logprobs(Event("token", 1, 0, 0.0, {"logprob": -1.5, "kernel_logprob": -0.5})) == (-1.5, -0.5)
    assert token_logprobs({}) == (None, None)
