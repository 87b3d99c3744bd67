"""The two real models of the registry (Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M, Q4_K_M GGUF
files assembled from registry packages: the real-models extra) against independent readers of the
same file: llama.cpp (llama-cpp-python), and transformers where it reads the family correctly
(both here: checked below at 1e-3).

llama.cpp computes with the file's quantised blocks and 8-bit quantised activations; hybridlm with
the dequantised weights in float32 (as transformers does). On a token where the model's two
leading logits lie closer than that arithmetic's error, the two disagree; the control runs llama.cpp
on its own float32 dequantisation of the same file (its quantiser's `F32` type), where they agree
on every position. Each real file costs a few GB of memory and about a minute: marked slow."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridlm.weights.gguf import load_gguf_model

pytestmark = pytest.mark.slow

#: The text the agreement is measured on: prose, a short program and plain facts (501 tokens of both
#: vocabularies, BOS included).
TEXT = """A hybrid dynamical system mixes two kinds of motion. Between events the state flows: a \
differential or difference equation moves it forward in small steps, and nothing surprising happens. At an \
event the state jumps: a guard becomes true, a reset map takes the old state to a new one, and the flow \
resumes from there. A bouncing ball is the classic example. While the ball is in the air its height and \
velocity follow Newton's law; when the height reaches zero and the velocity points down, the velocity is \
reversed and shrunk by a coefficient of restitution, and the ball rises again.

A language model that calls tools can be read the same way. Each generated token is one step of a discrete \
flow: the model reads its cache of keys and values, produces a distribution over the next token, and a \
sampler picks one. When the text it has written forms a complete call, such as a request to a search engine \
or a calculator, generation pauses. An external system runs, its answer is appended to the context, and \
generation continues from the new state. The cache is the state; the token clock drives the flow; the tool \
call is the jump.

Here is a small function that computes the running mean of a stream of numbers without storing them:

def running_mean(values):
    total = 0.0
    count = 0
    for value in values:
        total += value
        count += 1
        yield total / count

Calling list(running_mean([2, 4, 6, 8])) returns [2.0, 3.0, 4.0, 5.0], because each output is the average \
of everything seen so far. The same idea, applied to vectors, gives the exponential moving averages that \
optimisers keep for every parameter of a network.

Why write the system this way? Because every index becomes visible. One can record the state at each token \
step, at each jump, at each layer and each attention head, and replay the whole trajectory later. One can ask \
how long the model spends in the generation mode before it calls a tool, how often the tool's answer changes \
what it writes next, and whether small changes to the prompt move the trajectory far or only a little. \
Engineers who build agents want these answers, and researchers who study how models compute want the same \
records for other reasons.

