"""The model hub's file layouts: `config.json` + `model.safetensors` (or shards listed in
`model.safetensors.index.json`).

The families of `hybridlm.weights.families` (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3) are read
through the family registry, which gives the config and places each tensor; their tokenizer
comes from the folder's `tokenizer.json` (`hybridlm.weights.vocab`). GPT-2 and GPT-Neo keep
their own layouts below.

`config.json`'s model_type ("gpt2" | "gpt_neo") picks the layout. The hub stores GPT-2's
projections as Conv1D weights of shape [in, out] (y = x W + b); hybridlm's linear maps
are [out, in] (y = x Wᵀ + b), so those matrices are transposed on the way in and out.
GPT-Neo uses [out, in] linear maps already, with separate q/k/v projections that are
stacked into our W_qkv. Buffers the hub keeps beside the weights (the causal masks
`attn.bias`, `attn.attention.bias`) carry no parameters and are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hybridlm.lm.config import MAX_SIZES, ModelConfig
from hybridlm.errors import ConfigError, ModelNotFoundError, WeightsError
from hybridlm.lm.model import DecoderLM
from hybridlm.weights.checks import assemble
from hybridlm.weights.tensorfile import LazyWeights, check_safetensors_header
from hybridlm.weights.families import HF_TYPES, hub_field, MappedWeights, hf_config, hf_family, plan

#: Hub repository of each preset, for users with a network.
HUB_REPOS: dict[str, str] = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "gpt-neo-125m": "EleutherAI/gpt-neo-125m",
    "gpt-neo-1.3b": "EleutherAI/gpt-neo-1.3B",
    "gpt-neo-2.7b": "EleutherAI/gpt-neo-2.7B",
}

MAX_CONFIG_BYTES = 4 << 20  # hub config.json files are a few KB


def gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    """Read a hub `config.json` of a GPT2LMHeadModel, field by field."""
    _require_tanh_gelu(hf, "GPT-2")
    d_model = hub_field(hf, "n_embd", "positive int")
    return ModelConfig(
        family="gpt2",
        vocab_size=hub_field(hf, "vocab_size", "positive int"),
        n_ctx=hub_field(hf, "n_positions", "positive int", None) or hub_field(hf, "n_ctx", "positive int", 1024),
        d_model=d_model,
        n_layer=hub_field(hf, "n_layer", "positive int"),
        n_head=hub_field(hf, "n_head", "positive int"),
        d_mlp=hub_field(hf, "n_inner", "positive int", None) or 4 * d_model,
        norm_eps=hub_field(hf, "layer_norm_epsilon", "number", 1e-5),
        bos_token_id=hub_field(hf, "bos_token_id", "id", None),
        eos_token_id=hub_field(hf, "eos_token_id", "id", None),
        init_std=hub_field(hf, "initializer_range", "number", 0.02),
    )

def gpt2_hub_config(cfg: ModelConfig) -> dict[str, Any]:
    """The hub `config.json` for this configuration (GPT-2 family only)."""
    if cfg.family != "gpt2":
        raise ConfigError(f"gpt2_hub_config needs a gpt2-family config, got {cfg.family!r}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_ctx,
        "n_ctx": cfg.n_ctx,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_mlp,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "bos_token_id": cfg.bos_token_id if cfg.bos_token_id is not None else 50256,
        "eos_token_id": cfg.eos_token_id if cfg.eos_token_id is not None else 50256,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
    }

def gptneo_config(hf: dict[str, Any]) -> ModelConfig:
    """Read a hub `config.json` of a GPTNeoForCausalLM (model_type "gpt_neo"), field by field."""
    _require_tanh_gelu(hf, "GPT-Neo")
    if not hub_field(hf, "tie_word_embeddings", "bool", True):
        raise ConfigError("config.json has tie_word_embeddings=false: hybridlm reads tied GPT-Neo checkpoints only")
    d_model = hub_field(hf, "hidden_size", "positive int")
    if "attention_types" not in hf:
        raise ConfigError("config.json lacks the field 'attention_types'")
    return ModelConfig(
        family="gpt-neo",
        vocab_size=hub_field(hf, "vocab_size", "positive int"),
        n_ctx=hub_field(hf, "max_position_embeddings", "positive int", 2048),
        d_model=d_model,
        n_layer=hub_field(hf, "num_layers", "positive int"),
        n_head=hub_field(hf, "num_heads", "positive int"),
        d_mlp=hub_field(hf, "intermediate_size", "positive int", None) or 4 * d_model,
        norm_eps=hub_field(hf, "layer_norm_epsilon", "number", 1e-5),
        attn_bias=False,
        attn_scale=1.0,
        attention_layers=_expand_attention_types(hf["attention_types"]),
        local_window=hub_field(hf, "window_size", "positive int", 256),
        bos_token_id=hub_field(hf, "bos_token_id", "id", None),
        eos_token_id=hub_field(hf, "eos_token_id", "id", None),
        init_std=hub_field(hf, "initializer_range", "number", 0.02),
    )

def gptneo_hub_config(cfg: ModelConfig) -> dict[str, Any]:
    """The hub `config.json` for this configuration (GPT-Neo family only)."""
    if cfg.family != "gpt-neo":
        raise ConfigError(f"gptneo_hub_config needs a gpt-neo-family config, got {cfg.family!r}")
    fixed = dict(norm="layernorm", positions="learned", mlp="gelu", attn_bias=False, attn_out_bias=True,
                 mlp_bias=True, tie_embeddings=True, attn_scale=1.0, n_kv_head=cfg.n_head)
    differs = {k: getattr(cfg, k) for k, v in fixed.items() if getattr(cfg, k) != v}
    if differs:
        raise ConfigError(f"GPT-Neo's hub layout cannot express {differs}; it fixes {fixed}")
    layers = cfg.attention_layers or ("global",) * cfg.n_layer
    period = next(p for p in range(1, len(layers) + 1)
                  if len(layers) % p == 0 and layers == layers[:p] * (len(layers) // p))
    return {
        "architectures": ["GPTNeoForCausalLM"],
        "model_type": "gpt_neo",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.n_ctx,
        "hidden_size": cfg.d_model,
        "num_layers": cfg.n_layer,
        "num_heads": cfg.n_head,
        "intermediate_size": cfg.d_mlp,
        "attention_types": [[list(layers[:period]), len(layers) // period]],
        "window_size": cfg.local_window,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "bos_token_id": cfg.bos_token_id if cfg.bos_token_id is not None else 50256,
        "eos_token_id": cfg.eos_token_id if cfg.eos_token_id is not None else 50256,
        "resid_dropout": 0.0,
        "embed_dropout": 0.0,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
    }




def _expand_attention_types(types: Any) -> tuple[str, ...]:
    """GPT-Neo's [[["global", "local"], 6]] (a pattern and its repeat count) → one entry per block."""
    try:
        layers: list[str] = []
        for pattern, repeat in types:
            if (isinstance(pattern, str) or isinstance(repeat, bool) or not isinstance(repeat, int)
                    or not all(isinstance(p, str) for p in pattern)):
                raise TypeError
            if len(layers) + len(pattern) * repeat > MAX_SIZES["n_layer"]:
                raise ValueError
            layers += list(pattern) * repeat
        return tuple(layers)
    except (TypeError, ValueError):
        raise ConfigError(
            f"attention_types={types!r} in config.json: expected [[pattern, repeats], ...], "
            'e.g. [[["global", "local"], 6]]'
        ) from None


