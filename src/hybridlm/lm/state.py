"""The KV state x_t (docs/theory.md §3).

By causal prefix invariance the keys and values of every layer and head over the
positions 1..n are a sufficient statistic of the past:

    x_t = {K^{(ℓ,m)}_{1:n}, V^{(ℓ,m)}_{1:n}},   x_{t+1} = F(x_t, w_{t+1}),   z = G(x_t).

`KVState` holds them in one pre-allocated buffer of shape [L, 2, B, N_kv, capacity, d_k]
(capacity grows geometrically up to T, so an append never concatenates), together with
the string s_t it summarises (needed to rebuild the state when Π_T drops a token) and
the readout z of its last position. The maps F and G live on the model
(`DecoderLM.F`, `DecoderLM.G`) because they need its weights.
"""

from __future__ import annotations

import torch

from hybridlm.lm.config import ModelConfig

_MIN_CAPACITY = 64

# The buffers are made outside inference mode even when F (which runs in it) grows them, so a
# state stays an ordinary tensor that any later call, with or without autograd, may update.
_ordinary = torch.inference_mode(False)


class KVState:
    @_ordinary
    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        *,
        capacity: int = _MIN_CAPACITY,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.batch = batch
        self.n = 0
        capacity = min(cfg.n_ctx, max(_MIN_CAPACITY, capacity))
        self.kv = torch.zeros(
            cfg.n_layer, 2, batch, cfg.n_kv_head, capacity, cfg.d_head, dtype=dtype, device=device
        )
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None  # z: readout at the last position, [B, V]
        self.rebuilds = 0  # how many times Π_T forced a re-prefill
        self.successors: "ForkedState | None" = None  # a fork of the next step, computed for a barrier

    @property
    def kv(self) -> torch.Tensor:
        """The whole buffer [L, 2, B, N_kv, capacity, d_k]."""
        return self._kv

    @kv.setter
    def kv(self, buffer: torch.Tensor) -> None:
        self._kv = buffer
        self._layers = [(buffer[layer, 0], buffer[layer, 1]) for layer in range(buffer.shape[0])]

    @property
    def device(self) -> torch.device:
        return self._kv.device

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def dim(self) -> int:
        """Number of real numbers in x_t: 2 · L · N_kv · d_k · n per sequence."""
        c = self.cfg
        return 2 * c.n_layer * c.n_kv_head * c.d_head * self.n

    def nbytes(self) -> int:
        """Bytes of the filled part of the state (all sequences of the batch)."""
        return self.dim * self.batch * self.kv.element_size()

    # ------------------------------------------------------------------ views
    def keys(self, layer: int) -> torch.Tensor:
        """K^{(ℓ,·)}_{1:n}: [B, N_kv, n, d_k]."""
        return self.kv[layer, 0, :, :, : self.n]

    def values(self, layer: int) -> torch.Tensor:
        """V^{(ℓ,·)}_{1:n}: [B, N_kv, n, d_k]."""
        return self.kv[layer, 1, :, :, : self.n]

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer over the whole capacity, [B, N_kv, capacity, d_k] each (views of
        the contiguous buffer, for a step that writes row n itself)."""
        return self._layers[layer]

    # ------------------------------------------------------------------ updates (used by F)
    @_ordinary
    def reserve(self, m: int) -> None:
        """Make room for m more positions (m ≤ T − n)."""
        need = self.n + m
        if need > self.cfg.n_ctx:
            raise ValueError(f"state holds {self.n} positions; {m} more exceed T={self.cfg.n_ctx}")
        if need <= self.capacity:
            return
        capacity = min(self.cfg.n_ctx, max(need, 2 * self.capacity))
        grown = self.kv.new_zeros(*self.kv.shape[:4], capacity, self.kv.shape[5])
        grown[..., : self.n, :] = self.kv[..., : self.n, :]
        self.kv = grown

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows k, v ([B, N_kv, m, d_k]) after position n; return K, V over 1..n+m."""
        end = self.n + k.shape[2]
        K, V = self._layers[layer]  # views of the buffer, made once per allocation
        K[:, :, self.n : end] = k
        V[:, :, self.n : end] = v
        return K[:, :, :end], V[:, :, :end]

    @_ordinary
    def commit(self, w: torch.Tensor) -> None:
        """Record that the tokens w ([B, m]) entered the state."""
        self.tokens = torch.cat([self.tokens, w], dim=1)
        self.n += w.shape[1]

    @_ordinary
    def crop(self, n: int) -> None:
        """Keep the first n positions: the string's end is dropped (a jump map that rewrites it), its rows
        written over by the next append."""
        if not 0 <= n <= self.n:
            raise ValueError(f"crop to {n} positions: the state holds {self.n}")
        self.n = n
        self.tokens = self.tokens[:, :n]
        self.logits = None
        self.successors = None

    def reset(self) -> None:
        self.n = 0
        self.tokens = self.tokens[:, :0]
        self.logits = None

    @_ordinary
    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only the sequences `rows` of the batch (in that order), in place."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.kv.device)
        self.kv = self.kv.index_select(2, rows)
        self.tokens = self.tokens.index_select(0, rows)
        self.logits = None if self.logits is None else self.logits.index_select(0, rows)
        self.batch = int(rows.numel())

    # ------------------------------------------------------------------ copies
    @_ordinary
    def clone(self, *, compact: bool = False) -> "KVState":
        """An independent copy: F updates a state in place, so keep x_t with x.clone(). `compact`: the
        copy's buffer holds the filled part only (a kept state, e.g. a cached prefix), and only that
        part is copied."""
        other = KVState.__new__(KVState)
        other.cfg, other.batch, other.n, other.rebuilds = self.cfg, self.batch, self.n, self.rebuilds
        other.kv = (self.kv[..., : max(self.n, 1), :] if compact else self.kv).clone()
        other.tokens = self.tokens.clone()
        other.logits = None if self.logits is None else self.logits.clone()
        return other

    def __repr__(self) -> str:
        return (
            f"KVState(batch={self.batch}, n={self.n}, T={self.cfg.n_ctx}, layers={self.cfg.n_layer}, "
            f"kv_heads={self.cfg.n_kv_head}, d_k={self.cfg.d_head}, bytes={self.nbytes()})"
        )


