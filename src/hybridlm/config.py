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
(learned | rotary), `mlp` (gelu | swiglu), the biases, and weight tying.
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
    attn_bias: bool = True
    attn_out_bias: bool = True
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
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(
                f"activation_function={act!r} in config.json: hybridlm's GPT-2 family uses the "
                "tanh form of GELU ('gelu_new')"
            )
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


def _gpt2(d_model: int, n_layer: int, n_head: int) -> ModelConfig:
    return ModelConfig(
        family="gpt2", vocab_size=50257, n_ctx=1024, d_model=d_model, n_layer=n_layer,
        n_head=n_head, bos_token_id=50256, eos_token_id=50256,
    )


#: Published GPT-2 sizes (Radford et al. 2019; the hub's config.json files).
PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
}

#: Hub repository of each preset, for users with a network.
HUB_REPOS: dict[str, str] = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}") from None