def _require_tanh_gelu(hf: dict[str, Any], family: str) -> None:
    act = hub_field(hf, "activation_function", "str", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"activation_function={act!r} in config.json: hybridlm's {family} family uses the "
            "tanh form of GELU ('gelu_new')"
        )


# hub name (after the optional "transformer." prefix) → (our name, transpose)
_GLOBAL = {"wte.weight": ("W_e", False), "wpe.weight": ("pos_embed.W_p", False),
           "ln_f.weight": ("ln_final.weight", False), "ln_f.bias": ("ln_final.bias", False)}
_NORMS = {"ln_1.weight": ("ln1.weight", False), "ln_1.bias": ("ln1.bias", False),
          "ln_2.weight": ("ln2.weight", False), "ln_2.bias": ("ln2.bias", False)}


@dataclass(frozen=True)
class Layout:
    """One family's hub layout: config.json ↔ ModelConfig, and tensor names inside block h.{i}."""

    model_type: str
    family: str
    block: dict[str, tuple[str, bool]]
    skip: tuple[str, ...]  # suffixes of buffers and tied copies that carry no parameters
    read_config: Callable[[dict], ModelConfig]
    write_config: Callable[[ModelConfig], dict]
    split_qkv: str | None = None  # block prefix of separate q_proj/k_proj/v_proj, stacked into W_qkv


GPT2 = Layout(
    model_type="gpt2",
    family="gpt2",
    block={
        **_NORMS,  # Conv1D weights: [in, out]
        "attn.c_attn.weight": ("attn.W_qkv.weight", True), "attn.c_attn.bias": ("attn.W_qkv.bias", False),
        "attn.c_proj.weight": ("attn.W_O.weight", True), "attn.c_proj.bias": ("attn.W_O.bias", False),
        "mlp.c_fc.weight": ("mlp.W_fc.weight", True), "mlp.c_fc.bias": ("mlp.W_fc.bias", False),
        "mlp.c_proj.weight": ("mlp.W_proj.weight", True), "mlp.c_proj.bias": ("mlp.W_proj.bias", False),
    },
    skip=(".attn.bias", ".attn.masked_bias", "lm_head.weight"),
    read_config=gpt2_config,
    write_config=gpt2_hub_config,
)

