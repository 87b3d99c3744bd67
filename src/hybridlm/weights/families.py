"""The family registry: for each model family hybridlm reads, how its Hugging Face `config.json`
fields and its GGUF metadata keys give a `ModelConfig`, and how its tensor names map onto the
parts of `DecoderLM` (TransformerLens and vLLM keep such a table; so does llama.cpp's converter).

A family is data, not a fork of the model: each entry below fixes some `ModelConfig` fields (its
parts: norm, MLP, biases, QK-norm, post-sublayer norms ...), reads the rest from the file, and names
the file's tensors that make up each of the model's. The readers of the formats
(`hybridlm.weights.gguf`, `hybridlm.weights.hub`) stay generic: they hand this module a
config.json object or a GGUF metadata table, and the file's tensor names and shapes.

Tensors. Each of the model's matrices is the row stack of one or more of the file's (W_qkv = [W_Q;
W_K; W_V], W_gate_up = [W_gate; W_up]); a family whose file already stacks them (Phi-3) names one
tensor. Two transformations are the family's too:
- llama.cpp stores Llama's W_Q and W_K (and their biases) with the rotary pairs of each head
  interleaved, rows (2i, 2i+1); the model rotates the pairs (i, i + d_k/2) (`positions.Rotary`), so
  those rows are put back in that order (`rows`, a permutation). Every other GGUF architecture here
  keeps the Hugging Face order (llama.cpp's NeoX rotation).
- Gemma's checkpoints store each RMSNorm gain as γ − 1 (the norm multiplies by 1 + w); llama.cpp's
  converter adds the 1, so a Gemma GGUF holds γ and a Gemma folder gets 1 added here.

Rotary frequencies. Every rescaling a family applies (Llama 3's `llama3`, `linear`, Phi-3's
`longrope`) becomes per-pair divisors f_j of θ_j (`ModelConfig.rope_freq_factors`), as llama.cpp's
`rope_freqs` tensor stores Llama 3's; Phi-3's long factors are chosen when the context T exceeds
the original one (as llama.cpp chooses them by its context size; transformers switches by the
length of each call). Other rescalings (YaRN, dynamic NTK) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridlm.errors import ConfigError, HybridLMError, WeightsError
from hybridlm.lm.config import ModelConfig, check_sizes

_MISSING = object()

# ====================================================================== tensor names
#: Our module path inside a block → (GGUF tensor stems, Hugging Face tensor stems), for the Llama
#: layout every family here starts from. The stems stack by rows in the order given.
LLAMA_BLOCK = {
    "ln1": (("attn_norm",), ("input_layernorm",)),
    "attn.W_qkv": (("attn_q", "attn_k", "attn_v"), ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "attn.W_O": (("attn_output",), ("self_attn.o_proj",)),
    "attn.q_norm": (("attn_q_norm",), ("self_attn.q_norm",)),
    "attn.k_norm": (("attn_k_norm",), ("self_attn.k_norm",)),
    "ln2": (("ffn_norm",), ("post_attention_layernorm",)),
    "mlp.W_gate_up": (("ffn_gate", "ffn_up"), ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.W_down": (("ffn_down",), ("mlp.down_proj",)),
}
#: Phi-3 stores W_qkv and W_gate_up already stacked.
PHI3_BLOCK = {**LLAMA_BLOCK, "attn.W_qkv": (("attn_qkv",), ("self_attn.qkv_proj",)),
              "mlp.W_gate_up": (("ffn_up",), ("mlp.gate_up_proj",))}
#: Gemma 2/3 norm each sublayer's output too; their `post_attention_layernorm` is that norm, not LN₂.
GEMMA_BLOCK = {**LLAMA_BLOCK, "ln1_post": (("post_attention_norm",), ("post_attention_layernorm",)),
               "ln2": (("ffn_norm",), ("pre_feedforward_layernorm",)),
               "ln2_post": (("post_ffw_norm",), ("post_feedforward_layernorm",))}
#: Our global tensors → (GGUF name, Hugging Face name).
GLOBAL = {"W_e": ("token_embd.weight", "model.embed_tokens.weight"),
          "ln_final.weight": ("output_norm.weight", "model.norm.weight"),
          "W_u": ("output.weight", "lm_head.weight")}
#: GGUF tensors that the config reads rather than the model (rotary factors).
GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


# ====================================================================== one family
@dataclass(frozen=True)
class Family:
    """One family: the `ModelConfig` fields it fixes, how it reads the rest, and its tensor names."""

    name: str
    title: str
    hf_types: tuple[str, ...]  # config.json model_type values
    gguf_arch: str | None  # general.architecture
    parts: Mapping[str, Any]  # ModelConfig fields every member has
    block: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=lambda: LLAMA_BLOCK)
    hf_extra: Callable[[dict, dict], dict] = lambda hf, cfg: {}  # family fields from config.json
    gguf_extra: Callable[[_Meta, dict], dict] = lambda meta, cfg: {}  # family fields from the metadata
    interleaved_rotary: bool = False  # llama.cpp stores W_Q, W_K rows in interleaved pairs
    norm_offset: float = 0.0  # a folder's norm gains are γ − this (Gemma: 1)
    hf_head_dim: int | None = None  # transformers' default head size where config.json omits it
    hf_tied: bool = False  # transformers' default of tie_word_embeddings
    activation: tuple[str, ...] = ("silu",)  # config.json hidden_act values the MLP computes


# ---------------------------------------------------------------------- family fields: config.json
def _qwen2_hf(hf: dict, cfg: dict) -> dict:
    return dict(attn_bias=True, attn_out_bias=False)


def _llama_hf(hf: dict, cfg: dict) -> dict:
    bias = _field(hf, "attention_bias", "bool", False)
    return dict(attn_bias=bias, attn_out_bias=bias, mlp_bias=_field(hf, "mlp_bias", "bool", False))


def _gemma_hf(hf: dict, cfg: dict) -> dict:
    bias = _field(hf, "attention_bias", "bool", False)
    scalar = _field(hf, "query_pre_attn_scalar", "number", cfg["head_dim"])
    return dict(attn_bias=bias, attn_out_bias=bias, attn_scale=scalar**-0.5,
                attn_softcap=_field(hf, "attn_logit_softcapping", "number", None),
                final_softcap=_field(hf, "final_logit_softcapping", "number", None),
                embed_scale=math.sqrt(cfg["d_model"]))


# ---------------------------------------------------------------------- family fields: GGUF metadata
def _gemma_gguf(meta: _Meta, cfg: dict, *, period: int, window: int | None, softcap: bool) -> dict:
    """Gemma 2 and 3 in llama.cpp: scores scaled by 1/√d_k (1/√(d/N_h) for the 27B models, whose
    query_pre_attn_scalar is d/N_h), local blocks in a period (`sliding_window_pattern`, else 2 or 6)."""
    big = cfg["n_layer"] == {2: 46, 6: 62}[period]
    scale = (cfg["d_model"] / cfg["n_head"]) ** -0.5 if big else cfg["head_dim"] ** -0.5
    extra = dict(attn_scale=scale, embed_scale=math.sqrt(cfg["d_model"]),
                 final_softcap=meta.get("final_logit_softcapping", "number", 30.0 if softcap else None))
    if softcap:
        extra["attn_softcap"] = meta.get("attn_logit_softcapping", "number", 50.0)
    window = meta.get("attention.sliding_window", "int", window)
    if window:
        extra.update(local_window=window, attention_layers=_gguf_pattern(meta, cfg["n_layer"], period))
    return extra


def _gemma2_gguf(meta: _Meta, cfg: dict) -> dict:
    extra = _gemma_gguf(meta, cfg, period=2, window=4096, softcap=True)
    local = meta.get("rope.freq_base_swa", "number", None)
    if local is not None and local != cfg["rope_theta"]:
        extra["rope_local_theta"] = float(local)
    return extra


def _gemma3_gguf(meta: _Meta, cfg: dict) -> dict:
    extra = _gemma_gguf(meta, cfg, period=6, window=None, softcap=False)
    if "attention_layers" in extra:  # local blocks rotate with their own base and no rescaling
        extra["rope_local_theta"] = float(meta.get("rope.freq_base_swa", "number", 10000.0))
    return extra


def _window_gguf(meta: _Meta, cfg: dict) -> dict:
    """A window on every block where the metadata state one (llama.cpp's converter writes it for
    Phi-3, whose window llama.cpp itself leaves off; transformers applies it)."""
    window = meta.get("attention.sliding_window", "int", 0)
    return dict(local_window=window, attention_layers=("local",) * cfg["n_layer"]) if window else {}


def _gguf_pattern(meta: _Meta, n_layer: int, period: int) -> tuple[str, ...]:
    """llama.cpp's local/global pattern: `attention.sliding_window_pattern` as one flag per block or
    a period p (blocks with i mod p < p − 1 local), else the family's period."""
    value = meta.raw("attention.sliding_window_pattern")
    if isinstance(value, list):
        if len(value) != n_layer or not all(isinstance(v, bool) for v in value):
            raise WeightsError(f"metadata key '{meta.arch}.attention.sliding_window_pattern' holds {len(value)} "
                               f"entries: expected one true/false per block ({n_layer})")
        return tuple("local" if v else "global" for v in value)
    period = meta.get("attention.sliding_window_pattern", "int", period)
    return tuple("local" if period == 0 or i % period < period - 1 else "global" for i in range(n_layer))


