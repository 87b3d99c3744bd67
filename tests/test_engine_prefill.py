"""Chunked prefill: a long prompt joins the engine a chunk per step, between the token steps of the
running rows, and every sequence still gets the tokens it gets alone.

References: each sequence run alone, the long prompt prefilled in one piece (prefill_chunk=0), and
the prefill written out (F over the whole prompt); steps are counted, never timed.
"""

import pytest
import torch

from hybridlm import Kernel
from hybridlm.engine import ArcState, Engine, HybridSystem, Limits, PrefixCache
from hybridlm.engine.clock import sequence
from hybridlm.engine.prefill import prefill_steps
from hybridlm.errors import InputError

CHUNK = 16


def _prompts():
    g = torch.Generator().manual_seed(7)
    short = torch.randint(0, 50257, (5,), generator=g).tolist()
    long = torch.randint(0, 50257, (150,), generator=g).tolist()
    return short, long


def _alone(model, prompt, n, chunk, **kw):
    s = sequence(model, prompt, kernel=Kernel(greedy=True), max_new_tokens=n, **kw)
    Engine(model, prefill_chunk=chunk).solve([s])
    return s.arc.tokens


class _PrefillTokens:
    """Counts the prompt tokens F takes (a prefill's pieces; the batched token step is `model.step`)."""

    def __init__(self, model, monkeypatch):
        self.n = 0
        F = model.F

        def counted(x, tokens):
            self.n += len(tokens)
            return F(x, tokens)

        monkeypatch.setattr(model, "F", counted)


def test_a_long_prefill_interleaves_with_the_running_rows_token_steps(toy_model, monkeypatch):
    short, long = _prompts()
    marks = (3, 7, 40, 41, 100)  # message ends: short segments share a chunk, none crosses one
    runner_alone = _alone(toy_model, short, 60, CHUNK)
    long_alone = _alone(toy_model, long, 8, CHUNK)
    long_whole = _alone(toy_model, long, 8, 0)  # one piece: the unchunked engine

    engine = Engine(toy_model, prefill_chunk=CHUNK, prefix_cache=PrefixCache())
    runner = sequence(toy_model, short, kernel=Kernel(greedy=True), max_new_tokens=60)
    engine.add(runner)
    while runner.t < 2:
        engine.step()
    s = sequence(toy_model, long, kernel=Kernel(greedy=True), max_new_tokens=8)
    s.marks = marks
    engine.add(s)
    counter = _PrefillTokens(toy_model, monkeypatch)
    per_step, steps_before = [], runner.t
    while s not in engine.active and not s.done:
        before = counter.n
        t = runner.t
        engine.step()
        per_step.append(counter.n - before)
        assert runner.t == t + 1  # the running row took its token step in every step of the prefill
    monkeypatch.undo()
    assert sum(per_step) == len(long) and max(per_step) <= CHUNK
    assert len(per_step) >= len(long) // CHUNK + 1 and runner.t - steps_before == len(per_step)
    engine.run()
    assert runner.error is None and s.error is None
    assert runner.arc.tokens == runner_alone
    assert s.arc.tokens == long_alone == long_whole


def test_chunks_cover_the_prompt_and_give_the_prefill_in_one_piece(toy_model):
    """prefill_steps yields after chunks of at most `segment` tokens that tile the prompt, and ends
    in the state of one F over the whole prompt (within rounding: other row blocks)."""
    _, long = _prompts()
    steps = prefill_steps(toy_model, long, marks=(9, 10, 11, 60), segment=CHUNK)
    at = [next(steps)]
    try:
        while True:
            at.append(next(steps))
    except StopIteration as done:
        x = done.value
    bounds = [*at, len(long)]
    assert bounds[0] == 0 and all(0 < b - a <= CHUNK for a, b in zip(bounds, bounds[1:]))
    ref = toy_model.init_state(long)
    assert x.n == len(long) and torch.allclose(x.logits, ref.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256"])
def test_a_bad_chunk_is_named(toy_model, bad):
    with pytest.raises(InputError, match="prefill_chunk"):
        Engine(toy_model, prefill_chunk=bad)


class _LongObservation(HybridSystem):
    """A toy tool user: one jump after 3 tokens whose observation is `n` tokens long."""

    def __init__(self, n: int) -> None:
        self.n = n

    def flow_set(self, s):
        return s.finished is False and not self.jump_set(s)

    def jump_set(self, s):
        return s.k == 0 and len(s.turn) >= 3

    def jump(self, s):
        return lambda: "y"

    def landed(self, s, result):
        s.count_jump()
        s.emit("jump", tool="long", arguments={}, observation=result, error=None, duration_s=0.0)
        return [(17 * i) % 50000 + 1 for i in range(self.n)]


def _lander(model):
    return ArcState(_LongObservation(100), [5, 6, 7], kernel=Kernel(greedy=True),
                    limits=Limits(max_token_steps=10, max_jumps=1))


def test_a_long_observation_lands_a_chunk_per_step(toy_model, monkeypatch):
    """The observation of a jump is prefilled like a prompt: a chunk between two token steps of the running
    rows; the sequence's tokens are those it gets alone, whatever ran beside it."""
    alone = Engine(toy_model, prefill_chunk=CHUNK)
    lone = alone.add(_lander(toy_model))
    alone.run()
    short, _ = _prompts()
    engine = Engine(toy_model, prefill_chunk=CHUNK)
    runner = engine.add(sequence(toy_model, short, kernel=Kernel(greedy=True), max_new_tokens=40))
    s = engine.add(_lander(toy_model))
    while s not in engine.external:
        engine.step()
    counter = _PrefillTokens(toy_model, monkeypatch)
    while not any(e["action"] == "join" and e["reason"] == "observation" for e in s.arc.of("batch")):
        before, t = counter.n, runner.t
        engine.step()
        assert counter.n - before <= CHUNK and (runner.done or runner.t == t + 1)
    monkeypatch.undo()
    assert counter.n == 100
    engine.run()
    assert s.error is None and lone.error is None and s.k == 1
    assert s.arc.tokens == lone.arc.tokens and len(s.arc.tokens) == 10


def test_warm_up_leaves_no_trace(toy_model):
    """The server's warm-up prefill touches neither the prefix cache nor any sequence's tokens."""
    short, long = _prompts()
    cache = PrefixCache()
    engine = Engine(toy_model, prefill_chunk=CHUNK, prefix_cache=cache)
    engine.warm_up()
    assert len(cache) == 0 and not engine.busy
    s = engine.add(sequence(toy_model, long, kernel=Kernel(greedy=True), max_new_tokens=6))
    engine.run()
    assert s.arc.tokens == _alone(toy_model, long, 6, CHUNK)
