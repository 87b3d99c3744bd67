"""The engine: a population of hybrid automata on one token clock.

References: each sequence run alone (the same seed must give the same tokens in any batch),
F applied step by step (the batched step and the fork), a prefill without the cache, the
exact context policy, and the HyEQ semantics of C, D, the horizons and the priority rule
written out for small systems.
"""

import time

import pytest
import torch

from hybridlm import Kernel, generate, load_model
from hybridlm.agent import HybridAgent
from hybridlm.tools import registry, tool
from hybridlm.tools import ToolRegistry
from hybridlm.control import ContrastVector, Steering, ban_words
from hybridlm.engine import (
    ArcState, ContextPolicy, Engine, HybridArc, HybridSystem, Limits, PrefixCache, Priority, Termination,
)
from hybridlm.engine.clock import sequence
from hybridlm.engine.prefill import prefill
from hybridlm.lm.state import ForkedState
from tests.agent_fakes import ScriptedModel, ScriptsModel


# ---------------------------------------------------------------------- the step
def test_a_ragged_batch_step_is_each_state_stepped_alone(toy_model):
    """model.step on states of different lengths gives each the bits F gives it alone."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in (3, 17, 9, 30)]
    alone, batched = [toy_model.init_state(p) for p in prompts], [toy_model.init_state(p) for p in prompts]
    for _ in range(5):
        w = [int(x.logits.argmax()) for x in alone]
        for x, token in zip(alone, w):
            toy_model.F(x, [token])
        toy_model.step(batched, w)
        for a, b in zip(alone, batched):
            assert torch.equal(a.logits, b.logits) and a.n == b.n and torch.equal(a.tokens, b.tokens)


def test_a_fork_is_each_candidate_stepped_alone(smollm2):
    """A fork's k successors have, bit for bit, the rows and logits one decode step F(x, w) gives
    each candidate alone (so adopting one is F), and match the prefill of s ∘ w within rounding."""
    from hybridlm.lm import kernels

    ids = smollm2.tokenizer.encode("The state of a hybrid system is")
    x = smollm2.init_state(ids)
    smollm2.F(x, [int(x.logits.argmax())])  # a row written by a decode step too
    context = x.tokens[0].tolist()
    cand = torch.topk(x.logits[0], 6).indices
    fork = ForkedState(x, 6)
    h = smollm2(cand[:, None], fork, logits=False)[:, -1]
    assert x.n == len(context)  # the parent is untouched
    for i, w in enumerate(cand.tolist()):
        ref = smollm2(torch.tensor([context + [w]]), logits=False)[0, -1]
        assert torch.allclose(h[i], ref, rtol=1e-4, atol=1e-3)
        if kernels.decode_attention() is None:
            continue  # (PyTorch's fork attention sums in another order than its decode step)
        alone = smollm2.init_state(ids)
        smollm2.F(alone, [context[-1]])
        smollm2.F(alone, [w])
        assert torch.equal(smollm2.readout(h[i : i + 1][:, None])[:, -1], alone.logits)
        for layer, (k, v) in fork.rows.items():
            K, V = alone.layer_buffers(layer)
            assert torch.equal(K[0, :, len(context)], k[i]) and torch.equal(V[0, :, len(context)], v[i])


# ---------------------------------------------------------------------- one meaning of a seed
@tool(timeout_s=5)
def pause(seconds: float) -> str:
    """Wait for the given number of seconds."""
    time.sleep(min(seconds, 0.2))
    return "done"


def test_a_mixed_batch_gives_every_sequence_its_tokens_alone(smollm2):
    """Eight sequences (sampled, greedy, agents with jumps, one safety-filtered, one steered,
    joining at different steps) in one engine: each makes exactly the tokens it makes alone."""
    tok = smollm2.tokenizer
    agent = HybridAgent(smollm2, registry(["calculator"]), limits=Limits(max_token_steps=60, max_jumps=2))
    steer = Steering(ContrastVector(torch.randn(smollm2.config.d_model, generator=torch.Generator().manual_seed(1))
                                    * 0.5, layer=10))

    def population():
        chat = lambda text: tok.encode_markup(tok.render_chat([{"role": "user", "content": text}]))  # noqa: E731 - a one-line helper of the test
        return [
            (0, sequence(smollm2, chat("Name a river."), kernel=Kernel(temperature=0.8, top_p=0.95),
                         max_new_tokens=20, seed=3)),
            (0, agent.sequence("What is 1234 * 5678?")),
            (2, sequence(smollm2, tok.encode("Once upon a time"), kernel=Kernel(greedy=True), max_new_tokens=16)),
            (3, sequence(smollm2, chat("Where is Paris?"), kernel=Kernel(temperature=1.0), max_new_tokens=20,
                         seed=11, controllers=[ban_words("Paris", tok)])),
            (5, agent.sequence("What is 99 squared?", seed=1)),
            (5, sequence(smollm2, tok.encode("The state x_t"), kernel=Kernel(temperature=1.2, top_k=40),
                         max_new_tokens=18, seed=5)),
            (9, sequence(smollm2, chat("Say hello."), kernel=Kernel(temperature=0.7), max_new_tokens=14, seed=8,
                         controllers=[steer])),
            (12, sequence(smollm2, tok.encode("1, 2, 3,"), kernel=Kernel(greedy=True), max_new_tokens=12)),
        ]

    alone = []
    for _, s in population():
        engine = Engine(smollm2, prefix_cache=agent.prefix_cache)
        engine.add(s)
        engine.run()
        assert s.error is None
        alone.append(s.arc.tokens)
    engine = Engine(smollm2, prefix_cache=agent.prefix_cache)
    joining = population()
    seqs = [s for _, s in joining]
    step = 0
    while joining or engine.busy:
        while joining and joining[0][0] <= step:
            engine.add(joining.pop(0)[1])
        engine.step()
        step += 1
    assert all(s.error is None for s in seqs)
    assert [s.arc.tokens for s in seqs] == alone
    assert any(s.arc.of("jump") for s in seqs) and max(len(s.arc.tokens) for s in seqs) > 10


# ---------------------------------------------------------------------- two clocks
def test_a_sequence_in_q_E_leaves_the_batch_and_the_others_go_on(smollm2):
    tok = smollm2.tokenizer
    slow = ToolRegistry()

    @tool(timeout_s=5)
    def wait(seconds: float) -> str:
        """Wait."""
        time.sleep(0.6)
        return "waited"

    slow.register(wait)
    script = ['<tool_call>{"name": "wait", "arguments": {"seconds": 1}}</tool_call>', "Done."]
    model = ScriptsModel(tok, [script, ["word"] * 400], delay_s=0.002)
    agent = HybridAgent(model, slow, tool_choice="auto", constrain=False)
    s_agent = agent.sequence("wait a bit")
    s_plain = sequence(model, tok.encode("x"), max_new_tokens=400, stop_ids=())
    engine = Engine(model)
    engine.add(s_agent)
    engine.add(s_plain)
    engine.run()
    leave = next(e for e in s_agent.arc.of("batch") if e["action"] == "leave")
    back = next(e for e in s_agent.arc.of("batch") if e["action"] == "join" and e["reason"] == "observation")
    assert leave.t == back.t  # no token step for the agent while its tool ran
    during = [e for e in s_plain.arc.of("token")
              if leave.wall_s + s_agent.started < e.wall_s + s_plain.started < back.wall_s + s_agent.started]
    assert during  # the other sequence kept generating meanwhile
    assert s_agent.arc.wall_in("q_E") > 0.5 and s_agent.result.answer == "Done."


# ---------------------------------------------------------------------- the hybrid system, HyEQ's way
class Counter(HybridSystem):
    """A toy system: in D after every `every` tokens; the jump injects one token."""

    def __init__(self, every: int, both: bool = False) -> None:
        self.every, self.both = every, both

    def flow_set(self, s):
        return s.finished is False and (self.both or not self.jump_set(s))

    def jump_set(self, s):
        return len(s.turn) >= self.every

    def jump(self, s):
        return lambda: "y"

    def landed(self, s, result):
        s.count_jump()
        s.emit("jump", tool="count", arguments={}, observation=result, error=None, duration_s=0.0)
        return [7]


def counter_seq(model, system, **limits):
    return ArcState(system, [1, 2, 3], kernel=Kernel(greedy=True), limits=Limits(**limits))


def test_horizons_priority_and_termination_causes(toy_model):
    runs = {}
    for name, system, limits in [
        ("budget", Counter(every=100), dict(max_token_steps=7, max_jumps=3)),
        ("jumps", Counter(every=2), dict(max_token_steps=50, max_jumps=3)),
        ("flows first", Counter(every=2, both=True), dict(max_token_steps=6, max_jumps=3)),
    ]:
        engine = Engine(toy_model, priority=Priority.FLOWS if name == "flows first" else Priority.JUMPS)
        s = engine.add(counter_seq(toy_model, system, **limits))
        engine.run()
        runs[name] = s
    assert runs["budget"].arc.termination is Termination.TOKEN_BUDGET and runs["budget"].t == 7
    jumps = runs["jumps"]
    assert jumps.arc.termination is Termination.JUMP_HORIZON and jumps.k == 3 and jumps.t == 8
    assert [t for t, _, _ in jumps.arc.jump_times()] == [2, 4, 6]
    assert jumps.arc.flow_intervals() == [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    flows = runs["flows first"]  # in C ∩ D the flow has priority: it jumps only where it cannot flow (t = budget)
    assert [t for t, _, _ in flows.arc.jump_times()] == [6] and flows.arc.termination is Termination.TOKEN_BUDGET
    part = jumps.arc.restrict(k=(1, 2))
    assert {e.k for e in part.events} == {1, 2} and part.termination is None
    again = HybridArc.from_events([e.to_dict() for e in jumps.arc.events])
    assert again.tokens == jumps.arc.tokens and again.termination is Termination.JUMP_HORIZON


def test_one_termination_cause_for_generation_and_agent(toy_model, smollm2):
    tok = toy_model.tokenizer
    assert generate(toy_model, tok.encode("a b"), max_new_tokens=3, stop_ids=()).stop_reason == "token_budget"
    model = ScriptedModel(smollm2.tokenizer, ["4"])
    arc = HybridAgent(model, registry(["calculator"]), tool_choice="auto").run("2 + 2?")
    assert arc.stop_reason == Termination.STOP_TOKEN.value == "stop_token"


def test_a_cancelled_sequence_frees_its_rows(toy_model):
    engine = Engine(toy_model)
    a = engine.add(sequence(toy_model, [1, 2], max_new_tokens=50, stop_ids=()))
    b = engine.add(sequence(toy_model, [3, 4], max_new_tokens=10, stop_ids=()))
    engine.step()
    engine.step()
    engine.cancel(a)
    engine.run()
    assert a.arc.termination is Termination.CANCELLED and a.t == 2
    assert b.arc.termination is Termination.TOKEN_BUDGET and b.t == 10 and not engine.busy


# ---------------------------------------------------------------------- prefill and prefix reuse
def test_prefix_reuse_is_exact_to_the_bit(toy_model):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 50257, (300,), generator=g).tolist()
    a = shared + torch.randint(0, 50257, (40,), generator=g).tolist()
    b = shared + torch.randint(0, 50257, (25,), generator=g).tolist()
    cache = PrefixCache()
    prefill(toy_model, a, marks=[300], cache=cache)
    hit = prefill(toy_model, b, marks=[300], cache=cache)
    cold = prefill(toy_model, b, marks=[300])
    assert cache.hits == 1 and cache.hit_tokens == 300
    assert torch.equal(hit.logits, cold.logits) and torch.equal(hit.keys(1), cold.keys(1))
    assert torch.allclose(cold.logits, toy_model(torch.tensor([b]))[:, -1], rtol=1e-4, atol=1e-4)
    small = PrefixCache(max_bytes=hit.nbytes() + 1)  # room for one entry: the older is dropped
    prefill(toy_model, a, marks=[300], cache=small)
    assert len(small) == 1 and small.bytes <= small.max_bytes


def test_the_block_policy_equals_the_exact_one_where_contexts_coincide():
    """Under the block policy the context after step t is a suffix of the string; where it is the
    suffix the exact policy holds (the last min(T, |s_t|) tokens), the readout equals the exact
    recompute of Π_T(s_t). One rebuild per δ steps, not one per step."""
    from hybridlm import ModelConfig

    T, delta = 32, 8
    model = load_model(ModelConfig(vocab_size=300, n_ctx=T, d_model=64, n_layer=2, n_head=4, eos_token_id=None),
                       seed=2)
    prompt = list(range(1, 25))

    class Readouts:
        def __init__(self):
            self.z = {}

        def on_event(self, s, event):
            if event.kind == "token":
                self.z[event.t] = (event["n"], s.x.logits.clone())

    seen = Readouts()
    s = sequence(model, prompt, kernel=Kernel(temperature=1.0), max_new_tokens=40, seed=4, stop_ids=(),
                 observers=[seen])
    engine = Engine(model, context=ContextPolicy("block", delta))
    engine.add(s)
    engine.run()
    cuts = s.arc.of("context")
    assert 1 <= len(cuts) <= 40 // delta + 1
    string = prompt + s.arc.tokens
    coinciding = 0
    for t, (n, z) in seen.z.items():
        held = min(T, len(prompt) + t)
        if n == held:
            coinciding += 1
            exact = model(torch.tensor([string[: len(prompt) + t][-T:]]))[:, -1]
            assert torch.allclose(z, exact, rtol=1e-4, atol=1e-4), t
    assert coinciding >= len(cuts) and coinciding < len(seen.z)  # some steps coincide, some do not


# ---------------------------------------------------------------------- the rates of an arc
def test_the_rates_of_an_arc_written_out():
    """The multi-rate table of a hand-made arc, each number computed by hand: q_G is its phases but the external
    one, 0.5 + 1.0 + 0.2 + 1.0 s; q_E the jump's 0.25 s; prefill 0.5 + 0.2 s for 100 + 20 tokens; 20 token steps
    over 4 layers."""
    from hybridlm.engine.arc import format_rates

    ev = [{"event": "start", "t": 0, "k": 0, "wall_s": 0.0, "layers": 4},
          {"event": "phase", "t": 0, "k": 0, "wall_s": 0.0, "phase": "prefill", "mode": "q_G", "tokens": 100},
          {"event": "phase", "t": 0, "k": 0, "wall_s": 0.5, "phase": "decode", "mode": "q_G"}]
    ev += [{"event": "token", "t": i, "k": 0, "wall_s": 0.5 + 0.1 * i, "token": 7} for i in range(1, 11)]
    ev += [{"event": "phase", "t": 10, "k": 0, "wall_s": 1.5, "phase": "external", "mode": "q_E"},
           {"event": "jump", "t": 10, "k": 1, "wall_s": 1.8, "tool": "f", "duration_s": 0.25},
           {"event": "phase", "t": 10, "k": 1, "wall_s": 1.8, "phase": "prefill", "mode": "q_G", "tokens": 20},
           {"event": "phase", "t": 10, "k": 1, "wall_s": 2.0, "phase": "decode", "mode": "q_G"}]
    ev += [{"event": "token", "t": 10 + i, "k": 1, "wall_s": 2.0 + 0.1 * i, "token": 7} for i in range(1, 11)]
    ev.append({"event": "end", "t": 20, "k": 1, "wall_s": 3.0, "stop_reason": "stop_token"})
    r = HybridArc.from_events(ev).rates()
    expect = {"token_steps": 20, "jumps": 1, "layers": 4, "wall_q_G_s": 2.7, "wall_q_E_s": 0.25,
              "token_steps_per_s": 20 / 2.7, "layer_steps_per_s": 80 / 2.7, "prefill_s": 0.7, "prefill_tokens": 120,
              "prefill_tokens_per_s": 120 / 0.7, "decode_s": 2.0, "decode_steps_per_s": 20 / 2.0,
              "jumps_per_token_step": 0.05, "wall_s_per_q_E_visit": 0.25}
    assert r == pytest.approx(expect)
    assert format_rates(r) == ("20 token steps in 2.70 s of q_G: 7.41 token steps/s, 29.6 layer steps/s (L = 4); "
                               "prefill 0.70 s (120 tokens, 171.4 tokens/s), decode 2.00 s (10.00 steps/s); 1 jumps: "
                               "0.050 per token step, 0.250 s per q_E visit")
    # a supervisor's arc: the time between two decisions (a stage "end", then nothing until the next phase) is in no mode
    # (two decisions without the external phase and the jump, 5 s apart)
    idle = ev[:13] + [{"event": "decision", "t": 10, "k": 0, "wall_s": 1.5, "stage": "end"}] + \
        [dict(e, wall_s=e["wall_s"] + 5.0) for e in ev[15:]]
    assert HybridArc.from_events(idle).rates()["wall_q_G_s"] == pytest.approx(2.7)
    none = HybridArc.from_events(ev[:3]).rates()
    assert none["token_steps_per_s"] == 0.0 and none["jumps_per_token_step"] is None and none["layers"] == 4


def test_the_rates_of_a_run_count_its_own_steps(toy_model):
    prompt = [464, 3290, 318, 257, 1332, 13]
    run = generate(toy_model, prompt, kernel=Kernel(greedy=True), max_new_tokens=9, stop_ids=[])
    r = run.arc.rates()
    assert (r["token_steps"], r["jumps"], r["layers"], r["prefill_tokens"]) == (9, 0, 2, len(prompt))
    end, first = run.arc.events[-1].wall_s, run.arc.of("phase")[0].wall_s
    assert r["prefill_s"] + r["decode_s"] == pytest.approx(end - first) and r["wall_s_per_q_E_visit"] is None
    # `hybridlm trace show` ends with the same rates, read back from the events alone
    from hybridlm.engine.trace import format_timeline
    last = format_timeline([e.to_dict() for e in run.arc.events]).splitlines()[-1]
    assert last.startswith("rates: 9 token steps in ") and "(L = 2)" in last