GPT_NEO = Layout(
    model_type="gpt_neo",
    family="gpt-neo",
    block={
        **_NORMS,  # nn.Linear weights: [out, in], as ours
        "attn.attention.qkv_proj.weight": ("attn.W_qkv.weight", False),  # q_proj, k_proj, v_proj stacked
        "attn.attention.out_proj.weight": ("attn.W_O.weight", False),
        "attn.attention.out_proj.bias": ("attn.W_O.bias", False),
        "mlp.c_fc.weight": ("mlp.W_fc.weight", False), "mlp.c_fc.bias": ("mlp.W_fc.bias", False),
        "mlp.c_proj.weight": ("mlp.W_proj.weight", False), "mlp.c_proj.bias": ("mlp.W_proj.bias", False),
    },
    skip=(".attn.attention.bias", ".attn.attention.masked_bias", "lm_head.weight"),
    read_config=gptneo_config,
    write_config=gptneo_hub_config,
    split_qkv="attn.attention.",
)

LAYOUTS = {layout.model_type: layout for layout in (GPT2, GPT_NEO)}


def hub_to_ours(name: str, layout: Layout = GPT2) -> tuple[str, bool] | None:
    """Map a hub tensor name to (our parameter name, transpose?), or None for skipped buffers."""
    name = name.removeprefix("transformer.")
    if name in _GLOBAL:
        return _GLOBAL[name]
    if name.endswith(layout.skip):
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "h" and parts[1].isdigit() and parts[2] in layout.block:
        ours, transpose = layout.block[parts[2]]
        return f"blocks.{parts[1]}.{ours}", transpose
    raise WeightsError(f"unexpected tensor {name!r} in a {layout.model_type} checkpoint")


