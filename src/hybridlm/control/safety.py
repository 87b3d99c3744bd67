"""A safety filter in the control-barrier style (survey, "Safety and Alignment", refs. [108]–[109]).

A barrier h on strings (or on the final hidden state) defines the safe set
𝒮 = {s : h(s) ≥ 0}. The filter keeps the next state in 𝒮: at step t it removes every
token whose one-step successor leaves it,

    M_t(w) = 1  ⇔  h(Π_T(s_t ∘ w)) ≥ 0,        p_safe(w | s_t) = M_t(w) p(w | s_t) / Σ_u M_t(u) p(u | s_t),

so a string that starts in 𝒮 never leaves it (forward invariance, the discrete analogue
of a CBF condition with the decay rate set to zero). The probability mass Σ_{M_t(w)=0} p(w)
it removes is recorded at every step. When no candidate is safe, the filter says so and
applies its fallback: end the text with a stop token (default), pass the step unfiltered,
or raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridlm.control.controllers import Controller, Observation, register
from hybridlm.control.inputs import KernelInput, residual_point
from hybridlm.errors import HybridLMError, InputError
from hybridlm.lm.state import ForkedState, KVState

ON_EMPTY = ("stop", "unfiltered", "raise")


class NoSafeToken(HybridLMError, RuntimeError):
    """Raised by a filter with on_empty="raise" when every candidate token violates h ≥ 0."""


class Barrier:
    """h on the next state: `unsafe_next(obs)` is the [B, V] set {w : h(s_t ∘ w) < 0}."""

    def unsafe_next(self, obs: Observation) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"barrier": type(self).__name__}


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class BannedWords(Barrier):
    """h(s) = −(number of occurrences of banned words in the text of s).

    By default every occurrence counts, inside other words too, case ignored: banning
    "Paris" bans " Paris", "Parisian", "ofParis" and "comparison" alike. This is the
    strict reading of "the text never contains the word": a word-start rule alone lets
    a model route around it by gluing the word to the previous one ("ofParis", which
    SmolLM2 does). `word_start=True` counts only occurrences that begin a word (the
    character before is not a letter, digit or underscore); `case_sensitive=True`
    respects case. A word may span several tokens and may be completed by a token that
    also carries other text: at step t the token w is unsafe iff s_t ∘ w holds an
    occurrence that s_t does not, i.e. iff w
      (a) holds the word inside its own text (at an index > 0), or
      (b) starts with the rest w[j:] of a word whose head w[:j] the text s_t ends with,
          j = 0 … len − 1 (j = 0: w starts with the whole word).
    One step suffices: every path into a violation passes through a token that completes it.
    """

    def __init__(self, words: Sequence[str], tokenizer, *, case_sensitive: bool = False, word_start: bool = False):
        if isinstance(words, str):
            words = [w for w in words.split(",")]
        words = [w.strip() for w in words]
        if not words or any(not w for w in words):
            raise InputError(f"banned words {list(words)!r}: expected a non-empty list of non-empty words")
        if tokenizer is None:
            raise InputError("a banned-word barrier needs a model with a tokenizer")
        self.words = list(dict.fromkeys(words))
        self.case_sensitive, self.word_start = case_sensitive, word_start
        self.table = tokenizer.table
        texts = [self._fold(s) for s in self.table.texts]
        keys = [self._fold(w) for w in self.words]
        self._keys = keys
        self.inner = torch.tensor([any(self._inner_hit(s, k) for k in keys) for s in texts])
        self.heads = {k: torch.tensor([[s.startswith(k[j:]) for s in texts] for j in range(len(k))]) for k in keys}

    def _fold(self, s: str) -> str:
        return s if self.case_sensitive else s.lower()

    def _starts_word(self, text: str, i: int) -> bool:
        return not self.word_start or i == 0 or not _is_word_char(text[i - 1])

    def _inner_hit(self, s: str, key: str) -> bool:
        """(a): the key occurs in s at an index i > 0 (that begins a word, under `word_start`)."""
        i = s.find(key, 1)
        while i > 0:
            if self._starts_word(s, i):
                return True
            i = s.find(key, i + 1)
        return False

    def count(self, text: str) -> int:
        """Number of occurrences of banned words in text (the quantity −h)."""
        text = self._fold(text)
        n = 0
        for k in self._keys:
            i = text.find(k)
            while i >= 0:
                n += self._starts_word(text, i)
                i = text.find(k, i + 1)
        return n

    def unsafe_row(self, text: str) -> torch.Tensor:
        """{w : s ∘ w holds a new occurrence}, for the text s of one row: (a) ∪ (b)."""
        text = self._fold(text)
        unsafe = self.inner.clone()
        for k, head in self.heads.items():
            for j in range(len(k)):
                if text.endswith(k[:j]) and self._starts_word(text, len(text) - j):
                    unsafe |= head[j]
        return unsafe

    def unsafe_next(self, obs: Observation) -> torch.Tensor:
        V = obs.z.shape[-1]
        rows = [self.unsafe_row(text) for text in obs.texts]
        out = torch.stack(rows)
        if out.shape[-1] < V:  # tokens the tokenizer does not know (padding rows of W_e) have no text
            out = torch.cat([out, out.new_zeros(out.shape[0], V - out.shape[-1])], dim=-1)
        return out[:, :V].to(obs.z.device)

    def describe(self) -> dict:
        return {"barrier": "banned_words", "words": self.words, "case_sensitive": self.case_sensitive,
                "word_start": self.word_start}


class HiddenBarrier(Barrier):
    """h(s) = c(h⁽ℓ⁾_last(s)): a classifier c on the last position's residual state (ℓ = L: final).

    The successor states of the `candidates` most likely tokens are computed exactly, as one
    decode step of k rows forked from the current state (`ForkedState`: the rows of s are
    shared, each candidate adds its own); tokens outside that set are not verified and count
    as unsafe, so the filter only ever samples verified-safe tokens.
    """

    def __init__(self, model, classifier: Callable[[torch.Tensor], torch.Tensor], *, candidates: int = 16,
                 layer: int | None = None):
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise InputError(f"candidates={candidates!r}: expected an integer ≥ 1")
        self.model, self.classifier, self.candidates = model, classifier, candidates
        L = model.config.n_layer
        self.layer = L if layer is None else layer
        self.point = residual_point(model, self.layer)

    @torch.no_grad()
    def unsafe_next(self, obs: Observation) -> torch.Tensor:
        z, x = obs.z, obs.state
        if not isinstance(x, KVState):  # a fork of successors is built from keys and values
            raise InputError(f"a hidden-state barrier needs a transformer's KV state, not a {type(x).__name__}")
        if z.shape[0] != 1 or x.batch != 1:
            raise InputError("a hidden-state barrier acts on one sequence at a time (the engine gives it one row)")
        if bool((x.tokens < 0).any()):
            raise InputError("a hidden-state barrier cannot fork a context that holds a soft prefix")
        unsafe = torch.ones_like(z, dtype=torch.bool)
        top = torch.topk(z[0], min(self.candidates, z.shape[-1]))
        cand = top.indices[torch.isfinite(top.values)]
        if cand.numel() == 0:
            return unsafe
        kept = {}

        def keep(h, hook):
            kept["h"] = h[:, -1]

        L = self.model.config.n_layer
        fork = ForkedState(x, cand.numel())
        with self.model.hooks([(self.point, keep)]):  # the blocks up to the point, nothing after
            self.model(cand[:, None], fork, layers=min(self.layer + 1, L), logits=False)
        x.successors = fork  # the step that follows adopts the chosen candidate's rows (DecoderLM.step)
        ok = torch.as_tensor(self.classifier(kept["h"])).reshape(-1) >= 0
        unsafe[0, cand[ok]] = False
        return unsafe

    def describe(self) -> dict:
        return {"barrier": "hidden_state", "layer": self.layer, "candidates": self.candidates}


@register("safety")
class SafetyFilter(Controller):
    """M_t = {w : h(s_t ∘ w) ≥ 0}; when M_t is empty: `on_empty` ∈ stop | unfiltered | raise."""

    order = 100

    def __init__(self, barrier: Barrier, *, on_empty: str = "stop"):
        if not isinstance(barrier, Barrier):
            raise InputError(f"{barrier!r} is not a Barrier")
        if on_empty not in ON_EMPTY:
            raise InputError(f"on_empty={on_empty!r}: expected one of {ON_EMPTY}")
        self.barrier, self.on_empty = barrier, on_empty

    def act(self, obs: Observation) -> KernelInput | None:
        live = torch.isfinite(obs.z)
        unsafe = self.barrier.unsafe_next(obs) & live
        if not bool(unsafe.any()):
            return None
        safe = live & ~unsafe
        empty = [b for b in range(safe.shape[0]) if not bool(safe[b].any())]
        if not empty:
            return KernelInput(mask=safe)
        action = self._fallback(obs, safe, live, empty)
        return KernelInput(mask=safe, note={"no_safe_token": empty, "action": action},
                           override=empty if action == "stop" else None)

    def _fallback(self, obs, safe, live, rows) -> str:
        """Nothing safe in these rows: allow only the stop tokens (the text ends), or everything live."""
        if self.on_empty == "raise":
            raise NoSafeToken(f"token step {obs.t}: no token keeps h ≥ 0 (rows {rows})")
        stops = sorted(i for i in obs.stop_ids if i < safe.shape[-1])
        for b in rows:
            if self.on_empty == "stop" and stops:
                safe[b, stops] = True
            else:
                safe[b] = live[b]
        return "stop" if self.on_empty == "stop" and stops else "unfiltered"

    def describe(self) -> dict:
        return {"controller": self.name, "on_empty": self.on_empty, **self.barrier.describe()}


def ban_words(words, tokenizer, **kwargs) -> SafetyFilter:
    """The safety filter for a banned-word list (comma-separated string or list)."""
    on_empty = kwargs.pop("on_empty", "stop")
    return SafetyFilter(BannedWords(words, tokenizer, **kwargs), on_empty=on_empty)


@register("mask")
class TokenMask(Controller):
    """A fixed hard mask M: only the listed tokens are allowed (or, with `ban=True`, all but them)."""

    order = 60

    def __init__(self, tokens: Sequence[int], *, ban: bool = False):
        self.tokens, self.ban = [int(t) for t in tokens], ban
        if not self.tokens:
            raise InputError("an empty token list: expected at least one token id")

    def act(self, obs: Observation) -> KernelInput:
        listed = torch.zeros_like(obs.z, dtype=torch.bool)
        listed[:, self.tokens] = True
        return KernelInput(mask=~listed if self.ban else listed)

    def describe(self) -> dict:
        return {"controller": self.name, "tokens": self.tokens, "ban": self.ban}
