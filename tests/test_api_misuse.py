"""The Python API under misuse, as a researcher coming from TransformerLens would try it: every
mistake is the project's InputError with one line naming the value, never a silent wrong result
or a raw error from deep inside. References: the model's own unhooked output, a closed count."""

import math

import numpy as np
import pytest
import torch

from hybridlm.control import Steering
from hybridlm.errors import InputError
from hybridlm.lm.capture import Recorder, run_with_trace
from hybridlm.lm.config import ModelConfig
from hybridlm.weights.loading import load_model

V, T, L = 120, 32, 3


@pytest.fixture(scope="module")
def m():
    return load_model(ModelConfig(vocab_size=V, n_ctx=T, d_model=24, n_layer=L, n_head=3, eos_token_id=None), seed=2)


IDS = torch.tensor([[5, 17, 3, 99, 42, 8]])


@pytest.mark.parametrize("name, returns", [
    ("blocks.1.hook_resid_pre", lambda h, hook: h[:, :1]),  # fewer positions: the logits would shrink
    ("blocks.0.mlp.hook_pre", lambda h, hook: h[..., :1]),  # would broadcast
    ("hook_logits", lambda z, hook: z[..., :10]),  # generation would sample from 10 tokens
    ("blocks.0.hook_resid_post", lambda h, hook: h.double()),
    ("blocks.0.hook_resid_post", lambda h, hook: 1.0),
])
def test_a_hook_that_returns_the_wrong_thing_is_named(m, name, returns):
    with m.hooks({name: returns}), pytest.raises(InputError, match=f"hook on {name} returned .*expected None or a "
                                                                  f"tensor of shape"):
        m(IDS)
    assert m(IDS).shape == (1, IDS.shape[1], V)  # the hooks are gone after the error


def test_hook_names_and_functions_are_checked(m):
    with pytest.raises(InputError, match="no hook point named 'blocks.0.hook_resid_foo'") as err, \
            m.hooks({"blocks.0.hook_resid_foo": lambda h, hook: None}):
        pass
    assert isinstance(err.value, KeyError) and "\n" not in str(err.value) and not str(err.value).startswith("'")
    with pytest.raises(InputError, match="expected a function"), m.hooks({"blocks.0.hook_resid_post": 3}):
        pass
    assert not any(p.fns for p in m.hook_points.values())


def test_token_ids_that_a_cast_would_change_are_refused(m):
    x = m.init_state([5, 17, 3])
    for bad in ([1.7], torch.tensor([2.0]), torch.tensor([True])):
        with pytest.raises(InputError, match="token ids must be integers"):
            m.F(x, bad)
    assert x.n == 3  # nothing was appended
    with pytest.raises(InputError, match="token ids must be integers"):
        m(torch.tensor([[True, False]]))


def test_a_step_takes_one_token_per_state(m):
    xs = [m.init_state([5, 17]), m.init_state([3])]
    with pytest.raises(InputError, match="2 states and 1 tokens"):
        m.step(xs, [5])
    with pytest.raises(InputError, match="2 states and 3 tokens"):
        m.step(xs, [5, 6, 7])
    with pytest.raises(InputError, match="integer token ids"):
        m.step(xs, [5, 6.5])
    m.step(xs, np.array([5, 6]))  # numpy integers are integers
    assert [x.n for x in xs] == [3, 2]


@pytest.mark.parametrize("layers", [-1, L + 2, 1.5, True])
def test_layers_out_of_range_are_refused(m, layers):
    with pytest.raises(InputError, match=f"0 ≤ layers ≤ {L}"):
        m(IDS, layers=layers)


def test_recorder_selections_that_would_record_nothing_are_refused(m):
    with pytest.raises(InputError, match=f"layer 7: expected an integer 0 ≤ layer < {L}"):
        Recorder(m, layers=[7])
    with pytest.raises(InputError, match=f"position 100: expected an integer 0 ≤ position < {T}"):
        run_with_trace(m, IDS, positions=[100])
    with pytest.raises(InputError, match="position -1"):
        Recorder(m, positions=[-1])
    cache = run_with_trace(m, IDS, "blocks.0.hook_resid_post", positions=[np.int64(2)])  # numpy ints are fine
    assert cache is not None


def test_steering_needs_finite_numbers_and_a_position(m):
    with pytest.raises(InputError, match="finite numbers"):
        Steering(torch.full((24,), math.nan), layer=1)
    with pytest.raises(InputError, match="from_pos='a'"):
        Steering(torch.ones(24), layer=1, from_pos="a")