_LLAMA_PARTS = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", attn_bias=False, attn_out_bias=False,
                    mlp_bias=False)
_GEMMA_PARTS = dict(_LLAMA_PARTS, mlp="geglu", post_norms=True)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "Llama 2/3.x, SmolLM2 (and Mistral in GGUF)", ("llama",), "llama", _LLAMA_PARTS,
           hf_extra=_llama_hf, gguf_extra=_window_gguf, interleaved_rotary=True),
    Family("mistral", "Mistral", ("mistral",), None, _LLAMA_PARTS, hf_extra=_llama_hf),
    Family("qwen2", "Qwen2, Qwen2.5 (Coder)", ("qwen2",), "qwen2", _LLAMA_PARTS, hf_extra=_qwen2_hf),
    Family("qwen3", "Qwen3", ("qwen3",), "qwen3", dict(_LLAMA_PARTS, qk_norm=True), hf_extra=_llama_hf),
    Family("phi3", "Phi-3, Phi-3.5, Phi-4-mini", ("phi3",), "phi3", _LLAMA_PARTS, block=PHI3_BLOCK,
           gguf_extra=_window_gguf),
    Family("gemma2", "Gemma 2", ("gemma2",), "gemma2", _GEMMA_PARTS, block=GEMMA_BLOCK, hf_extra=_gemma_hf,
           gguf_extra=_gemma2_gguf, norm_offset=1.0, hf_head_dim=256, hf_tied=True,
           activation=("gelu_pytorch_tanh",)),
    Family("gemma3", "Gemma 3 (text)", ("gemma3_text",), "gemma3", dict(_GEMMA_PARTS, qk_norm=True),
           block=GEMMA_BLOCK, hf_extra=_gemma_hf, gguf_extra=_gemma3_gguf, norm_offset=1.0, hf_head_dim=256,
           hf_tied=True, activation=("gelu_pytorch_tanh",)),
)}
HF_TYPES = {t: f for f in FAMILIES.values() for t in f.hf_types}
GGUF_ARCHS = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}


