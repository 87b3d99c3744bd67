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
        ({"top_k": 0}, "top-k"),
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
