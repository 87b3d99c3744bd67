"""Chunked prefill: a long prompt joins the engine a chunk per step, between the token steps of the
running rows, and every sequence still gets the tokens it gets alone.

References: each sequence run alone, the long prompt prefilled in one piece (prefill_chunk=0), and
the prefill written out (F over the whole prompt); steps are counted, never timed.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from hybridlm import Kernel
from hybridlm.engine import ArcState, Engine, HybridSystem, Limits, PrefixCache
from hybridlm.engine.clock import sequence
from hybridlm.engine.prefill import prefill, prefill_steps, segments
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


def _yields(steps) -> tuple[list, object]:
    """What a prefill's steps yield (where each chunk starts), and the state they return."""
    at = []
    try:
        while True:
            at.append(next(steps))
    except StopIteration as done:
        return at, done.value


def test_chunks_cover_the_prompt_and_give_the_prefill_in_one_piece(toy_model):
    """prefill_steps yields after chunks of at most `segment` tokens that tile the prompt, and ends
    in the state of one F over the whole prompt (within rounding: other row blocks)."""
    _, long = _prompts()
    steps = prefill_steps(toy_model, long, marks=(9, 10, 11, 60), segment=CHUNK)
    at, x = _yields(steps)
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


# ---------------------------------------------------------------------- the grid: chunks of equal cost
QWEN_LIKE = dict(family="qwen2", vocab_size=300, n_ctx=4096, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_mlp=160,
                 norm="rmsnorm", positions="rotary", mlp="swiglu", attn_out_bias=False, mlp_bias=False)


def test_token_cost_counts_the_flops_of_a_prefill_chunk():
    """A config's token_cost against PyTorch's own FLOP counter on a prefill chunk deep in a context. With
    a hook on the scores the attention is formed as explicit products, which the counter sees, over the
    m queries and all n + m keys (a masked rectangle counted whole); so the chunk costs
    2·L·affine·m·token_cost(n + m), where the counter finds the affine maps' share alone on the fused path."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybridlm.lm.config import ModelConfig
    from hybridlm.lm.model import DecoderLM, init_weights

    cfg = ModelConfig(**QWEN_LIKE)
    model = init_weights(DecoderLM(cfg))
    looked = [(f"blocks.{i}.attn.hook_attn_scores", lambda s, hook: s) for i in range(cfg.n_layer)]
    for n, m in [(0, 16), (100, 16), (1000, 40)]:
        x = model.empty_state(1, capacity=n + m)
        if n:
            model.F(x, [i % 300 for i in range(n)])
        copy = x.clone()
        with FlopCounterMode(display=False) as fused:
            model.F(x, [7] * m)
        with model.hooks(looked), FlopCounterMode(display=False) as explicit:
            model.F(copy, [7] * m)
        affine = fused.get_total_flops() / (2 * cfg.n_layer * m)
        assert affine == cfg.d_model * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.d_head + cfg.n_head * cfg.d_head * cfg.d_model \
            + 3 * cfg.d_model * cfg.d_mlp
        assert explicit.get_total_flops() == pytest.approx(2 * cfg.n_layer * affine * m * cfg.token_cost(n + m), rel=1e-12)


def test_a_local_block_reads_at_most_its_window():
    from hybridlm.lm.config import ModelConfig

    glob = ModelConfig(**QWEN_LIKE)
    loc = ModelConfig(**{**QWEN_LIKE, "attention_layers": ("local", "global"), "local_window": 32})
    assert loc.token_cost(32) == glob.token_cost(32)
    # past the window only the global block's reads grow: half the growth of the all-global model
    assert loc.token_cost(1032) - loc.token_cost(32) == pytest.approx((glob.token_cost(1032) - glob.token_cost(32)) / 2)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 300), end=st.integers(1, 5000), local=st.booleans())
def test_the_grid_cuts_cells_of_bounded_cost_by_position_alone(size, end, local):
    from hybridlm.engine.prefill import grid
    from hybridlm.lm.config import ModelConfig

    cfg = ModelConfig(**{**QWEN_LIKE, **({"attention_layers": ("local", "global"), "local_window": 64} if local else {})})
    cost = cfg.token_cost
    cuts = grid(end, size, cost)
    bounds = [0, *cuts, end]
    assert all(0 < c < end for c in cuts) and cuts == sorted(set(cuts))
    budget = size * cost(size)
    for a, b in zip(bounds[:-2], bounds[1:-1]):  # every whole cell: within the budget, and as long as it can be
        assert (b - a) * cost(b) <= budget * (1 + 1e-12) or b - a == 1  # (one token is one token)
        assert b - a == size or (b - a + 1) * cost(b + 1) > budget
    assert grid(end // 2 + 1, size, cost) == [c for c in cuts if c < end // 2 + 1]  # a prefix is cut the same way
    assert grid(end, size) == list(range(size, end, size))  # no cost: the plain grid


def test_a_deep_chunk_costs_what_a_first_one_does_and_holds_fewer_tokens():
    """prefill_steps' chunks tile the prompt, each costing at most its first chunk's budget; deep in the
    context they are shorter (SmolLM2-135M's shape)."""
    from hybridlm.lm.config import ModelConfig
    from hybridlm.lm.model import DecoderLM

    cfg = ModelConfig(family="llama", vocab_size=64, n_ctx=8192, d_model=576, n_layer=30, n_head=9, n_kv_head=3,
                      d_mlp=1536, norm="rmsnorm", positions="rotary", mlp="swiglu", attn_bias=False,
                      attn_out_bias=False, mlp_bias=False)

    class Shape(DecoderLM):  # the grid and the chunks, without computing: F only advances n
        def F(self, x, w):
            x.n += len(w)
            return x

    with torch.device("meta"):
        model = Shape(cfg)
    model.empty_state = lambda batch=1, capacity=64: type("X", (), {"n": 0})()
    prompt = [1] * 6000
    marks = list(range(40, 6000, 43))  # short messages, as in a long conversation
    steps = prefill_steps(model, prompt, marks=marks, segment=256)
    at, _ = _yields(steps)
    bounds = [*at, len(prompt)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and sum(sizes) == len(prompt)
    assert max(sizes[:3]) <= 256 and max(sizes[-5:]) < 100  # at depth ~6k a chunk holds about a third
    parts = segments(len(prompt), marks, size=256, cost=cfg.token_cost)
    for a, b in zip(bounds, bounds[1:]):  # a chunk is whole segments, whose costs sum within the budget
        inside = [(i, j) for i, j in parts if a <= i < b]
        assert inside[0][0] == a and inside[-1][1] == b
        assert sum((j - i) * cfg.token_cost(j) for i, j in inside) <= 256 * cfg.token_cost(256) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(1, 10_000), max_size=60), marks=st.lists(st.integers(1, 10_000), max_size=200))