def gguf_family(arch: Any, origin: str) -> Family:
    if isinstance(arch, str) and arch in GGUF_ARCHS:
        return GGUF_ARCHS[arch]
    shown = repr(arch) if isinstance(arch, (str, type(None))) else f"a {type(arch).__name__}"
    raise WeightsError(f"{origin}: architecture {shown} is not supported; hybridlm reads GGUF architectures "
                       f"{', '.join(repr(a) for a in GGUF_ARCHS)}")


def hf_family(model_type: Any) -> Family | None:
    return HF_TYPES.get(model_type) if isinstance(model_type, str) else None


# ====================================================================== config.json
def hub_field(hf: dict[str, Any], name: str, kind: str, default: Any = _MISSING) -> Any:
    """config.json's field `name`, checked to be a "positive int", "number" (finite, > 0),
    "id" (an integer ≥ 0 or null), "str" or "bool"; the error names the field as the file spells it."""
    if name not in hf or (hf[name] is None and kind != "id"):
        if default is _MISSING:
            raise ConfigError(f"config.json lacks the field {name!r}")
        return default
    value = hf[name]
    plain_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "positive int": plain_int and value >= 1,
        "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and value > 0,
        "id": value is None or (plain_int and value >= 0),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        expected = {"positive int": "a positive integer", "number": "a finite number > 0",
                    "id": "a token id (an integer ≥ 0) or null", "str": "a string", "bool": "true or false"}[kind]
        shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
        raise ConfigError(f"config.json: {name}={shown} ({type(value).__name__}): expected {expected}")
    return value


