"""Model configuration: the sizes of SPEC.md §2 and the choice of pluggable parts.

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

The families differ only in the parts: `norm` (layernorm | rmsnorm), `positions`
(learned | rotary), `mlp` (gelu | swiglu), the biases, weight tying, and the attention:
`attn_scale` multiplies the scores Q Kᵀ (None: 1/√d_k; GPT-Neo: 1), and
`attention_layers` names each block's mask, "global" (M_n: j ≤ i) or "local" (also
j > i − `local_window`); None means all global.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hybridlm.errors import ConfigError

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")
ATTENTION_TYPES = ("global", "local")


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt2"
    vocab_size: int = 50257
    n_ctx: int = 1024
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    d_mlp: int | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positions: str = "learned"
    rope_theta: float = 10000.0
    mlp: str = "gelu"
    attn_bias: bool = True  # b_Q, b_K, b_V
    attn_out_bias: bool = True  # b_O
    attn_scale: float | None = None  # S = scale · Q Kᵀ + M; None: 1/√d_k
    attention_layers: tuple[str, ...] | None = None  # per block "global" | "local"; None: all global
    local_window: int = 256
    mlp_bias: bool = True
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
        if isinstance(self.attention_layers, list):  # JSON gives lists
            object.__setattr__(self, "attention_layers", tuple(self.attention_layers))
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def d_head(self) -> int:
        """d_k = d / N_h."""
        return self.d_model // self.n_head

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head."""
        return self.n_head // self.n_kv_head

    def window(self, layer: int) -> int | None:
        """The local window of block `layer` (0-based), or None for a global block."""
        if self.attention_layers is not None and self.attention_layers[layer] == "local":
            return self.local_window
        return None

    def validate(self) -> None:
        positive = ("vocab_size", "n_ctx", "d_model", "n_layer", "n_head", "n_kv_head", "d_mlp")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field {name}={value!r}: expected a positive integer")
        if self.d_model % self.n_head:
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
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r}: expected a positive number")
        if self.attn_scale is not None and not (isinstance(self.attn_scale, (int, float)) and self.attn_scale > 0):
            raise ConfigError(f"attn_scale={self.attn_scale!r}: expected a positive number, or None for 1/√d_k")
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
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_hf_gpt2(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a hub `config.json` of a GPT2LMHeadModel."""
        _require_tanh_gelu(hf, "GPT-2")
        try:
            d_model = hf["n_embd"]
            return cls(
                family="gpt2",
                vocab_size=hf["vocab_size"],
                n_ctx=hf.get("n_positions", hf.get("n_ctx", 1024)),
                d_model=d_model,
                n_layer=hf["n_layer"],
                n_head=hf["n_head"],
                d_mlp=hf.get("n_inner") or 4 * d_model,
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
                init_std=hf.get("initializer_range", 0.02),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the GPT-2 field {exc.args[0]!r}") from None

    def to_hf_gpt2(self) -> dict[str, Any]:
        """The hub `config.json` for this configuration (GPT-2 family only)."""
        if self.family != "gpt2":
            raise ConfigError(f"to_hf_gpt2 needs a gpt2-family config, got {self.family!r}")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_ctx,
            "n_ctx": self.n_ctx,
            "n_embd": self.d_model,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": self.d_mlp,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.norm_eps,
            "initializer_range": self.init_std,
            "bos_token_id": self.bos_token_id if self.bos_token_id is not None else 50256,
            "eos_token_id": self.eos_token_id if self.eos_token_id is not None else 50256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf_gptneo(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a hub `config.json` of a GPTNeoForCausalLM (model_type "gpt_neo")."""
        _require_tanh_gelu(hf, "GPT-Neo")
        if not hf.get("tie_word_embeddings", True):
            raise ConfigError("config.json has tie_word_embeddings=false: hybridlm reads tied GPT-Neo checkpoints only")
        try:
            d_model = hf["hidden_size"]
            return cls(
                family="gpt-neo",
                vocab_size=hf["vocab_size"],
                n_ctx=hf.get("max_position_embeddings", 2048),
                d_model=d_model,
                n_layer=hf["num_layers"],
                n_head=hf["num_heads"],
                d_mlp=hf.get("intermediate_size") or 4 * d_model,
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                attn_bias=False,
                attn_scale=1.0,
                attention_layers=_expand_attention_types(hf["attention_types"]),
                local_window=hf.get("window_size", 256),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
                init_std=hf.get("initializer_range", 0.02),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the GPT-Neo field {exc.args[0]!r}") from None

    def to_hf_gptneo(self) -> dict[str, Any]:
        """The hub `config.json` for this configuration (GPT-Neo family only)."""
        if self.family != "gpt-neo":
            raise ConfigError(f"to_hf_gptneo needs a gpt-neo-family config, got {self.family!r}")
        fixed = dict(norm="layernorm", positions="learned", mlp="gelu", attn_bias=False, attn_out_bias=True,
                     mlp_bias=True, tie_embeddings=True, attn_scale=1.0, n_kv_head=self.n_head)
        differs = {k: getattr(self, k) for k, v in fixed.items() if getattr(self, k) != v}
        if differs:
            raise ConfigError(f"GPT-Neo's hub layout cannot express {differs}; it fixes {fixed}")
        layers = self.attention_layers or ("global",) * self.n_layer
        period = next(p for p in range(1, len(layers) + 1)
                      if len(layers) % p == 0 and layers == layers[:p] * (len(layers) // p))
        return {
            "architectures": ["GPTNeoForCausalLM"],
            "model_type": "gpt_neo",
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.n_ctx,
            "hidden_size": self.d_model,
            "num_layers": self.n_layer,
            "num_heads": self.n_head,
            "intermediate_size": self.d_mlp,
            "attention_types": [[list(layers[:period]), len(layers) // period]],
            "window_size": self.local_window,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.norm_eps,
            "initializer_range": self.init_std,
            "bos_token_id": self.bos_token_id if self.bos_token_id is not None else 50256,
            "eos_token_id": self.eos_token_id if self.eos_token_id is not None else 50256,
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
            if isinstance(pattern, str) or isinstance(repeat, bool) or not isinstance(repeat, int):
                raise TypeError
            layers += list(pattern) * repeat
        return tuple(layers)
    except (TypeError, ValueError):
        raise ConfigError(
            f"attention_types={types!r} in config.json: expected [[pattern, repeats], ...], "
            'e.g. [[["global", "local"], 6]]'
        ) from None


def _require_tanh_gelu(hf: dict[str, Any], family: str) -> None:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"activation_function={act!r} in config.json: hybridlm's {family} family uses the "
            "tanh form of GELU ('gelu_new')"
        )


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


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}") from None
