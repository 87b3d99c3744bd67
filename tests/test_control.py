"""Control inputs: kernel inputs, residual inputs, soft prefix, controllers, CLI options.

References are independent of the code under test: closed-form kernels, blocks run by
hand, regular expressions on decoded text, the model run on an explicitly longer string.
"""

import json
import math
import re

import pytest
import torch
from click.testing import CliRunner

from hybridlm import Kernel, generate
from hybridlm.cli import cli
from hybridlm.control import (
    BannedWords, ContrastVector, HiddenBarrier, KernelInput, MultiObjective, NoSafeToken, Objective, Observation,
    SafetyFilter, SoftPrefix, Steering, TokenMask, ban_words, contrast_vector, control_step, lexicon_score,
    make_controller, optimise_prefix, residual_hook, residual_point, rollout, target_logprob,
)
from hybridlm.errors import InputError

PROMPT = "The capital of France is"


def occurrences(text: str, word: str, after: int = 0) -> int:
    """Reference count: occurrences of word (any case, anywhere) ending after character `after`."""
    return sum(1 for m in re.finditer(re.escape(word), text, re.IGNORECASE) if m.end() > after)


def obs_for(model, z, texts, kernel=Kernel()):
    return Observation(t=1, z=z, state=None, texts=texts, stop_ids=model.tokenizer.stop_ids(), kernel=kernel)


# ---------------------------------------------------------------------- inputs default to zero
def test_no_input_is_bit_identical(toy_model):
    ids = toy_model.tokenizer.encode(PROMPT)
    base = generate(toy_model, ids, kernel=Kernel(temperature=0.9), max_new_tokens=12, seed=5)
    cv = ContrastVector(torch.randn(toy_model.config.d_model), layer=1)
    for controllers in (None, [], [Steering(cv, scale=0.0)],
                        [MultiObjective([Objective("r", lexicon_score(toy_model.tokenizer, ["the"]), 0.0)])]):
        out = generate(toy_model, ids, kernel=Kernel(temperature=0.9), max_new_tokens=12, seed=5,
                       controllers=controllers)
        assert [(s.token, s.logprob) for s in out.steps] == [(s.token, s.logprob) for s in base.steps]
        assert all(s.control == () for s in out.steps)
    # a zero residual input through the hook path gives bit-identical logits
    x = torch.tensor([ids])
    with toy_model.hooks([(residual_point(toy_model, 1), residual_hook(torch.zeros(toy_model.config.d_model)))]):
        hooked = toy_model(x)
    assert torch.equal(hooked, toy_model(x))


# ---------------------------------------------------------------------- kernel inputs
def test_logit_input_is_a_shifted_softmax(toy_model):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 50, generator=g)
    v = torch.randn(2, 50, generator=g)
    mask = torch.rand(2, 50, generator=g) > 0.3
    p = Kernel(temperature=0.7).probs(KernelInput(v=v, mask=mask).apply(z))
    expect = torch.exp((z + v) / 0.7) * mask
    torch.testing.assert_close(p, expect / expect.sum(-1, keepdim=True))


def test_filtered_kernel_is_the_renormalised_restriction(toy_model):
    tok = toy_model.tokenizer
    z = toy_model(torch.tensor([tok.encode(PROMPT)]), last_only=True)[:, -1]
    z[0, tok.encode(" Paris")[0]] += 16.0  # make the banned token likely
    kernel = Kernel(temperature=1.3)
    filt = ban_words(["Paris"], tok)
    zc, (rec,) = control_step([filt], obs_for(toy_model, z.clone(), [PROMPT], kernel))
    p = kernel.probs(z)[0]
    safe = ~filt.barrier.unsafe_row(PROMPT)
    assert not safe[tok.encode(" Paris")[0]]
    torch.testing.assert_close(kernel.probs(zc)[0], p * safe / (p * safe).sum())
    assert math.isclose(rec.removed_mass[0], float(p[~safe].sum()), rel_tol=1e-5)
    assert rec.removed_mass[0] > 0.5 and rec.removed_tokens[0] == int((~safe).sum())


