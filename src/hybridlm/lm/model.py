"""The generative map of a decoder-only LM, and its state-space form (docs/theory.md §2–§3).

    H⁽⁰⁾ = U(s) W_e + P W_p                                   (embedding)
    H̃    = H⁽ℓ⁻¹⁾ + Attn_ℓ(LN_{ℓ,1}(H⁽ℓ⁻¹⁾))                    (attention sublayer)
    H⁽ℓ⁾ = H̃ + MLP_ℓ(LN_{ℓ,2}(H̃))                             (MLP sublayer)
    Y    = LN_f(H⁽ᴸ⁾) W_u,   z(s) = last row of Y                (readout)

One implementation serves every family; the parts that differ (norm, positions, MLP,
key/value grouping, biases, tying, score scale, global/local attention, and the parts some
families add: a scale on the embedding, QK-norm, norms after each sublayer, capped scores
and logits) are chosen by the `ModelConfig`. With post-sublayer norms (Gemma 2/3) a sublayer's
output is normed before its residual sum, H̃ = H + LN_{ℓ,1}'(Attn_ℓ(LN_{ℓ,1}(H))), and the hook
points `hook_attn_out` / `hook_mlp_out` see the normed output, which is what is added.

State-space form: `init_state(s)` prefills x from a string, `F(x, w)` appends tokens
(rebuilding from Π_T(s ∘ w) when the horizon T would be exceeded) and `G(x)` reads out
the logits z of the last position.
"""

from __future__ import annotations

from collections.abc import Iterator
import math
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from hybridlm.alphabet import check_tokens, selection_P, selection_U
from hybridlm.lm.attention import Attention
from hybridlm.lm.config import ModelConfig
from hybridlm.errors import InputError
from hybridlm.lm.direct import DirectModule
from hybridlm.lm.capture import Recordable
from hybridlm.lm.hooks import HookedModule, HookPoint
from hybridlm.lm.linear import affine, column_major_zeros
from hybridlm.lm.mlp import make_mlp
from hybridlm.lm.norm import LayerNorm, RMSNorm, make_norm
from hybridlm.lm.positions import LearnedPositions, Rotary
from hybridlm.lm.state import ForkedState, KVState, StateBatch
from hybridlm.lm.step import run_blocks, token_step

if TYPE_CHECKING:
    from hybridlm.lm.blockquant import BlockQuantLinear
    from hybridlm.tokenizer import Tokenizer


class Block(DirectModule):
    """Block 𝓑_ℓ: H⁽ℓ⁻¹⁾ ↦ H⁽ℓ⁾, pre-norm, two residual sublayers."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg, layer)
        self.ln2 = make_norm(cfg)
        self.mlp = make_mlp(cfg)
        # the norms of the sublayers' outputs (Gemma 2/3), None elsewhere
        self.ln1_post = make_norm(cfg) if cfg.post_norms else None
        self.ln2_post = make_norm(cfg) if cfg.post_norms else None
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, h, pos, state=None, rotary=None, step=None):
        """`step` (hybridlm.lm.step.TokenStep): a token step whose sublayers may run compiled, each
        in one call, where no hook point inside them is attached."""
        spec = None if step is None else step.table.spec(self)
        h = self.hook_resid_pre(h)
        a = self.attention_sublayer(h, pos, state, rotary) if spec is None else step.attention(spec, h)
        h = self.hook_resid_mid(h + self.hook_attn_out(a))
        m = self.mlp_sublayer(h) if spec is None else step.mlp(spec, h)
        return self.hook_resid_post(h + self.hook_mlp_out(m))

    def attention_sublayer(self, h, pos, state=None, rotary=None):
        """What the attention sublayer adds to the residual stream: Attn_ℓ(LN_{ℓ,1}(h)), normed where
        the family norms it."""
        a = self.attn(self.ln1(h), pos, state, rotary)
        return a if self.ln1_post is None else self.ln1_post(a)

    def mlp_sublayer(self, h):
        """What the MLP sublayer adds: MLP_ℓ(LN_{ℓ,2}(h)), normed where the family norms it."""
        m = self.mlp(self.ln2(h))
        return m if self.ln2_post is None else self.ln2_post(m)


class _Horizon(Protocol):
    """What the state-space form reads of a family's config."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...