class StateBatch:
    """B independent states stepped together by one token each: a ragged batch, in which every
    sequence keeps its own buffer, capacity and length n_b (sequences join and leave the
    engine's batch between any two steps, so their lengths differ).

    The blocks pass it to attention in place of one state; the new row of sequence b sits at
    position n_b. Room for that row is made here, before any layer writes.
    """

    def __init__(self, states: list[KVState]) -> None:
        self.states = list(states)
        for x in self.states:
            x.reserve(1)
        self.batch = len(self.states)
        self.n = torch.tensor([x.n for x in self.states], dtype=torch.long)
        self._meta: torch.Tensor | None = None

    def meta(self) -> torch.Tensor | None:
        """The compiled step's table of rows (`step_rows`), or None when some buffer is not
        contiguous float32 on the CPU."""
        if self._meta is None:
            self._meta = step_rows(self.states)
        return self._meta

    def commit(self, w: torch.Tensor) -> None:
        """Record that the tokens w ([B, 1]) entered the states, row b into state b."""
        for b, x in enumerate(self.states):
            x.commit(w[b : b + 1])


class ForkedState:
    """k one-token continuations of one state, s ∘ w_1, …, s ∘ w_k, read-only: the parent's rows
    are shared by all k (not copied), each candidate's own new row is held apart and dropped
    afterwards. What a hidden-state barrier needs: the successor states of k candidate tokens
    from one state, at the cost of one decode step of k rows."""

    def __init__(self, parent: KVState, k: int) -> None:
        if parent.batch != 1:
            raise ValueError(f"a fork starts from one sequence, the state holds {parent.batch}")
        if parent.n >= parent.cfg.n_ctx:
            raise ValueError(f"the state holds T={parent.cfg.n_ctx} positions: no room for a successor")
        self.parent, self.batch, self.n = parent, k, parent.n
        self.cfg = parent.cfg
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer → the candidates' new (k, v) rows
        self.tokens: list[int] = []  # the candidates, once committed by the forward
        self.final: torch.Tensor | None = None  # their H⁽ᴸ⁾, [k, d], when every block ran

    def reserve(self, m: int) -> None:
        if m != 1:
            raise ValueError(f"a fork continues by one token, not {m}")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the candidates' new rows k, v ([k, H_kv, d_k], rotated) of a layer apart from the parent."""
        self.rows[layer] = (k, v)

    def commit(self, w: torch.Tensor) -> None:
        self.tokens = [int(t) for t in w.reshape(-1)]  # the parent itself is left as it was

    def complete(self) -> bool:
        """Whether every layer's rows and the final state were computed (a successor can be adopted)."""
        return self.final is not None and len(self.rows) == self.cfg.n_layer

    def adopt(self, token: int) -> bool:
        """x ← F(x, w) for a candidate w without computing it again: its rows of every layer enter the
        parent at position n. False when w is not a candidate or the fork is incomplete."""
        if token not in self.tokens or not self.complete() or self.parent.n != self.n:
            return False
        i = self.tokens.index(token)
        x = self.parent
        x.reserve(1)
        for layer, (k, v) in self.rows.items():
            K, V = x.layer_buffers(layer)
            K[0, :, self.n] = k[i]
            V[0, :, self.n] = v[i]
        x.commit(torch.tensor([[token]], dtype=torch.long, device=x.device))
        return True



def step_rows(states: list[KVState]) -> torch.Tensor | None:
    """Where a token step's rows keep their keys and values, for the compiled kernels: [5, R]
    int64 over the rows of the states in order (a state of B sequences gives B rows), holding each
    row's address of its layer-0 keys, its capacity, its length n, and (in floats) the stride from
    one layer's keys to the next and from a layer's keys to its values. None when some buffer is
    not contiguous float32 on the CPU."""
    columns = []
    for x in states:
        kv = x.kv
        if kv.dtype != torch.float32 or not kv.is_cpu or not kv.is_contiguous():
            return None
        B, H_kv, cap, d = kv.shape[2:]
        head = H_kv * cap * d  # floats of one sequence's keys in one layer
        columns += [(kv.data_ptr() + 4 * b * head, cap, x.n, 2 * B * head, B * head) for b in range(B)]
    return torch.tensor(columns, dtype=torch.int64).t().contiguous()