def _field(hf: dict, name: str, kind: str, default: Any = _MISSING) -> Any:
    """config.json's field `name` checked to be of `kind` (the error names the field as the file spells it)."""
    return hub_field(hf, name, kind) if default is _MISSING else hub_field(hf, name, kind, default)


#: The sizes as config.json and GGUF metadata spell them (a GGUF key after its `{arch}.`; a GGUF file's
#: vocabulary size may be its token count instead).
HF_SIZES = {"vocab_size": "vocab_size", "n_ctx": "max_position_embeddings", "d_model": "hidden_size",
            "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
            "d_mlp": "intermediate_size"}
GGUF_SIZES = {"n_ctx": "context_length", "d_model": "embedding_length",
              "n_layer": "block_count", "n_head": "attention.head_count", "n_kv_head": "attention.head_count_kv",
              "d_mlp": "feed_forward_length"}


def hf_config(family: Family, hf: dict) -> ModelConfig:
    """`ModelConfig` of a Hugging Face folder of `family` from its config.json, field by field."""
    key = "hidden_activation" if hf.get("hidden_activation") is not None else "hidden_act"
    act = hf.get(key) or family.activation[0]
    if act not in family.activation:
        raise ConfigError(f"config.json: {key}={act!r}: hybridlm's {family.name} MLP computes "
                          f"{' or '.join(family.activation)}")
    d_model, n_head = _field(hf, "hidden_size", "positive int"), _field(hf, "num_attention_heads", "positive int")
    head_dim = _field(hf, "head_dim", "positive int", None) or family.hf_head_dim or None
    if head_dim is None and d_model % n_head:
        raise ConfigError(f"config.json: hidden_size={d_model} is not a multiple of num_attention_heads={n_head} "
                          "and no head_dim is given")
    cfg = dict(
        family=family.name, vocab_size=_field(hf, "vocab_size", "positive int"), d_model=d_model,
        n_ctx=_field(hf, "max_position_embeddings", "positive int"),
        n_layer=_field(hf, "num_hidden_layers", "positive int"),
        n_head=n_head, n_kv_head=_field(hf, "num_key_value_heads", "positive int", n_head),
        d_mlp=_field(hf, "intermediate_size", "positive int"), head_dim=head_dim,
        norm_eps=float(_field(hf, "rms_norm_eps", "number", 1e-6)),
        tie_embeddings=_field(hf, "tie_word_embeddings", "bool", family.hf_tied),
        bos_token_id=_token_id(hf, "bos_token_id"), eos_token_id=_token_id(hf, "eos_token_id"),
        init_std=_field(hf, "initializer_range", "number", 0.02), **family.parts,
    )
    try:  # before the work per block and position
        check_sizes({k: v for k, v in cfg.items() if v is not None}, HF_SIZES)
    except ConfigError as exc:
        raise ConfigError(f"config.json: {exc}") from None
    d_k = head_dim or d_model // n_head
    cfg.update(_hf_rope(hf, d_k, cfg["n_ctx"]))
    cfg.update(_hf_layers(family, hf, cfg["n_layer"]))
    cfg["head_dim"] = d_k
    cfg.update(family.hf_extra(hf, cfg))
    try:
        return ModelConfig(**cfg)
    except HybridLMError as exc:
        raise ConfigError(f"config.json: inconsistent sizes: {exc}") from None


def _token_id(hf: dict, name: str) -> int | None:
    """A special token's id; a list (Llama 3.1's several ends of text) gives its first."""
    value = hf.get(name)
    if isinstance(value, list) and value:
        value = value[0]
    return _field({name: value}, name, "id", None)