class StateSpaceForm:
    """The state-space form of a language model (docs/theory.md §3): x_0 = init_state(s),
    x_{t+1} = F(x_t, w_{t+1}), z_t = G(x_t).

    Shared by every family: a family provides `forward(ids, state, last_only=...)`, which
    continues a state in place, and `empty_state(batch, capacity=...)`, which makes its
    kind of state (`KVState` for attention, `ssm.SSMState` for recurrences).
    """

    config: _Horizon
    W_e: torch.Tensor
    if TYPE_CHECKING:  # a family's own, and nn.Module's
        def empty_state(self, batch: int = 1, *, capacity: int = 64) -> Any: ...
        def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def init_state(self, s, *, capacity: int | None = None):
        """x_0: the state after prefilling the string(s) s ([n] or [B, n]); Π_T applied."""
        ids = self._check_ids(s)
        x = self.empty_state(ids.shape[0], capacity=capacity or ids.shape[1])
        return self.F(x, ids)

    @torch.no_grad()
    def F(self, x, w):
        """x_{t+1} = F(x_t, w): append the token(s) w ([B] or [B, m]), updating x in place.

        When n + m would exceed T the state is rebuilt from Π_T(s ∘ w) by a fresh prefill:
        dropping the oldest token changes every later row of the state (positions shift,
        and each row depends on the whole prefix), so trimming is not exact.
        The readout z = G(x) is refreshed.

        The step runs in inference mode (no autograd bookkeeping on the new tensors, which
        makes a decode step's many small kernels cheaper); the state's buffers and the
        readout it keeps are ordinary tensors, free to be read, changed or differentiated
        afterwards.
        """
        w = self._as_ids(w).to(x.device)
        if w.dim() == 1:
            w = w[None, :] if x.batch == 1 else w[:, None]
        w = self._check_ids(w)
        if w.shape[0] != x.batch:
            raise InputError(f"state holds a batch of {x.batch} strings, got tokens for {w.shape[0]}")
        T = self.config.n_ctx
        if x.n + w.shape[1] > T:
            s = torch.cat([x.tokens, w], dim=1)[:, -T:]  # Π_T(s ∘ w), row by row
            x.reset()
            x.rebuilds += 1
            w = s
        with torch.inference_mode():
            z = self(w, x, last_only=True)[:, -1]
        x.logits = z.clone()
        return x

    def step(self, states: list, w) -> list:
        """x^b ← F(x^b, w_b) for B independent states (each one sequence), one token each: the
        engine's flow step. This form steps them one by one; a family whose parts take a ragged
        batch (`DecoderLM`) overrides it with one pass for all."""
        w = _one_each(states, w)
        for x, token in zip(states, w):
            self.F(x, [int(token)])
        return states

    @staticmethod
    def G(x) -> torch.Tensor:
        """z = G(x_t): the logits of the last position, [B, V]."""
        if x.logits is None:
            raise InputError("the state is empty: prefill a string first (model.init_state)")
        return x.logits

    @staticmethod
    def _as_ids(ids) -> torch.Tensor:
        """ids as a tensor, refusing what a cast to long would silently change (1.7 → 1, True → 1)."""
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
                raise InputError(f"token ids must be integers, got {type(ids).__name__} ({exc})") from None
            if ids.numel() == 0:  # [] reads as an empty float tensor: nothing to change, "empty prompt" follows
                return ids.long()
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InputError(f"token ids must be integers, got a {ids.dtype} tensor")
        return ids.long()

    def _check_ids(self, ids) -> torch.Tensor:
        ids = self._as_ids(ids)
        if ids.dim() == 1:
            ids = ids[None, :]
        if ids.dim() != 2:
            raise InputError(f"token ids must have shape [B, n], got {tuple(ids.shape)}")
        check_tokens(ids, self.config.vocab_size)
        return ids.to(self.W_e.device)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _one_each(states: list, w) -> list[int]:
    """The engine's step takes one integer token per state."""
    w = [t.item() if isinstance(t, torch.Tensor) and t.numel() == 1 else t for t in w]
    if len(w) != len(states):
        raise InputError(f"{len(states)} states and {len(w)} tokens: a step takes one token per state")
    bad = next((t for t in w if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise InputError(f"token {bad!r}: a step takes integer token ids")
    return [int(t) for t in w]


class DecoderLM(StateSpaceForm, HookedModule, Recordable):
    """A decoder-only language model: logits = model(ids) for ids of shape [B, n]."""

    config: ModelConfig

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # W_e and W_u column-major, like every affine map's W (see hybridlm.lm.linear): the readout
        # h W_eᵀ is the largest product of a decode step and streams 20-25 % faster this way;
        # the embedding's row lookups become strided gathers, a few ms on a 512-token prefill.
        self.W_e = nn.Parameter(column_major_zeros(cfg.vocab_size, cfg.d_model))
        self.hook_embed = HookPoint()
        self.pos_embed = LearnedPositions(cfg) if cfg.positions == "learned" else None
        self.rotary = Rotary(cfg) if cfg.positions == "rotary" else None
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layer))
        self.ln_final = make_norm(cfg)
        self.W_u = None if cfg.tie_embeddings else nn.Parameter(column_major_zeros(cfg.vocab_size, cfg.d_model))
        self.hook_logits = HookPoint()
        self.readout_map: nn.Module | None = None  # a reduced-precision W_u (hybridlm.lm.quantize); None: exact
        self.embedding_rows: BlockQuantLinear | None = None  # W_e on a GGUF file's grid; None: W_e itself
        self.precision = "float32"
        self.tokenizer: Tokenizer | None = None  # set by the loader
        self.source = "config"  # where the weights came from, for reports
        self.gguf_path: Path | None = None  # the GGUF file the weights were read from, if any
        self.setup_hooks()

    # ------------------------------------------------------------------ pieces
    @property
    def unembedding(self) -> torch.Tensor:
        """W_u as a [V, d] matrix (W_u = W_eᵀ when tied: logits = h W_eᵀ)."""
        return self.W_e if self.W_u is None else self.W_u

    def embed(self, ids: torch.Tensor, pos: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """H⁽⁰⁾ = U(s) W_e + P W_p, computed as row lookups (H⁽⁰⁾ = γ_e U(s) W_e where the family
        scales its embedding by γ_e = `embed_scale`; `hook_embed` sees U(s) W_e).

        `prefix` ([p, d] or [B, p, d], rows of token-embedding space) is a soft prefix:
        its rows stand before U(s) W_e and take the first p positions, as tokens would.
        """
        e = self.W_e[ids] if self.embedding_rows is None else self.embedding_rows.rows(ids)
        if prefix is not None:
            e = torch.cat([prefix.to(e.dtype).expand(e.shape[0], -1, -1), e], dim=1)
        h = self.hook_embed(e)
        if self.config.embed_scale is not None:
            h = h * self.config.embed_scale
        if self.pos_embed is not None:
            h = h + self.pos_embed(pos)
        return h

    def embed_explicit(self, s) -> torch.Tensor:
        """H⁽⁰⁾ for one string, formed with the selection matrices U(s) and P (for analysis)."""
        cfg = self.config
        U = selection_U(s, cfg.vocab_size).to(self.W_e.dtype)
        h = U @ self.W_e
        if cfg.embed_scale is not None:
            h = h * cfg.embed_scale
        if self.pos_embed is not None:
            h = h + selection_P(U.shape[0], cfg.n_ctx).to(self.W_e.dtype) @ self.pos_embed.W_p
        return h

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Y = LN_f(H⁽ᴸ⁾) W_u, capped Y ↦ c·tanh(Y/c) where the family caps its logits."""
        h = self.ln_final(h)
        y = affine(h, self.unembedding) if self.readout_map is None else self.readout_map(h)
        cap = self.config.final_softcap
        return self.hook_logits(y if cap is None else torch.tanh(y / cap) * cap)

    # ------------------------------------------------------------------ the generative map
    def forward(
        self,
        ids: torch.Tensor,
        state: KVState | None = None,
        *,
        last_only: bool = False,
        layers: int | None = None,
        prefix: torch.Tensor | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """Logits [B, n, V] for token ids [B, n] (or [n]).

        With `state`, the ids are the next rows after the n positions already held, and
        the state is updated in place (a `ForkedState` is read, not changed). `last_only`
        reads out only the last row; `layers` stops after that many blocks (default: all L);
        `logits=False` returns the residual state H⁽ℓ⁾ there instead of the readout.

        `prefix` ([p, d] or [B, p, d]) prepends p soft-prefix rows to H⁽⁰⁾ (see `embed`);
        the output then has p + n rows. A state records them under the token id −1
        (no token has them), so Π_T must drop them before a rebuild can happen.
        Absent (the default), nothing changes.
        """
        ids = self._check_ids(ids)
        start = 0 if state is None else state.n
        p = 0 if prefix is None else self._check_prefix(prefix)
        m = ids.shape[1] + p
        if start + m > self.config.n_ctx:
            raise InputError(
                f"{start + m} positions exceed the context horizon T={self.config.n_ctx}; "
                "truncate with Π_T first (hybridlm.alphabet.truncate, or use model.F)"
            )
        pos = torch.arange(start, start + m, device=ids.device)
        self.hook_ctx.pos = pos
        if state is not None:
            state.reserve(m)
        h = self.embed(ids, pos) if prefix is None else self.embed(ids, pos, prefix)
        rotary = self.rotary  # (read once; slicing a ModuleList builds a new one, so only when asked)
        if rotary is not None:
            rotary.reach(start + m)
        if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)
                                       and 0 <= layers <= self.config.n_layer):
            raise InputError(f"layers={layers!r}: expected a number of blocks 0 ≤ layers ≤ {self.config.n_layer}")
        blocks = self.blocks if layers is None else self.blocks[:layers]
        h = run_blocks(blocks, h, pos, state, rotary, token_step(self, h, state, rotary))
        if state is not None:
            state.commit(ids if prefix is None else torch.cat([ids.new_full((ids.shape[0], p), -1), ids], dim=1))
        if isinstance(state, ForkedState) and layers in (None, self.config.n_layer):
            state.final = h[:, -1]
        h = h[:, -1:] if last_only else h
        return self.readout(h) if logits else h

    # ------------------------------------------------------------------ state-space form
    @torch.no_grad()
    def step(self, states: list, w) -> list:
        """x^b ← F(x^b, w_b) for B independent states at once, one token each (the engine's flow
        step). Each state keeps its own rows and length; the products read every weight once for
        all rows and are batch-invariant, and attention runs row by row against each state, so
        state b ends with the bits F(x^b, w_b) alone gives it. A state whose next token would
        pass the horizon T takes F alone (its rebuild from Π_T(s ∘ w)).
        """
        w = _one_each(states, w)
        check_tokens(w, self.config.vocab_size)
        T = self.config.n_ctx
        adopted = self._adopt(states, w)
        rows = [b for b, x in enumerate(states) if isinstance(x, KVState) and x.batch == 1 and x.n < T
                and b not in adopted]
        for b in sorted(set(range(len(states))) - set(rows) - adopted):
            self.F(states[b], [w[b]])
        if rows:
            batch = StateBatch([states[b] for b in rows])
            ids = torch.tensor([[w[b]] for b in rows], dtype=torch.long, device=self.W_e.device)
            with torch.inference_mode():
                z = self._forward_rows(ids, batch)
            for i, b in enumerate(rows):
                states[b].logits = z[i : i + 1].clone()
        return states

    def _adopt(self, states: list, w: list[int]) -> set[int]:
        """The states whose chosen successor a fork already computed (a hidden-state barrier's
        candidates): its rows are adopted, and only its readout is taken. (The hook points do
        not fire for such a step: the engine keeps no fork where a hook would watch it.)"""
        forks = [b for b, x in enumerate(states) if getattr(x, "successors", None) is not None]
        done = set()
        for b in forks:
            x = states[b]
            fork, x.successors = x.successors, None
            if fork.parent is x and fork.adopt(w[b]):
                i = fork.tokens.index(w[b])
                with torch.inference_mode():
                    x.logits = self.readout(fork.final[i : i + 1][:, None])[:, -1].clone()
                done.add(b)
        return done

    def _forward_rows(self, ids: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        """The logits [B, V] of one new token per state of a ragged batch (row b at position n_b)."""
        pos = batch.n.to(ids.device)[:, None]  # [B, 1]: each row its own position
        self.hook_ctx.pos = pos
        h = self.embed(ids, pos)
        rotary = self.rotary
        if rotary is not None:
            rotary.reach(int(pos.max()) + 1)
        h = run_blocks(self.blocks, h, pos, batch, rotary, token_step(self, h, batch, rotary))
        batch.commit(ids)
        return self.readout(h)[:, -1]

    def empty_state(self, batch: int = 1, *, capacity: int = 64) -> KVState:
        p = self.W_e
        return KVState(self.config, batch, capacity=capacity, dtype=p.dtype, device=p.device)

    # ------------------------------------------------------------------ helpers
    def _check_prefix(self, prefix: torch.Tensor) -> int:
        d = self.config.d_model
        if not isinstance(prefix, torch.Tensor) or prefix.dim() not in (2, 3) or prefix.shape[-1] != d:
            shape = tuple(prefix.shape) if isinstance(prefix, torch.Tensor) else type(prefix).__name__
            raise InputError(f"soft prefix of shape {shape}: expected [p, d] or [B, p, d] with d = {d}")
        return prefix.shape[-2]

    def __repr__(self) -> str:
        c = self.config
        return (
            f"DecoderLM(family={c.family}, V={c.vocab_size}, T={c.n_ctx}, d={c.d_model}, "
            f"L={c.n_layer}, N_h={c.n_head}, N_kv={c.n_kv_head}, params={self.num_parameters():,}, "
            f"source={self.source})"
        )


def init_weights(model: DecoderLM, seed: int = 0, *, part: nn.Module | None = None) -> DecoderLM:
    """GPT-2's initialisation: N(0, σ²) everywhere, residual projections σ/√(2L), zero biases.

    `part` (e.g. `model.blocks`) restricts the draw to that submodule.
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    std = cfg.init_std
    residual_std = std / math.sqrt(2 * cfg.n_layer)
    root = model if part is None else part
    gains = {id(m.weight) for m in root.modules() if isinstance(m, (LayerNorm, RMSNorm))}
    with torch.no_grad():
        for name, p in root.named_parameters():
            if id(p) in gains:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                _normal_(p, residual_std if name.endswith(("W_O.weight", "W_proj.weight", "W_down.weight")) else std, g)
    return model


def _normal_(p: torch.Tensor, std: float, g: torch.Generator) -> None:
    """p ← randn(p.shape) · std from the CPU generator g: in place where p is a contiguous float32 CPU
    tensor (no new tensor: a 2.7B-parameter model is redrawn every pass); otherwise (a transposed view
    such as a tied embedding, another dtype or device) drawn in float32 in index order and copied."""
    if p.is_contiguous() and p.dtype == torch.float32 and p.device.type == "cpu":
        p.normal_(0.0, std, generator=g)
    else:
        p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