def _stack_qkv(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Replace each block's {q,k,v}_proj.weight by their row stack qkv_proj.weight (= our W_qkv)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(f"{prefix}q_proj.weight")]:
        stem = name.removesuffix("q_proj.weight")
        try:
            out[f"{stem}qkv_proj.weight"] = torch.cat([out.pop(f"{stem}{x}_proj.weight") for x in "qkv"])
        except KeyError as exc:
            raise WeightsError(f"checkpoint has {name!r} but lacks {exc.args[0]!r}") from None
    return out


def _unstack_qkv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith("qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            out.update({f"{stem}{x}_proj.weight": part.contiguous() for x, part in zip("qkv", t.chunk(3))})
        else:
            out[name] = t
    return out


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f}: no such weights file")
        check_safetensors_header(f)
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except (SafetensorError, OSError) as exc:  # safetensors raises its own error type for every defect
            raise WeightsError(f"{f}: not a readable safetensors file ({exc}); is it truncated or corrupt?") from None
    return tensors


def weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise WeightsError(f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"{index}: weight_map is not an object {{tensor: shard file name}}")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard or shard in (".", ".."):
                raise WeightsError(f"{index}: shard {shard[:80]!r} is outside the folder: expected a file name")
        return [folder / s for s in shards]
    present = sorted(p.name for p in folder.iterdir())[:10]
    raise WeightsError(
        f"{folder} holds no weights: expected model.safetensors (or a sharded "
        f"model.safetensors.index.json) beside config.json; found {present}"
    )


def read_config_json(cfg_file: Path) -> dict[str, Any]:
    """config.json as a JSON object, its size and nesting bounded."""
    size = cfg_file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise WeightsError(f"{cfg_file}: {size:,} bytes; a config.json holds at most {MAX_CONFIG_BYTES:,}")
    try:
        hf = json.loads(cfg_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise WeightsError(f"{cfg_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise WeightsError(f"{cfg_file}: not valid JSON ({exc})") from None
    except RecursionError:
        raise WeightsError(f"{cfg_file}: JSON nested too deep to be a model config") from None
    if not isinstance(hf, dict):
        raise WeightsError(f"{cfg_file}: a JSON {type(hf).__name__}; expected a JSON object of config fields")
    return hf


def load_hub_folder(folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    tokenizer: bool = True) -> DecoderLM:
    """Read a folder in the hub layout of any supported model_type (GPT-2, GPT-Neo, and the families
    of `hybridlm.weights.families`, whose tokenizer the folder gives unless `tokenizer=False`)."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise WeightsError(f"{folder} has no config.json: expected the hub layout (config.json + model.safetensors)")
    hf = read_config_json(cfg_file)
    model_type = hf.get("model_type", "gpt2")
    family = hf_family(model_type)
    if family is not None:
        return _load_family_folder(folder, family, hf, dtype=dtype, tokenizer=tokenizer)
    if not isinstance(model_type, str) or model_type not in LAYOUTS:
        shown = repr(model_type) if isinstance(model_type, str) else f"{str(model_type)[:20]} (a {type(model_type).__name__})"
        raise ConfigError(
            f"{cfg_file}: model_type {shown} is not supported (expected one of {sorted([*LAYOUTS, *HF_TYPES])})"
        )
    layout = LAYOUTS[model_type]
    try:
        cfg = layout.read_config(hf)
    except ConfigError as exc:
        raise ConfigError(f"{folder}/{exc}" if str(exc).startswith("config.json") else f"{cfg_file}: {exc}") from None
    tensors = read_safetensors(weight_files(folder))
    if layout.split_qkv:
        tensors = _stack_qkv(tensors, layout.split_qkv)
    weights = {}
    for name, t in tensors.items():
        target = hub_to_ours(name, layout)
        if target is not None:
            key, transpose = target
            weights[key] = t.T if transpose else t
    model = assemble(cfg, weights, None, origin=str(folder))
    model.source = str(folder)
    return model.to(dtype)


def _load_family_folder(folder: Path, family, hf: dict, *, dtype: torch.dtype, tokenizer: bool) -> DecoderLM:
    """A folder of a registry family: config, then every shard's header and every tensor's name and
    shape checked, then the tokenizer, then the weights, one tensor at a time."""
    try:
        cfg = hf_config(family, hf)
    except ConfigError as exc:
        raise ConfigError(f"{folder}/{exc}" if str(exc).startswith("config.json") else f"{folder}: {exc}") from None
    with contextlib.ExitStack() as stack:
        where: dict[str, LazyWeights] = {}
        files: dict[str, str] = {}
        for file in weight_files(folder):
            if not file.is_file():
                raise WeightsError(f"{file}: no such weights file (named by model.safetensors.index.json)")
            shard = stack.enter_context(LazyWeights(file))  # (its header checked against the file's size)
            for name in shard:
                if name in where:
                    raise WeightsError(f"{folder}: tensor {name!r} is in two shards, {files[name]} and {file.name}")
                where[name], files[name] = shard, file.name
        shapes = {name: shard.shape(name) for name, shard in where.items()}
        sources = plan(family, cfg, shapes, gguf=False, origin=str(folder), prefix="model.")
        tok = None
        if tokenizer:
            from hybridlm.weights.vocab import tokenizer_from_folder

            tok = tokenizer_from_folder(folder, vocab_size=cfg.vocab_size)
        weights = MappedWeights(sources, shapes, lambda name: where[name][name])
        model = assemble(cfg, weights, tok, origin=str(folder))
    model.source = str(folder)
    return model.to(dtype)


#: The historical name: it reads every supported layout, GPT-2's included.
load_gpt2_folder = load_hub_folder


def save_hub_folder(model: DecoderLM, folder: str | os.PathLike) -> Path:
    """Write a GPT-2- or GPT-Neo-family model in its hub layout (readable by transformers)."""
    folder = Path(folder)
    cfg = model.config
    layout = next((lay for lay in LAYOUTS.values() if lay.family == cfg.family), None)
    if layout is None:
        raise ConfigError(f"no hub layout for family {cfg.family!r}; known: {[lay.family for lay in LAYOUTS.values()]}")
    hf_config = layout.write_config(cfg)
    inverse = {v[0]: (k, v[1]) for k, v in _GLOBAL.items()}
    block_inverse = {v[0]: (k, v[1]) for k, v in layout.block.items()}
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            _, layer, rest = name.split(".", 2)
            hub, transpose = block_inverse[rest]
            hub = f"h.{layer}.{hub}"
        else:
            hub, transpose = inverse[name]
        t = p.detach().float().cpu()
        tensors[f"transformer.{hub}"] = (t.T if transpose else t).contiguous()
    if layout.split_qkv:
        tensors = _unstack_qkv(tensors)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


#: The historical name: it writes the layout of the model's family.
save_gpt2_folder = save_hub_folder


def fetch_from_hub(name: str) -> Path:
    """Find a preset's files in the local hub cache, or download them when a network exists."""
    repo = HUB_REPOS[name]
    patterns = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]
    from huggingface_hub import snapshot_download

    for local_only in (True, False):
        if not local_only and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            break
        try:
            return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=local_only))
        except Exception:  # noqa: BLE001 - not cached, offline, refused, ...: each is the one error below
            continue
    raise ModelNotFoundError(
        f"could not get the weights of {name!r} ({repo}): not in the local hub cache and the hub is "
        f"unreachable. Download config.json and model.safetensors of {repo} on a machine with a network "
        f"and pass the folder: --model /path/to/{name} (or load_model('/path/to/{name}')). "
        f"For random weights of the same shape use --model random:{name}."
    )