def _hf_rope(hf: dict, d_k: int, n_ctx: int) -> dict:
    """The rotation of config.json, in either spelling: transformers 5's `rope_parameters` (one set,
    or one per layer type), or `rope_theta` with `rope_scaling` (and Gemma 3's `rope_local_base_freq`)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json: rope_parameters={str(params)[:40]}: expected an object")
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local, params = params.get("sliding_attention"), params.get("full_attention") or {}
        for name, p in (("full_attention", params), ("sliding_attention", local)):
            if p is not None and not isinstance(p, dict):
                raise ConfigError(f"config.json: rope_parameters.{name}={str(p)[:40]}: expected an object")
    theta = _field({**hf, **params}, "rope_theta", "number", 10000.0)
    out = dict(rope_theta=float(theta))
    local_theta = _field(local, "rope_theta", "number", None) if local else _field(hf, "rope_local_base_freq",
                                                                                   "number", None)
    if local:
        _plain_rope(local, "rope_parameters.sliding_attention")
    if local_theta is not None:
        out["rope_local_theta"] = float(local_theta)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor={partial!r}: hybridlm rotates whole heads (1.0)")
    kind = params.get("rope_type", params.get("type", "default"))
    half = d_k // 2
    if kind == "default":
        return out
    factor = _field(params, "factor", "number", None)
    if kind == "linear":
        return dict(out, rope_freq_factors=(float(_need(factor, "factor", kind)),) * half)
    if kind == "llama3":
        return dict(out, rope_freq_factors=llama3_factors(theta, d_k, _need(factor, "factor", kind), params))
    if kind in ("longrope", "su"):
        original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        original = _field({"original_max_position_embeddings": original}, "original_max_position_embeddings",
                          "positive int")
        which = "long_factor" if n_ctx > original else "short_factor"
        factors = params.get(which)
        if not (isinstance(factors, list) and len(factors) == half):
            raise ConfigError(f"config.json: rope {which} holds {str(factors)[:40]}: expected {half} numbers")
        scale = factor if factor is not None else n_ctx / original
        attn = params.get("attention_factor")
        if attn is None:
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        return dict(out, rope_freq_factors=tuple(float(f) for f in factors), rope_attn_factor=float(attn))
    raise ConfigError(f"config.json: rope type {kind!r} is not supported; hybridlm rotates with the default, "
                      "linear, llama3 and longrope frequencies")


def _plain_rope(params: dict, where: str) -> None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"config.json: {where} has rope type {kind!r}: hybridlm rescales the global blocks' "
                          "frequencies only")


def _need(value: Any, name: str, kind: str) -> Any:
    if value is None:
        raise ConfigError(f"config.json: rope type {kind!r} needs the field {name!r}")
    return value


def llama3_factors(theta: float, d_k: int, factor: float, params: dict) -> tuple[float, ...]:
    """Llama 3's divisors of θ_j: 1 for short wavelengths, `factor` for long ones, a smooth blend
    between (the llama3 rope type of Meta's reference, and the `rope_freqs` llama.cpp stores)."""
    low = _field(params, "low_freq_factor", "number", 1.0)
    high = _field(params, "high_freq_factor", "number", 4.0)
    original = _field(params, "original_max_position_embeddings", "positive int", 8192)
    factors = []
    for j in range(0, d_k, 2):
        wavelen = 2 * math.pi * theta ** (j / d_k)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(float(factor))
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def _hf_layers(family: Family, hf: dict, n_layer: int) -> dict:
    """Which blocks attend locally: `layer_types` where given, else each family's rule."""
    window = _field(hf, "sliding_window", "positive int", None)
    types = hf.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == n_layer
                and all(t in ("full_attention", "sliding_attention") for t in types)):
            raise ConfigError(f"config.json: layer_types={str(types)[:60]}: expected {n_layer} entries of "
                              "'full_attention' or 'sliding_attention'")
        layers = tuple("local" if t == "sliding_attention" else "global" for t in types)
    elif family.name in ("gemma2", "gemma3"):
        period = 2 if family.name == "gemma2" else _field(hf, "sliding_window_pattern", "positive int", 6)
        layers = tuple("local" if (i + 1) % period else "global" for i in range(n_layer))
    elif family.name in ("qwen2", "qwen3"):
        if _field(hf, "use_sliding_window", "bool", False):
            raise ConfigError("config.json: use_sliding_window=true without layer_types: say which blocks slide")
        layers = ("global",) * n_layer
    else:  # Mistral, Phi-3: a window on every block where one is given
        layers = ("local" if window else "global",) * n_layer
    if "local" not in layers:
        return {}
    if window is None:
        raise ConfigError("config.json: local (sliding) blocks without a sliding_window size")
    return dict(attention_layers=layers, local_window=window)


