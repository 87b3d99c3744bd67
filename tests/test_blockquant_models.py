"""The real Q4_K_M files (the registry's Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M) on their own
grid (`--precision gguf`, what `auto` picks for them): every matrix read as the file stores it
(BlockQuantLinear) against the float32 path on the same file's dequantised weights (gguf-py's bits,
the exact path). Greedy next tokens equal at each of 200 positions (teacher-forced: one prefill of
the text, every position's argmax), a token step's logits the same bits alone and in a batch, and
the model's memory about the file's size. Each file costs some seconds: marked slow."""

from __future__ import annotations

import gc

import pytest
import torch

from hybridlm.lm.blockquant import BlockQuantLinear
from hybridlm.lm.linear import Linear
from hybridlm.weights.loading import load_model

pytestmark = pytest.mark.slow

REAL = ("qwen2.5-coder-0.5b", "gemma-3-270m")
POSITIONS = 200
TEXT = ("def running_mean(values):\n    total = 0.0\n    count = 0\n    for value in values:\n"
        "        total += value\n        count += 1\n        yield total / count\n\n"
        "A hybrid dynamical system mixes two kinds of motion. Between events the state flows: a difference "
        "equation moves it forward in small steps. At an event the state jumps: a guard becomes true, a reset "
        "map takes the old state to a new one, and the flow resumes from there. A language model that calls "
        "tools can be read the same way: the cache is the state, the token clock drives the flow, and the tool "
        "call is the jump. The capital of France is Paris, the capital of Italy is Rome, and the capital of "
        "Japan is Tokyo. Water boils at one hundred degrees Celsius at sea level.")


def grid_model(name):
    from hybridlm.errors import ModelNotFoundError

    try:
        return load_model(name, precision="auto")
    except ModelNotFoundError as exc:
        pytest.skip(f"{name}: {exc}")


@pytest.mark.parametrize("name", REAL)
def test_file_grid_greedy_equals_float32(name):
    model = grid_model(name)
    assert model.precision == "gguf"
    maps = [m for m in model.modules() if isinstance(m, (BlockQuantLinear, Linear))]
    assert maps and all(isinstance(m, BlockQuantLinear) for m in maps)  # every matrix of a Q4_K_M file has a kernel
    grids = {id(m): m for m in maps}.values()  # (a tied embedding is also the readout: once)
    held = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for m in grids for t in m.segments())
    assert held < 1.05 * model.gguf_path.stat().st_size  # no float32 copy of any matrix (rotary tables aside)
    ids = model.tokenizer.encode(TEXT)
    while len(ids) < POSITIONS:
        ids = ids + ids
    ids = torch.tensor([ids[:POSITIONS]])
    with torch.no_grad():
        grid = model(ids)[0]
    del model
    gc.collect()
    exact = load_model(name, precision="float32")
    assert exact.precision == "float32"
    with torch.no_grad():
        z = exact(ids)[0]
    assert torch.equal(grid.argmax(-1), z.argmax(-1))
    # the grid's product reads x in 16 bits a group: within a small fraction of the logits' spread
    assert float((grid - z).abs().max()) < 0.02 * float(z.std(-1).mean()) * 10


@pytest.mark.parametrize("name", REAL)
def test_file_grid_batch_invariant(name):
    """A token step of three states alone and in one batch: the same logits, bit for bit."""
    model = grid_model(name)
    prompts = [model.tokenizer.encode(t) for t in ("The capital of France is", "def f(x):\n    return",
                                                   "Water boils at one hundred")]
    alone, together = [], []
    for p in prompts:
        x = model.init_state(torch.tensor(p))
        model.step([x], [p[-1]])
        alone.append(x.logits)
    states = [model.init_state(torch.tensor(p)) for p in prompts]
    model.step(states, [p[-1] for p in prompts])
    together = [x.logits for x in states]
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", REAL)
def test_file_grid_token_steps_are_the_exact_greedy_path(name, monkeypatch):
    """200 greedy token steps on the grid (the compiled token step: Gemma's QK-norm, post-norms,
    GeGLU and two rotary bases included) against the float32 path on the dequantised weights, one
    prefill of the same text: each generated token is the exact path's argmax at its position."""
    from hybridlm.lm import kernels

    model = grid_model(name)
    calls: list[int] = []
    monkeypatch.setattr(kernels.BlockKernel, "blocks",
                        lambda self, *a, _f=kernels.BlockKernel.blocks, **k: calls.append(a[1]) or _f(self, *a, **k))
    prompt = model.tokenizer.encode(TEXT)[:24]
    x = model.init_state(torch.tensor(prompt), capacity=len(prompt) + POSITIONS)
    tokens = []
    for _ in range(POSITIONS):
        tokens.append(int(model.G(x)[0].argmax()))
        model.F(x, [tokens[-1]])
    assert kernels.blocks() is None or calls.count(model.config.n_layer) == POSITIONS  # every step whole
    del model
    gc.collect()
    exact = load_model(name, precision="float32")
    with torch.no_grad():
        z = exact(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
    assert z.argmax(-1).tolist() == tokens
