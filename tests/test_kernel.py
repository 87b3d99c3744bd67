"""The sampling kernel against closed forms."""

import math

import pytest
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