# ====================================================================== GGUF metadata
class _Meta:
    """The `{arch}.*` keys of a GGUF file's metadata, each type-checked when read."""

    def __init__(self, meta: dict, arch: str, origin: str) -> None:
        self.meta, self.arch, self.origin = meta, arch, origin

    def raw(self, key: str) -> Any:
        return self.meta.get(f"{self.arch}.{key}")

    def get(self, key: str, kind: str = "int", default: Any = _MISSING) -> Any:
        from hybridlm.weights.gguf_header import meta_value

        full = f"{self.arch}.{key}"
        if isinstance(self.meta.get(full), list) and kind in ("int", "number"):
            raise WeightsError(f"{self.origin}: {full} varies by block ({str(self.meta[full])[:40]}); "
                               "hybridlm reads one value for every block")
        try:
            if default is _MISSING:
                return meta_value(self.meta, full, kind)
            return meta_value(self.meta, full, kind, default)
        except WeightsError as exc:
            raise WeightsError(f"{self.origin}: {exc}") from None


def gguf_config(family: Family, meta: dict, tensors: Mapping[str, Any], *, origin: str,
                read: Callable[[str], torch.Tensor]) -> ModelConfig:
    """`ModelConfig` of a GGUF file of `family` from its `{arch}.*` keys (each type-checked) and the
    shapes of its tensors (`tensors`: name → shape); `read(name)` gives a small tensor the config
    needs (the rotary factors)."""
    if family.gguf_arch is None:
        raise WeightsError(f"{origin}: the {family.name} family is not read from GGUF files")
    m = _Meta(meta, family.gguf_arch, origin)
    d_model, n_head = m.get("embedding_length"), m.get("attention.head_count")
    head_dim = m.get("attention.key_length", default=None)
    if head_dim is None:
        if n_head < 1 or d_model % n_head:
            raise WeightsError(f"{origin}: {m.arch}.embedding_length={d_model} is not a multiple of "
                               f"{m.arch}.attention.head_count={n_head}")
        head_dim = d_model // n_head
    for key in ("attention.value_length", "rope.dimension_count"):
        if m.get(key, default=head_dim) != head_dim:
            raise WeightsError(f"{origin}: {m.arch}.{key}={m.get(key)} differs from the head size {head_dim}; "
                               "hybridlm reads whole heads, all rotated")
    from hybridlm.weights.gguf_header import Unread, meta_value

    tokens = meta.get("tokenizer.ggml.tokens")  # (a list, or its count where the vocabulary was not read)
    vocab = m.get("vocab_size", default=None) or (len(tokens) if isinstance(tokens, (list, Unread)) else None)
    if not vocab:
        raise WeightsError(f"{origin}: neither '{m.arch}.vocab_size' nor a vocabulary in the metadata")
    ids = {}
    for name in ("bos", "eos"):
        try:
            ids[name] = meta_value(meta, f"tokenizer.ggml.{name}_token_id", "int", None)
        except WeightsError as exc:
            raise WeightsError(f"{origin}: {exc}") from None
    first = "blk.0."
    cfg = dict(
        family=family.name, vocab_size=vocab, n_ctx=m.get("context_length"), d_model=d_model,
        n_layer=m.get("block_count"), n_head=n_head, n_kv_head=m.get("attention.head_count_kv", default=n_head),
        d_mlp=m.get("feed_forward_length"), head_dim=head_dim,
        norm_eps=float(m.get("attention.layer_norm_rms_epsilon", "number")),
        rope_theta=float(m.get("rope.freq_base", "number", 10000.0)),
        tie_embeddings="output.weight" not in tensors, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
        **family.parts,
    )
    try:  # before the work per block and position
        check_sizes({k: v for k, v in cfg.items() if v is not None},
                    {k: f"{m.arch}.{key}" for k, key in GGUF_SIZES.items()})
    except ConfigError as exc:
        raise WeightsError(f"{origin}: {exc}") from None
    # biases are data: a file that has them uses them (Qwen2's b_Q, b_K, b_V)
    qkv = family.block["attn.W_qkv"][0][0]
    cfg.update(attn_bias=f"{first}{qkv}.bias" in tensors, attn_out_bias=f"{first}attn_output.bias" in tensors,
               mlp_bias=f"{first}ffn_down.bias" in tensors)
    cfg.update(_gguf_rope(m, head_dim, cfg["n_ctx"], tensors, read))
    cfg.update(family.gguf_extra(m, cfg))
    try:
        return ModelConfig(**cfg)
    except HybridLMError as exc:
        raise WeightsError(f"{origin}: inconsistent sizes in the metadata: {exc}") from None