def test_a_prefill_copies_its_state_a_bounded_number_of_times(cuts, marks):
    """The first mark, the last mark and the last end are kept; every other copy is at least twice as long
    as the one before it, so what is copied sums to at most the kept marks plus three times the last end
    (twice for the geometric copies, once for the last end itself)."""
    from hybridlm.engine.prefill import copied_ends

    copied = sorted(copied_ends(cuts, marks))
    ends = sorted(set(cuts) | set(marks))
    assert set(copied) <= set(ends) and (not ends or ends[-1] in copied)
    assert not marks or {min(marks), max(marks)} <= set(copied)
    chain = [e for e in copied if e not in {min(marks, default=0), max(marks, default=0)}]
    assert all(b >= 2 * a for a, b in zip(chain, chain[1:-1]))
    assert sum(copied) <= 3 * (ends[-1] if ends else 0) + max(marks, default=0) + min(marks, default=0)


def test_the_next_request_of_a_conversation_continues_its_last_message(toy_model):
    """A conversation of many messages is copied a few times, not once per message, and its next request
    (the reply and a new message appended) is prefilled from the end of its last message, to the bit."""
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, 50257, (400,), generator=g).tolist()
    marks = list(range(10, 400, 13))  # 30 messages
    cache = PrefixCache()
    x = prefill(toy_model, first, marks=marks, cache=cache)
    assert 2 <= len(cache) < 12
    nxt = first + torch.randint(0, 50257, (30,), generator=g).tolist()
    hit = prefill(toy_model, nxt, marks=[*marks, 415], cache=cache)
    assert cache.hit_tokens == marks[-1]
    cold = prefill(toy_model, nxt, marks=[*marks, 415])
    assert torch.equal(hit.logits, cold.logits) and torch.equal(hit.keys(1), cold.keys(1))
    assert x.n == 400


# ---------------------------------------------------------------------- the prefix cache's eviction
class _Sized:
    """A stand-in state of a given size in bytes (the cache reads nbytes, n and clone)."""

    def __init__(self, size: int) -> None:
        self.size, self.n = size, size

    def nbytes(self) -> int:
        return self.size

    def clone(self, **_) -> "_Sized":
        return _Sized(self.size)


def test_a_shared_prefix_found_again_outlives_one_long_conversation():
    """A system prompt every client sends (found again: protected) is not pushed out by the copies of one
    long conversation that fill the cache (seen once), which plain LRU dropped it for."""
    cache = PrefixCache(max_bytes=1000)
    system = [("system",)]
    cache.put(system, _Sized(100))
    assert cache.longest(system) is not None  # a second client: found again
    long = [("turn", i) for i in range(40)]
    for depth in range(1, 41):  # one conversation's copies, 50 bytes each, 2,000 bytes in all
        cache.put(long[:depth], _Sized(50))
    assert cache.longest(system) is not None
    assert cache.bytes <= cache.max_bytes and cache.protected_bytes == 100


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 400)), max_size=60),
       st.sampled_from([0.0, 0.5, 0.8, 0.99]))
def test_prefix_cache_accounting_laws(ops, protect):
    """Whatever the puts and lookups: the bytes are the sum of the held states', within the bound; the
    protected ones within their share (or a single state); a state put is held if and only if it fits
    beside the protected ones (or was held already), and no protected state is dropped to make room."""
    cache = PrefixCache(max_bytes=1000, protect=protect)
    for is_lookup, key, size in ops:
        segs = [("k", key)]
        if is_lookup:
            found = cache.longest(segs)
            if found is not None:
                assert cache.longest(segs) is not None  # found: not dropped by being found
        else:
            held_before = cache.longest(segs) is not None
            protected = {id(n) for n in cache._protected.values()}
            fits = size <= cache.max_bytes - cache.protected_bytes
            cache.put(segs, _Sized(size))
            assert protected <= {id(n) for n in (*cache._protected.values(), *cache._probation.values())}
            assert (cache.longest(segs) is not None) == (held_before or fits)
        held = [n for n in (*cache._probation.values(), *cache._protected.values())]
        assert cache.bytes == sum(n.state.nbytes() for n in held) <= cache.max_bytes
        assert cache.protected_bytes == sum(n.state.nbytes() for n in cache._protected.values())
        assert cache.protected_bytes <= protect * cache.max_bytes or len(cache._protected) == 1
        assert len(cache) == len(held) == len({id(n) for n in held})