The capital of France is Paris, the capital of Italy is Rome, and the capital of Japan is Tokyo. Water boils \
at one hundred degrees Celsius at sea level, and the speed of light in vacuum is close to three hundred \
thousand kilometres per second. These facts are easy for a model to continue, while the code above and the \
reasoning about hybrid systems are harder, so the text mixes predictable and unpredictable passages.
"""
POSITIONS = 501
REAL = ("qwen2.5-coder-0.5b", "gemma-3-270m")


def real_path(name):
    from hybridlm.errors import ModelNotFoundError
    from hybridlm.weights.registry import real_model_path

    try:
        return real_model_path(name)
    except ModelNotFoundError as exc:
        pytest.skip(f"{name}: {exc}")


_LLAMA = """
import json, sys, numpy as np, llama_cpp
path, out, n, text = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(path, logits_all=True, n_ctx=1024, n_batch=512, n_threads=2, verbose=False)
ids = llm.tokenize(text.encode(), add_bos=True, special=False)[:n]
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
print(json.dumps(ids))
"""


def llama_cpp_logits(path, tmp_path, text=TEXT, n=POSITIONS):
    """(token ids, logits [n, V]) of llama.cpp on the file: llama.cpp's tokenizer and its evaluation of
    every position, in a process of its own (its memory returns when it ends)."""
    import json

    pytest.importorskip("llama_cpp")
    out = tmp_path / f"{path.stem}.npy"
    done = subprocess.run([sys.executable, "-c", _LLAMA, str(path), str(out), str(n), text], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(out)


def as_f32(path, out):
    """llama.cpp's own float32 dequantisation of a file (its quantiser, type ALL_F32)."""
    code = ("import ctypes, sys, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); "
            "p.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32; p.allow_requantize = True; p.nthread = 2; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(out)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def ours(path):
    # Gemma's SentencePiece vocabulary is read by hybridlm.weights.vocab; the agreement is measured on
    # llama.cpp's token ids either way
    return load_gguf_model(path, tokenizer="gemma" not in path.name)


def agreement(model, ids, reference):
    with torch.no_grad():
        z = model(torch.tensor([ids]))[0].numpy()
    return float((z.argmax(-1) == reference.argmax(-1)).mean()), float(np.abs(z - reference).max())


def disagreements(model, ids, reference):
    """Per position where the two top-1 tokens differ: llama.cpp's own margin between its choice and ours;
    and the mean |Δlogit| over every position and token (the size of the two arithmetics' difference)."""
    with torch.no_grad():
        z = model(torch.tensor([ids]))[0].numpy()
    ours, theirs = z.argmax(-1), reference.argmax(-1)
    at = np.flatnonzero(ours != theirs)
    margins = reference[at, theirs[at]] - reference[at, ours[at]]
    return margins, float(np.abs(z - reference).mean())


# The share depends on the host: llama.cpp's kernels (AVX2 or AVX-512, repacked or not) round its
# 8-bit products differently (on an AVX-512 Xeon 98.6 % and 96.6 %; on an AVX2 EPYC 97.4 % and 95.0 %).
# What does not depend on it: a disagreement is a near-tie of llama.cpp's own two leading logits, far
# below the median top-two margin (~0.9 on both models), within a few times the logits' mean difference.
@pytest.mark.parametrize("name, least", [("qwen2.5-coder-0.5b", 0.96), ("gemma-3-270m", 0.94)])
def test_top1_agreement_with_llama_cpp_on_the_same_file(name, least, tmp_path):
    path = real_path(name)
    ids, reference = llama_cpp_logits(path, tmp_path)
    assert len(ids) == POSITIONS
    model = ours(path)
    margins, mean_diff = disagreements(model, ids, reference)
    share = 1 - len(margins) / len(ids)
    print(f"{name}: top-1 agreement with llama.cpp {share:.2%} over {len(ids)} positions; llama.cpp's margin at "
          f"the disagreements ≤ {margins.max(initial=0):.3f}, mean |Δlogit| {mean_diff:.3f}")
    assert share >= least
    assert (margins <= 3 * mean_diff).all(), sorted(margins.tolist())


def test_gemma_agrees_everywhere_with_llama_cpp_on_float32_weights(tmp_path):
    """The control: llama.cpp on its float32 dequantisation of the Gemma file (no quantised arithmetic)."""
    path = real_path("gemma-3-270m")
    f32 = as_f32(path, tmp_path / "gemma-f32.gguf")
    ids, reference = llama_cpp_logits(f32, tmp_path)
    share, worst = agreement(ours(path), ids, reference)
    print(f"gemma-3-270m vs llama.cpp on F32: top-1 agreement {share:.2%}, max |Δlogit| {worst:.3f}")
    assert share >= 0.995 and worst <= 0.1


@pytest.mark.parametrize("name", REAL)
def test_logits_match_transformers_reading_the_same_gguf(name, tmp_path):
    """transformers reads qwen2 and gemma3 GGUF files itself (gguf-py's dequantisation): 64 tokens."""
    from transformers import AutoModelForCausalLM

    path = real_path(name)
    ids, _ = llama_cpp_logits(path, tmp_path, n=64)
    with torch.no_grad():
        z = ours(path)(torch.tensor([ids]))[0]
        gc.collect()
        ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        delta = (z - ref(torch.tensor([ids])).logits[0]).abs().max().item()
    print(f"{name}: max |Δlogit| against transformers on the same GGUF = {delta:.2e}")
    assert delta <= 1e-3


def test_models_lists_the_real_files_with_their_grid():
    from hybridlm.weights.loading import available_models

    for name in REAL:
        real_path(name)
    rows = {r["name"]: r for r in available_models()}
    for name in REAL:
        assert rows[name]["available"] and rows[name]["grid"].startswith("Q4_K_M: ")
        assert "Q4_K ×" in rows[name]["grid"] and "Q6_K ×" in rows[name]["grid"]


# ---------------------------------------------------------------------- the Qwen file in use
@pytest.fixture(scope="module")
def qwen():
    from hybridlm import load_model

    real_path("qwen2.5-coder-0.5b")
    return load_model("qwen2.5-coder-0.5b")


def test_qwen_chat_answers_paris(qwen):
    tok = qwen.tokenizer
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    x = qwen.init_state(prompt)
    answer = []
    for _ in range(24):
        w = int(qwen.G(x)[0].argmax())
        if w in tok.stop_ids():
            break
        answer.append(w)
        qwen.F(x, [w])
    text = tok.decode(answer)
    print(f"Qwen: {text!r}")
    assert "Paris" in text


def test_consensus_experiment_runs_on_qwen(tmp_path):
    import math

    from hybridlm.analysis.runner import ConsensusConfig, read_rows, run_consensus

    real_path("qwen2.5-coder-0.5b")
    run_consensus(ConsensusConfig(model="qwen2.5-coder-0.5b", prompts=2, prompt_len=12, passes=1,
                                  attention_only=True), tmp_path / "run", progress=False)
    rows = read_rows(tmp_path / "run")
    assert len(rows) == 24 + 1 and all(math.isfinite(float(r["E_mean"])) for r in rows)  # E after every layer-step


def test_a_capture_records_every_layer_of_qwen(qwen):
    from hybridlm.lm.capture import Recorder

    ids = torch.tensor([qwen.tokenizer.encode("def add(a, b):\n    return a + b")])
    rec = Recorder(qwen, lambda n: n.endswith(("hook_resid_post", "attn.hook_pattern")))
    with qwen.hooks(rec.hooks()):
        x = qwen.init_state(ids)
        qwen.F(x, [int(qwen.G(x)[0].argmax())])
    L = qwen.config.n_layer
    assert sum(k.endswith("hook_resid_post@0") for k in rec.records) == L  # the prefill
    assert sum(k.endswith("hook_resid_post@1") for k in rec.records) == L  # the decode step
    pattern = rec.records["blocks.0.attn.hook_pattern@0"]
    assert pattern.shape[1] == qwen.config.n_head and torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)


def test_a_steering_input_moves_qwen(qwen):
    from hybridlm.control.steering import Steering, contrast_vector

    cv = contrast_vector(qwen, ["I love this, it is wonderful"], ["I hate this, it is awful"], layer=12)
    ids = torch.tensor([qwen.tokenizer.encode("The weather today is")])
    with torch.no_grad():
        plain = qwen(ids)[0, -1]
        with qwen.hooks(Steering(cv, scale=4.0).hooks(qwen)):
            steered = qwen(ids)[0, -1]
    assert cv.vector.shape == (qwen.config.d_model,) and (steered - plain).abs().max() > 0.1