def _gguf_rope(m: _Meta, d_k: int, n_ctx: int, tensors: Mapping[str, Any],
               read: Callable[[str], torch.Tensor]) -> dict:
    """llama.cpp's rescalings as divisors: `rope_freqs` (Llama 3), a linear factor, Phi-3's long/short
    factors with their attention factor."""
    kind = m.get("rope.scaling.type", "str", "none")
    factors: tuple[float, ...] | None = None
    out: dict = {}

    def vector(name: str) -> tuple[float, ...]:
        if tuple(tensors[name]) != (d_k // 2,):
            raise WeightsError(f"{m.origin}: tensor {name!r} has shape {list(tensors[name])}: the rotation of "
                               f"d_k={d_k} has {d_k // 2} pairs")
        values = read(name).double()
        if not (torch.isfinite(values).all() and (values > 0).all()):
            raise WeightsError(f"{m.origin}: tensor {name!r} holds a factor that is not a positive number")
        return tuple(values.tolist())

    if kind == "linear":
        factor = m.get("rope.scaling.factor", "number")
        if not factor > 0:
            raise WeightsError(f"{m.origin}: {m.arch}.rope.scaling.factor={factor}: expected a positive number")
        factors = (float(factor),) * (d_k // 2)
    elif kind == "longrope" or "rope_factors_long.weight" in tensors:
        original = m.get("rope.scaling.original_context_length", default=n_ctx)
        which = "rope_factors_long.weight" if n_ctx > original else "rope_factors_short.weight"
        if which not in tensors:
            raise WeightsError(f"{m.origin}: long-context rotary scaling without the tensor {which!r}")
        factors = vector(which)
        out["rope_attn_factor"] = float(m.get("rope.scaling.attn_factor", "number", 1.0))
    elif kind not in ("none", ""):
        raise WeightsError(f"{m.origin}: rotary scaling {kind!r} ({m.arch}.rope.scaling.type) is not supported; "
                           "hybridlm reads linear, longrope and Llama 3's rope_freqs")
    if "rope_freqs.weight" in tensors:
        if factors is not None:
            raise WeightsError(f"{m.origin}: both {kind!r} scaling and a rope_freqs tensor; expected one")
        factors = vector("rope_freqs.weight")
    if factors is not None and any(f != 1.0 for f in factors):
        out["rope_freq_factors"] = factors
    return out


# ====================================================================== tensors
@dataclass(frozen=True)
class Source:
    """Where one of the model's tensors comes from: the file's tensors stacked by rows, each with a row
    permutation (ours[i] = the file's[rows[i]], or None) and an offset added (a Gemma folder's norms)."""

    names: tuple[str, ...]
    rows: tuple[torch.Tensor | None, ...]
    offset: float = 0.0


def plan(family: Family, cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], *, gguf: bool,
         origin: str, prefix: str = "") -> dict[str, Source]:
    """For every tensor of `DecoderLM(cfg)`, the file's tensors it is made of (`shapes`: the file's
    tensor names → shapes, read without reading the tensors); each named tensor checked to exist and to
    have the shape the config implies, and every tensor of the file placed (or one the config read),
    before any is read. `prefix`: where a folder's language model sits ("model." of a causal LM is
    part of the names in `GLOBAL` and added to the block names here)."""
    from hybridlm.lm.model import DecoderLM
    from hybridlm.lm.norm import LayerNorm, RMSNorm

    block = "blk.{}." if gguf else prefix + "layers.{}."
    head = block.split("{}")[0]
    held = {int(n[len(head):].split(".")[0]) for n in shapes
            if n.startswith(head) and n[len(head):].split(".")[0].isdigit()}
    absent = [layer for layer in range(cfg.n_layer) if layer not in held]
    if absent:  # (before the model's skeleton is made: a config may claim thousands of blocks)
        raise WeightsError(f"{origin}: the {'metadata name' if gguf else 'config names'} {cfg.n_layer} blocks, "
                           f"the file holds no tensor of block {absent[0]}"
                           + (f" (nor of {len(absent) - 1} more)" if len(absent) > 1 else ""))
    with torch.device("meta"):
        skeleton = DecoderLM(cfg)
    gains = {f"{name}.weight" for name, mod in skeleton.named_modules() if isinstance(mod, (LayerNorm, RMSNorm))}
    which = 0 if gguf else 1
    out: dict[str, Source] = {}
    for name, param in skeleton.state_dict().items():
        if name in GLOBAL:
            parts: tuple[str, ...] = (GLOBAL[name][which],)
            if not gguf:
                parts = (parts[0].replace("model.", prefix, 1) if parts[0].startswith("model.") else parts[0],)
            splits = [param.shape[0]]
        else:
            _, layer, rest = name.split(".", 2)
            path, _, suffix = rest.rpartition(".")
            stems = family.block[path][which]
            parts = tuple(f"{block.format(layer)}{stem}.{suffix}" for stem in stems)
            splits = _row_splits(cfg, path, len(stems), param.shape[0])
        rows: list[torch.Tensor | None] = [None] * len(parts)
        for i, (part, n) in enumerate(zip(parts, splits)):
            expected = (n, *param.shape[1:])
            if part not in shapes:
                raise WeightsError(f"{origin}: the tensor {part!r} is missing (the {family.name} model's {name})")
            if tuple(shapes[part]) != expected:
                raise WeightsError(f"{origin}: tensor {part!r} has shape {list(shapes[part])}, the "
                                   f"{'metadata' if gguf else 'config'} imply {list(expected)}")
            if gguf and family.interleaved_rotary and name.startswith("blocks.") and path == "attn.W_qkv" and i < 2:
                rows[i] = interleaved_rows(n // cfg.d_head, cfg.d_head)
        offset = family.norm_offset if not gguf and name in gains else 0.0
        out[name] = Source(parts, tuple(rows), offset)
    used = {part for source in out.values() for part in source.names}
    skipped = set(GGUF_CONFIG_TENSORS) if gguf else {GLOBAL["W_u"][1]} if cfg.tie_embeddings else set()
    extra = sorted(n for n in shapes if n not in used and n not in skipped and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise WeightsError(f"{origin}: tensor {extra[0]!r} has no place in a {family.name} model"
                           + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return out


def _row_splits(cfg: ModelConfig, path: str, parts: int, rows: int) -> list[int]:
    if parts == 1:
        return [rows]
    if path == "attn.W_qkv":
        return [cfg.n_head * cfg.d_head, cfg.n_kv_head * cfg.d_head, cfg.n_kv_head * cfg.d_head]
    return [rows // parts] * parts  # W_gate_up: [W_gate; W_up]


def interleaved_rows(n_heads: int, d_head: int) -> torch.Tensor:
    """The row permutation that undoes llama.cpp's order of W_Q / W_K: our row (head, half, j) is the
    file's row (head, 2j + half), so that the pairs (2j, 2j+1) become (j, j + d_k/2)."""
    return torch.arange(n_heads * d_head).view(n_heads, d_head // 2, 2).transpose(1, 2).reshape(-1)


class MappedWeights(Mapping):
    """The state dict of `DecoderLM(cfg)`, each tensor read from the file when asked (`read(name)`: one
    of the file's tensors as a torch tensor) and stacked, permuted and offset as its `Source` says; its
    shape known without reading. One tensor at a time, so loading never holds a second copy of the model."""

    def __init__(self, sources: dict[str, Source], shapes: Mapping[str, tuple[int, ...]],
                 read: Callable[[str], torch.Tensor]) -> None:
        self.sources, self._shapes, self._read = sources, shapes, read

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.sources[name]
        parts = []
        for part, rows in zip(source.names, source.rows):
            t = self._read(part).float()
            parts.append(t if rows is None else t[rows])
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
        return t + source.offset if source.offset else t

    def shape(self, name: str) -> tuple[int, ...]:
        first = tuple(self._shapes[self.sources[name].names[0]])
        return (sum(self._shapes[n][0] for n in self.sources[name].names), *first[1:])

    def __iter__(self):
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)
