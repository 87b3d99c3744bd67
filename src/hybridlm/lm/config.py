"""Model configuration: the sizes of docs/theory.md §2 and the choice of pluggable parts.

One dataclass describes every decoder-only family hybridlm runs. The symbols of the
spec map to fields as follows:

| symbol | field        | meaning                                  |
|--------|--------------|------------------------------------------|
| V      | vocab_size   | alphabet size                            |
| T      | n_ctx        | context horizon                          |
| d      | d_model      | residual-stream width                    |
| L      | n_layer      | number of blocks                         |
| N_h    | n_head       | query heads per block                    |
| N_kv   | n_kv_head    | key/value heads (N_kv = N_h: no grouping)|
| d_mlp  | d_mlp        | MLP hidden width                         |
| d_k    | d_head       | head size (`head_dim`; None: d / N_h)    |

The families differ only in the parts: `norm` (layernorm | rmsnorm), `positions`
(learned | rotary), `mlp` (gelu | swiglu | geglu), the biases, weight tying, and the attention:
`attn_scale` multiplies the scores Q Kᵀ (None: 1/√d_k; GPT-Neo: 1), and
`attention_layers` names each block's mask, "global" (M_n: j ≤ i) or "local" (also
j > i − `local_window`); None means all global.

The rotation: θ_j = base^(−2j/d_k) / f_j with base `rope_theta` and per-pair divisors f_j
(`rope_freq_factors`, None: all 1), which carry every frequency rescaling (Llama 3's, linear,
Phi-3's long-context factors); cos θ and sin θ are multiplied by `rope_attn_factor`. A local
block rotates with base `rope_local_theta` and no divisors where that is set (Gemma 3).

Parts a family may add, each off by default: `qk_norm` (RMSNorm of each head's q and k,
Qwen3, Gemma 3), `post_norms` (a norm on each sublayer's output before the residual sum,
Gemma 2/3), `attn_softcap` and `final_softcap` (s ↦ c·tanh(s/c) on the scores and the
logits, Gemma 2), `embed_scale` (H⁽⁰⁾ multiplied by it, Gemma: √d).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from hybridlm.errors import ConfigError

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu", "geglu")
ATTENTION_TYPES = ("global", "local")
#: Upper bounds on the sizes, far above any published decoder (Llama 3.1 405B: V = 128,256,
#: d = 16,384, L = 126, d_mlp = 53,248; the longest contexts ~2²⁰): a config past them is an
#: error, not a request to allocate (the rotary tables alone are T × d_k floats).
MAX_SIZES = {"vocab_size": 1 << 22, "n_ctx": 1 << 20, "d_model": 1 << 16, "n_layer": 1 << 12,
             "n_head": 1 << 12, "n_kv_head": 1 << 12, "d_mlp": 1 << 18}


def check_sizes(sizes: dict[str, Any], spelled: dict[str, str] | None = None) -> None:
    """The sizes of MAX_SIZES among `sizes` are positive integers within their bounds: a reader checks
    those it has read before any work per block or position, which a hostile size would make endless.
    `spelled`: a size's name as the file spells it, for the error."""
    for name, value in sizes.items():
        bound = MAX_SIZES.get(name)
        if bound is None:
            continue
        field_name = (spelled or {}).get(name, f"config field {name}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{field_name}={value!r}: expected a positive integer")
        if value > bound:
            raise ConfigError(f"{field_name}={value:,}: hybridlm supports at most {bound:,}")


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt2"
    vocab_size: int = 50257
    n_ctx: int = 1024
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    # None: N_h and 4·d; __post_init__ sets them, so a built config always holds integers
    n_kv_head: int = None  # type: ignore[assignment]  # filled in by __post_init__
    d_mlp: int = None  # type: ignore[assignment]  # filled in by __post_init__
    head_dim: int | None = None  # d_k; None: d / N_h
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positions: str = "learned"
    rope_theta: float = 10000.0
    rope_freq_factors: tuple[float, ...] | None = None  # f_j, one per rotated pair (d_k / 2); None: all 1
    rope_attn_factor: float = 1.0  # cos θ and sin θ multiplied by it
    rope_local_theta: float | None = None  # the base of local blocks (no divisors); None: as global ones
    mlp: str = "gelu"
    attn_bias: bool = True  # b_Q, b_K, b_V
    attn_out_bias: bool = True  # b_O
    attn_scale: float | None = None  # S = scale · Q Kᵀ + M; None: 1/√d_k
    attention_layers: tuple[str, ...] | None = None  # per block "global" | "local"; None: all global
    local_window: int = 256
    mlp_bias: bool = True
    qk_norm: bool = False  # RMSNorm over each head's q and k before the rotation
    post_norms: bool = False  # a norm on each sublayer's output before its residual sum
    attn_softcap: float | None = None  # S ↦ c·tanh(S/c) before the mask
    final_softcap: float | None = None  # z ↦ c·tanh(z/c)
    embed_scale: float | None = None  # H⁽⁰⁾ = embed_scale · U(s) W_e (+ P W_p)
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = 50256
    init_std: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        for name in ("attention_layers", "rope_freq_factors"):
            if isinstance(getattr(self, name), list):  # JSON gives lists
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def d_head(self) -> int:
        """d_k: `head_dim`, or d / N_h."""
        return self.d_model // self.n_head if self.head_dim is None else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head."""
        return self.n_head // self.n_kv_head

    def window(self, layer: int) -> int | None:
        """The local window of block `layer` (0-based), or None for a global block."""
        if self.attention_layers is not None and self.attention_layers[layer] == "local":
            return self.local_window
        return None

    def token_cost(self, keys: int) -> float:
        """What one new token costs when it reads `keys` keys, in units of its affine maps (the
        projections and the MLP, which cost the same at any depth): 1 + Σ_ℓ 2·N_h·d_k·min(keys, w_ℓ)
        multiply-adds of its scores and A V over the L blocks' affine ones. A prefill chunk deep in
        a context costs more than the same tokens at its start; this says by how much."""
        d, H, d_k = self.d_model, self.n_head, self.d_head
        affine = d * (H + 2 * self.n_kv_head) * d_k + H * d_k * d + (3 if self.mlp != "gelu" else 2) * d * self.d_mlp
        reads = sum(min(keys, w) if (w := self.window(layer)) is not None else keys for layer in range(self.n_layer))
        return 1.0 + 2 * H * d_k * reads / (self.n_layer * affine)

    def rope_base(self, layer: int) -> tuple[float, tuple[float, ...] | None]:
        """(base, divisors f_j) of block `layer`'s rotation."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_freq_factors

    def validate(self) -> None:
        if not isinstance(self.family, str):
            raise ConfigError(f"config field family={self.family!r}: expected a string")
        check_sizes({name: getattr(self, name) for name in MAX_SIZES})
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"config field {name}={value!r}: expected a finite number ≥ 0")
        for name in ("attn_bias", "attn_out_bias", "mlp_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name}={getattr(self, name)!r}: expected true or false")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"config field {name}={value!r}: expected a token id (an integer ≥ 0) or null")
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
                                          or not 1 <= self.head_dim <= MAX_SIZES["d_model"]):
            raise ConfigError(f"config field head_dim={self.head_dim!r}: expected a positive integer, "
                              "or null for d / N_h")
        if self.head_dim is None and self.d_model % self.n_head:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                "each head needs d_k = d / N_h dimensions"
            )
        if self.n_head % self.n_kv_head:
            raise ConfigError(
                f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}"
            )
        if self.norm not in NORMS:
            raise ConfigError(f"norm={self.norm!r}: expected one of {NORMS}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions={self.positions!r}: expected one of {POSITIONS}")
        if self.mlp not in MLPS:
            raise ConfigError(f"mlp={self.mlp!r}: expected one of {MLPS}")
        if self.positions == "rotary" and self.d_head % 2:
            raise ConfigError(f"rotary positions need an even head size, got d_k={self.d_head}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r}, rope_theta={self.rope_theta!r}: expected positive numbers")
        for name, meaning in (("attn_scale", "1/√d_k"), ("attn_softcap", "no cap"), ("final_softcap", "no cap"),
                              ("embed_scale", "1"), ("rope_local_theta", "rope_theta")):
            if not _positive_or_none(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected a positive number, or None for {meaning}")
        if not _positive_or_none(self.rope_attn_factor) or self.rope_attn_factor is None:
            raise ConfigError(f"rope_attn_factor={self.rope_attn_factor!r}: expected a positive number")
        factors = self.rope_freq_factors
        if factors is not None:
            if not isinstance(factors, tuple) or not all(_positive_or_none(f) and f is not None for f in factors):
                raise ConfigError(f"rope_freq_factors={str(factors)[:60]}: expected a list of positive numbers, "
                                  "or null")
            if len(factors) != self.d_head // 2:
                raise ConfigError(f"rope_freq_factors has {len(factors)} entries: the rotation of d_k={self.d_head} "
                                  f"has {self.d_head // 2} pairs")
        for name in ("qk_norm", "post_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name}={getattr(self, name)!r}: expected true or false")
        if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) or self.local_window < 1:
            raise ConfigError(f"local_window={self.local_window!r}: expected a positive integer")
        layers = self.attention_layers
        if layers is not None:
            if not isinstance(layers, tuple):
                raise ConfigError(
                    f"attention_layers={layers!r}: expected a list of {ATTENTION_TYPES} per block, or None"
                )
            if len(layers) != self.n_layer:
                raise ConfigError(
                    f"attention_layers names {len(layers)} blocks but n_layer={self.n_layer}: "
                    "give one of 'global' or 'local' per block"
                )
            bad = [a for a in layers if a not in ATTENTION_TYPES]
            if bad:
                raise ConfigError(f"attention_layers holds {bad[0]!r}: each entry must be one of {ATTENTION_TYPES}")

    # ------------------------------------------------------------------ (de)serialisation
    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a model config is a JSON object of fields, got a {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields: {sorted(names)}")
        return cls(**data)


def _positive_or_none(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                             and math.isfinite(value) and value > 0)


def _gpt2(d_model: int, n_layer: int, n_head: int) -> ModelConfig:
    return ModelConfig(
        family="gpt2", vocab_size=50257, n_ctx=1024, d_model=d_model, n_layer=n_layer,
        n_head=n_head, bos_token_id=50256, eos_token_id=50256,
    )


def _gptneo(d_model: int, n_layer: int, n_head: int) -> ModelConfig:
    """GPT-Neo: GPT-2's parts, but unscaled scores, no b_Q/b_K/b_V, global and local blocks alternating."""
    return ModelConfig(
        family="gpt-neo", vocab_size=50257, n_ctx=2048, d_model=d_model, n_layer=n_layer,
        n_head=n_head, attn_bias=False, attn_scale=1.0, attention_layers=("global", "local") * (n_layer // 2),
        local_window=256, bos_token_id=50256, eos_token_id=50256,
    )


#: Published sizes: GPT-2 (Radford et al. 2019), GPT-Neo (Black et al. 2021); the hub's config.json files.
PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "gpt-neo-125m": _gptneo(768, 12, 12),
    "gpt-neo-1.3b": _gptneo(2048, 24, 16),
    "gpt-neo-2.7b": _gptneo(2560, 32, 20),
}

def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}") from None
