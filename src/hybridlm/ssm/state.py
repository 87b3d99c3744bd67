"""The state x_t of a recurrent / SSM / hybrid stack (docs/theory.md §5.4, the survey's (S16)–(S17)).

For a recurrent block k the memory c(k, i) after the last position i = n is a sufficient
statistic of the past: c(k, n+1) needs only c(k, n) and z(k, n+1). So x_t holds one
fixed-size c(k, ·) per recurrent block (and the short convolution's window of the last
d_conv − 1 inputs), whatever n is: memory and per-token decode cost are flat in the
context length. Attention blocks of a hybrid keep their keys and values in a `KVState`
(`x.attn`), which grows with n as in docs/theory.md §3.

Like `KVState`, x also holds the string s_t it summarises (to rebuild from Π_T(s) when
the horizon is reached) and the readout z of its last position.
"""

from __future__ import annotations

import torch

from hybridlm.ssm.config import StackConfig
from hybridlm.lm.state import KVState


class SSMState:
    def __init__(self, cfg: StackConfig, batch: int, *, capacity: int = 64,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.batch = batch
        self.n = 0
        self.c: list[torch.Tensor | None] = []  # c(k, n) per block; None for attention blocks
        self.conv: list[torch.Tensor | None] = []  # last d_conv − 1 inputs of each S block
        for kind in cfg.layers:
            c, w = _layer_buffers(cfg, kind, batch, dtype, device)
            self.c.append(c)
            self.conv.append(w)
        self.attn = KVState(cfg.parts(), batch, capacity=capacity, dtype=dtype, device=device) \
            if cfg.n_attention else None
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None  # z: readout at the last position, [B, V]
        self.rebuilds = 0

    # ------------------------------------------------------------------ sizes
    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def _fixed(self) -> list[torch.Tensor]:
        return [t for t in self.c + self.conv if t is not None]

    @property
    def dim(self) -> int:
        """Real numbers in x_t per sequence: fixed for recurrent blocks, + 2·L_A·d·n for attention."""
        fixed = sum(t[0].numel() for t in self._fixed())
        return fixed + (self.attn.dim if self.attn is not None else 0)

    def nbytes(self) -> int:
        fixed = sum(t.numel() * t.element_size() for t in self._fixed())
        return fixed + (self.attn.nbytes() if self.attn is not None else 0)

    # ------------------------------------------------------------------ updates (used by F)
    def reserve(self, m: int) -> None:
        if self.n + m > self.cfg.n_ctx:
            raise ValueError(f"state holds {self.n} positions; {m} more exceed T={self.cfg.n_ctx}")
        if self.attn is not None:
            self.attn.reserve(m)

    def commit(self, w: torch.Tensor) -> None:
        """Record that the tokens w ([B, m]) entered the state."""
        self.tokens = torch.cat([self.tokens, w], dim=1)
        self.n += w.shape[1]
        if self.attn is not None:
            self.attn.commit(w)

    def reset(self) -> None:
        # fresh zeros, not zero_(): the blocks replace c and conv each step (in F, under
        # inference mode), so these tensors are not updated in place anywhere
        self.c = [None if t is None else torch.zeros_like(t) for t in self.c]
        self.conv = [None if t is None else torch.zeros_like(t) for t in self.conv]
        self.n = 0
        self.tokens = self.tokens[:, :0]
        self.logits = None
        if self.attn is not None:
            self.attn.reset()

    # ------------------------------------------------------------------ copies
    def clone(self) -> "SSMState":
        """An independent copy: F updates a state in place, so keep x_t with x.clone()."""
        other = SSMState.__new__(SSMState)
        other.cfg, other.batch, other.n, other.rebuilds = self.cfg, self.batch, self.n, self.rebuilds
        other.c = [None if t is None else t.clone() for t in self.c]
        other.conv = [None if t is None else t.clone() for t in self.conv]
        other.attn = None if self.attn is None else self.attn.clone()
        other.tokens = self.tokens.clone()
        other.logits = None if self.logits is None else self.logits.clone()
        return other

    def __repr__(self) -> str:
        return (f"SSMState(batch={self.batch}, n={self.n}, layers={self.cfg.layers!r}, "
                f"bytes={self.nbytes()})")


def _layer_buffers(cfg: StackConfig, kind: str, batch: int, dtype, device):
    if kind == "S":
        c = torch.zeros(batch, cfg.d_inner, cfg.d_state, dtype=dtype, device=device)
        w = torch.zeros(batch, cfg.d_conv - 1, cfg.d_inner, dtype=dtype, device=device)
        return c, w
    if kind == "R":
        assert cfg.d_rnn is not None  # StackConfig fills in d
        return torch.zeros(batch, cfg.d_rnn, dtype=dtype, device=device), None
    return None, None