def test_multi_objective_closed_form_and_runtime_weights(toy_model):
    tok = toy_model.tokenizer
    z = torch.randn(1, toy_model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    r = lexicon_score(tok, ["good", "great"], value=1.0)
    mod = MultiObjective([Objective("lex", r, 2.0)], base_weight=0.5)
    obs = obs_for(toy_model, z, [""])
    zc, _ = control_step([mod], obs)
    reward = r(obs_for(toy_model, z, [""]))
    expect = torch.softmax(0.5 * torch.log_softmax(z, -1) + 2.0 * reward, -1)
    torch.testing.assert_close(Kernel().probs(zc), expect)
    mod.set_weight("lex", 0.0)
    mod.set_weight("base", 1.0)
    assert mod.act(obs_for(toy_model, z, [""])) is None  # zero weights: zero input
    with pytest.raises(InputError, match="nope"):
        mod.set_weight("nope", 1.0)
    with pytest.raises(InputError, match="finite"):
        mod.set_weight("lex", float("nan"))


# ---------------------------------------------------------------------- state and context inputs
def test_residual_input_equals_blocks_by_hand(toy_model):
    ids = torch.tensor([toy_model.tokenizer.encode(PROMPT)])
    u = torch.randn(toy_model.config.d_model, generator=torch.Generator().manual_seed(2))
    layer, from_pos = 1, 2
    with toy_model.hooks([(residual_point(toy_model, layer), residual_hook(u, from_pos=from_pos))]):
        hooked = toy_model(ids)
    pos = torch.arange(ids.shape[1])
    h = toy_model.embed(ids, pos)
    for i, block in enumerate(toy_model.blocks):
        if i == layer:
            h = h + (pos >= from_pos).float()[:, None] * u
        h = block(h, pos, None, toy_model.rotary)
    torch.testing.assert_close(hooked, toy_model.readout(h))
    assert not torch.allclose(hooked, toy_model(ids))


def test_soft_prefix_of_a_token_row_equals_that_token(toy_model):
    ids = toy_model.tokenizer.encode(PROMPT)
    a = 464
    P = toy_model.W_e[a][None].clone()
    with_prefix = toy_model(torch.tensor([ids]), prefix=P)
    torch.testing.assert_close(with_prefix, toy_model(torch.tensor([[a] + ids])))
    # the controlled recursion prefills P, then decodes as if the token were there
    soft = generate(toy_model, ids, kernel=Kernel(greedy=True), max_new_tokens=6, controllers=[SoftPrefix(P)])
    hard = generate(toy_model, [a] + ids, kernel=Kernel(greedy=True), max_new_tokens=6)
    assert soft.generated_ids == hard.generated_ids
    with pytest.raises(InputError, match="soft prefix"):
        toy_model(torch.tensor([ids]), prefix=torch.zeros(1, 3))


def test_prefix_optimisation_raises_the_target(smollm2, toy_model):
    tok = smollm2.tokenizer
    prompt, target = tok.encode(PROMPT), tok.encode(" Rome")
    res = optimise_prefix(smollm2, prompt, target, steps=3, lr=0.05)
    assert res.objective_after > res.objective_before + 1.0  # nats, within 3 gradient steps
    with torch.no_grad():
        assert math.isclose(float(target_logprob(smollm2, prompt, target, res.prefix)), res.objective_after,
                            rel_tol=1e-4)
    tok = toy_model.tokenizer
    down = optimise_prefix(toy_model, tok.encode("The"), tok.encode(" Rome"), steps=4, lr=0.1, sign=-1)
    assert down.objective_after > down.objective_before  # J = −log p rises: the target is pushed down
    with pytest.raises(InputError, match="sign"):
        optimise_prefix(toy_model, [1], [2], sign=2)


# ---------------------------------------------------------------------- the banned-word barrier
def test_banned_words_one_step_sets(smollm2):
    tok = smollm2.tokenizer
    bw = BannedWords(["Paris"], tok, word_start=True)
    one = lambda s: tok.encode(s)[0]  # noqa: E731 - a one-line helper of the test
    assert len(tok.encode(" Paris")) == 1 and len(tok.encode("paris")) == 2  # 'par' + 'is'
    after_par = bw.unsafe_row("We went to par")  # the head 'par' of the word is written: 'is…' completes it
    assert after_par[one("is")] and after_par[one("ish")]  # 'parish' holds 'paris' at a word start
    assert not after_par[one(" is")] and not after_par[one("k")]
    assert not bw.unsafe_row("We went to compar")[one("is")]  # 'comparis…': not at a word start
    start = bw.unsafe_row("We went to ")
    assert start[one("Paris")] and start[one(" Paris")]
    assert not bw.unsafe_row("We went to com")[one("Paris")]  # "comParis": not at a word start
    strict = BannedWords(["Paris"], tok)  # the default: every occurrence, as "ofParis" would be
    assert strict.unsafe_row("We went to com")[one("Paris")] and strict.unsafe_row("the city of")[one("Paris")]
    assert strict.count("Paris, parisian; comparison") == 3
    assert bw.unsafe_row("anything")[one(" Paris")]  # a leading-space token carries the word inside
    assert bw.count("Paris, parisian; comparison") == 2
    for bad in ([], [""], ["  "]):
        with pytest.raises(InputError, match="banned words"):
            BannedWords(bad, tok)


def test_banned_word_never_emitted(toy_model):
    """A reward that pushes the pieces of 'Paris' up: unfiltered it appears often, filtered never."""
    tok = toy_model.tokenizer
    push = MultiObjective([Objective("push", lexicon_score(tok, ["paris", "par", "is", "pari", "s", "p", "aris"]), 9.0)])
    prompt = tok.encode(PROMPT)
    kernel = Kernel()

    def count(controllers):
        r = rollout(toy_model, prompt, batch=32, kernel=kernel, controllers=controllers, max_new_tokens=10, seed=3)
        text0 = tok.decode(prompt)
        hits = sum(occurrences(tok.decode(prompt + c), "paris", after=len(text0)) for c in r.tokens.tolist())
        return hits, r

    free, _ = count([push])
    safe, r = count([push, ban_words("Paris", tok)])
    assert free > 5 and safe == 0
    masses = [rec.removed_mass for recs in r.records for rec in recs if rec.controller == "safety"]
    assert len(masses) == 10 and all(len(m) == 32 and all(0 <= x <= 1 for x in m) for m in masses)
    assert max(max(m) for m in masses) > 0.1


def test_multi_token_word_blocked_across_tokens(toy_model):
    """Only the pieces 'Par' and 'is' may be emitted: the filter must stop 'Paris' forming across tokens."""
    tok = toy_model.tokenizer
    pieces = [tok.encode("Par")[0], tok.encode("is")[0], tok.encode(" Par")[0]]
    only = TokenMask(pieces + [tok.encode(",")[0]])
    steps = generate(toy_model, tok.encode("We"), kernel=Kernel(temperature=5.0), max_new_tokens=30, seed=1,
                     controllers=[only, ban_words("Paris", tok)])
    text = tok.decode(steps.generated_ids)
    assert "Par" in text and occurrences("We" + text, "paris") == 0
    acted = [c for s in steps.steps for c in s.control if c["controller"] == "safety"]
    assert acted and all(0 <= c["removed_mass"] <= 1 for c in acted)


def test_nothing_safe_left_is_recorded(toy_model):
    tok = toy_model.tokenizer
    only_banned = TokenMask([tok.encode(" Paris")[0]])
    out = generate(toy_model, tok.encode(PROMPT), kernel=Kernel(), max_new_tokens=3,
                   controllers=[only_banned, ban_words("Paris", tok)])
    (step,) = out.steps  # the fallback ends the text with the stop token
    assert step.stop and step.token == tok.eos_id
    rec = next(c for c in step.control if c["controller"] == "safety")
    assert rec["no_safe_token"] and rec["action"] == "stop" and math.isclose(rec["removed_mass"], 1.0, rel_tol=1e-6)
    with pytest.raises(NoSafeToken):
        generate(toy_model, tok.encode(PROMPT), max_new_tokens=1,
                 controllers=[only_banned, ban_words("Paris", tok, on_empty="raise")])
    passed = generate(toy_model, tok.encode(PROMPT), max_new_tokens=1,
                      controllers=[only_banned, ban_words("Paris", tok, on_empty="unfiltered")])
    assert passed.generated_ids == [tok.encode(" Paris")[0]]
    assert passed.steps[0].control[-1]["action"] == "unfiltered"


def test_hidden_state_barrier_keeps_successors_safe(toy_model):
    d = toy_model.config.d_model
    w = torch.randn(d, generator=torch.Generator().manual_seed(4))
    classifier = lambda h: h.float() @ w  # noqa: E731   h ≥ 0 on a half-space
    barrier = HiddenBarrier(toy_model, classifier, candidates=12)
    ids = toy_model.tokenizer.encode("The state")
    out = generate(toy_model, ids, kernel=Kernel(), max_new_tokens=5, seed=2, controllers=[SafetyFilter(barrier)])
    s = list(ids)
    point = residual_point(toy_model, toy_model.config.n_layer)
    for step in out.steps:
        s.append(step.token)
        if step.stop:
            break
        _, cache = toy_model.run_with_cache(torch.tensor([s]), names=[point])
        assert float(classifier(cache[point][0, -1])) >= 0 or any(c.get("no_safe_token") for c in step.control)


def test_registry_builds_by_name(toy_model):
    assert isinstance(make_controller("safety", BannedWords(["x"], toy_model.tokenizer)), SafetyFilter)
    with pytest.raises(InputError, match="controller 'pid'"):
        make_controller("pid")


# ---------------------------------------------------------------------- steering
def test_steering_vector_file_and_errors(toy_model, tmp_path):
    cv = contrast_vector(toy_model, ["I love it", "great and happy"], ["I hate it", "awful and sad"], layer=1)
    assert cv.vector.shape == (toy_model.config.d_model,) and cv.vector.norm() > 0
    path = tmp_path / "v.safetensors"
    cv.save(path)
    back = ContrastVector.load(path)
    assert torch.equal(back.vector, cv.vector) and back.layer == 1 and back.positive == cv.positive
    ids = torch.tensor([toy_model.tokenizer.encode(PROMPT)])
    with toy_model.hooks(Steering(back, scale=3.0).hooks(toy_model)):
        steered = toy_model(ids)
    assert not torch.allclose(steered, toy_model(ids))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a tensor file")
    with pytest.raises(InputError, match="corrupt"):
        ContrastVector.load(bad)
    with pytest.raises(InputError, match="not found"):
        ContrastVector.load(tmp_path / "missing.safetensors")
    with pytest.raises(InputError, match="width 7"):
        Steering(ContrastVector(torch.ones(7), 1)).hooks(toy_model)
    with pytest.raises(InputError, match="layer 9"):
        Steering(cv, layer=9).hooks(toy_model)
    with pytest.raises(InputError, match="finite"):
        Steering(cv, scale=float("inf"))


# ---------------------------------------------------------------------- agent
def test_agent_filters_free_text_not_the_call(smollm2, tmp_path):
    from hybridlm.agent import HybridAgent
    from hybridlm.engine.trace import read_trace
    from hybridlm.tools import registry
    from hybridlm.turns.codecs.tagged_json import CLOSE, OPEN
    from tests.agent_fakes import ScriptedModel

    tok = smollm2.tokenizer
    call = OPEN + json.dumps({"name": "calculator", "arguments": {"expression": "6 * 7"}}) + CLOSE
    model = ScriptedModel(tok, [call, "The result is 42, an expression."])
    path = tmp_path / "arc.jsonl"
    agent = HybridAgent(model, registry(["calculator"]), tool_choice="auto",
                        controllers=[ban_words("expression", tok)])
    arc = agent.run("6 times 7?", trace=path)
    assert arc.jumps and arc.jumps[0].arguments == {"expression": "6 * 7"}  # the grammar wins in the call
    assert occurrences(arc.answer, "expression") == 0 and "42" in arc.answer
    events = read_trace(path)
    controls = [e for e in events if e["event"] == "control"]
    assert controls and max(e["removed_mass"] for e in controls) > 0.99  # the scripted token carried all the mass
    assert next(e for e in events if e["event"] == "start")["control"][0]["words"] == ["expression"]


# ---------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def gen(toy_hub):
    def invoke(*args):
        return CliRunner().invoke(cli, ["generate", *args, "--model", str(toy_hub[0])])

    return invoke


def test_cli_ban(gen, toy_model):
    r = gen(PROMPT, "-n", "8", "--seed", "1", "--json", "--ban", "the,The, of")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert occurrences(out["text"], "the") == 0 and occurrences(out["text"], "of") == 0
    c = out["control"]
    assert c["controllers"][0]["words"] == ["the", "The", "of"] and len(c["per_step"]) == out["token_steps"]


def test_cli_steer(gen, toy_model, tmp_path):
    path = tmp_path / "s.safetensors"
    r = CliRunner().invoke(cli, ["steer", "build", "--pos", "happy day", "--neg", "sad day", "--layer", "1",
                                 "--out", str(path), "--model", str(toy_model.source)])
    assert r.exit_code == 0 and path.is_file(), r.output
    plain = json.loads(gen(PROMPT, "-n", "6", "--greedy", "--json").output)
    zero = json.loads(gen(PROMPT, "-n", "6", "--greedy", "--json", "--steer", str(path), "--steer-scale", "0").output)
    assert zero["generated_ids"] == plain["generated_ids"]
    big = gen(PROMPT, "-n", "6", "--greedy", "--json", "--steer", str(path), "--steer-scale", "50", "--steer-layer", "0")
    assert big.exit_code == 0, big.output


@pytest.mark.parametrize("args, message", [
    (["--ban", ""], "banned words"),
    (["--ban", " , "], "banned words"),
    (["--steer", "no/such/file.safetensors"], "not found"),
    (["--steer-scale", "2"], "--steer FILE"),
])
def test_cli_bad_control_input_exit_2(gen, args, message):
    r = gen(PROMPT, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_cli_bad_steer_file_exit_2(gen, tmp_path):
    wide = tmp_path / "wide.safetensors"
    ContrastVector(torch.ones(9), 1, "other").save(wide)
    good = tmp_path / "good.safetensors"
    ContrastVector(torch.ones(64), 1, "toy").save(good)
    for args, message in ([["--steer", str(wide)], "width 9"], [["--steer", str(good), "--steer-layer", "7"], "layer 7"],
                          [["--steer", str(good), "--steer-scale", "nan"], "finite"]):
        r = gen(PROMPT, *args)
        assert r.exit_code == 2 and message in r.output, r.output


def test_cli_agent_ban(smollm2):
    r = CliRunner().invoke(cli, ["agent", "Name the capital of France.", "--tool-choice", "none", "-n", "3",
                                 "--ban", "Paris", "--json"])
    assert r.exit_code == 0, r.output
    arc = json.loads(r.output)
    assert occurrences(arc["answer"], "paris") == 0
    assert all(c["controller"] == "safety" for c in arc["control"])
