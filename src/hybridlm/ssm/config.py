"""Configuration of a recurrent / selective state-space / hybrid stack (docs/theory.md §5.4, the survey's (S16)–(S17)).

One letter per block names its token mixer, the map that moves information along the
positions i of layer k:

| letter | block                  | layer state c(k, ·)                      |
|--------|------------------------|------------------------------------------|
| S      | diagonal selective SSM | c ∈ ℝ^{d_inner × d_state}, + conv window |
| R      | Elman RNN              | c ∈ ℝ^{d_rnn}                            |
| A      | attention (`hybridlm.lm.model.Block`) | keys and values, grows with n |

So `layers="SSSS"` is a selective SSM, `"RRRR"` an RNN and `"SSSA"` a hybrid stack in the
manner of Jamba. Every block is pre-norm with a residual mixer sublayer and a residual MLP
sublayer, as in the transformer; the attention blocks are the transformer's own, built
from `parts()`, a `ModelConfig` that also supplies the norm and the MLP of every block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hybridlm.lm.config import ModelConfig
from hybridlm.errors import ConfigError

KINDS = {"S": "selective SSM", "R": "Elman RNN", "A": "attention"}


@dataclass(frozen=True)
class StackConfig:
    layers: str = "SSSS"  # one letter of KINDS per block
    vocab_size: int = 50257
    n_ctx: int = 2048  # horizon T: Π_T still applies to the string the state summarises
    d_model: int = 64
    n_head: int = 4  # attention blocks only
    d_state: int = 16  # N: state size per channel of an S block
    expand: int = 2  # d_inner = expand · d
    d_conv: int = 4  # width of the short causal convolution of an S block (1: none)
    dt_rank: int | None = None  # rank of the map u ↦ Δ; None: ⌈d/16⌉
    d_rnn: int | None = None  # state size of an R block; None: d
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    init_std: float = 0.02
    eos_token_id: int | None = 50256

    def __post_init__(self) -> None:
        if isinstance(self.layers, (list, tuple)):
            object.__setattr__(self, "layers", "".join(self.layers))
        if self.dt_rank is None:
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))
        if self.d_rnn is None:
            object.__setattr__(self, "d_rnn", self.d_model)
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_attention(self) -> int:
        return self.layers.count("A")

    @property
    def family(self) -> str:
        kinds = set(self.layers)
        return {frozenset("S"): "ssm", frozenset("R"): "rnn", frozenset("A"): "attention"}.get(
            frozenset(kinds), "hybrid")

    def parts(self) -> ModelConfig:
        """The transformer parts (norm, MLP, attention) as a `ModelConfig`.

        Its `n_layer` counts the attention blocks only: they index the KV state among
        themselves. No positional embedding is added: the recurrences give the order, and
        attention blocks of a hybrid run without positions (NoPE, as in Jamba).
        """
        return ModelConfig(family=self.family, vocab_size=self.vocab_size, n_ctx=self.n_ctx, d_model=self.d_model,
                           n_layer=max(1, self.n_attention), n_head=self.n_head, norm=self.norm,
                           norm_eps=self.norm_eps, mlp=self.mlp, init_std=self.init_std,
                           eos_token_id=self.eos_token_id)

    def validate(self) -> None:
        if not isinstance(self.layers, str) or not self.layers:
            raise ConfigError(f"layers={self.layers!r}: expected a non-empty string of {sorted(KINDS)}")
        bad = [k for k in self.layers if k not in KINDS]
        if bad:
            raise ConfigError(f"unknown layer kind {bad[0]!r} in layers={self.layers!r}: each block is one of "
                              + ", ".join(f"{k} ({v})" for k, v in KINDS.items()))
        for name in ("vocab_size", "n_ctx", "d_model", "n_head", "d_state", "expand", "d_conv", "dt_rank", "d_rnn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field {name}={value!r}: expected a positive integer")
        if "A" in self.layers and self.d_model % self.n_head:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        self.parts()  # the norm and MLP names are checked there

    def replace(self, **changes) -> "StackConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: Widths: tiny for tests, mini for quick CPU runs, small = GPT-2 small's width and depth.
SIZES = {
    "tiny": dict(d_model=64, n_layer=4, n_head=4, d_state=8),
    "mini": dict(d_model=256, n_layer=6, n_head=4, d_state=16),
    "small": dict(d_model=768, n_layer=12, n_head=12, d_state=16),
}

#: Block patterns per family, for a given depth L. The hybrid puts one attention block in four.
PATTERNS = {
    "ssm": lambda L: "S" * L,
    "rnn": lambda L: "R" * L,
    "hybrid": lambda L: ("SSSA" * L)[:L] if L >= 4 else ("SA" * L)[:L],
}


def preset(family: str, size: str, **changes) -> StackConfig:
    """`preset("ssm", "small")`: a stack of the given family and size (GPT-2 alphabet)."""
    if family not in PATTERNS:
        raise ConfigError(f"unknown stack family {family!r}; families: {sorted(PATTERNS)}")
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r} for a {family} stack; sizes: {sorted(SIZES)}")
    s = SIZES[size]
    return StackConfig(layers=PATTERNS[family](s["n_layer"]), d_model=s["d_model"], n_head=s["n_head"],
                       d_state=s["d_state"]).replace(**changes)
