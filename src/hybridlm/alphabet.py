"""The alphabet 𝒱, the free monoid 𝒱* and the truncation operator Π_T (docs/theory.md §2).

Strings are sequences of token ids in [0, V). Concatenation ∘ is associative with the
empty string as identity; Π_T keeps the trailing suffix of length at most T and is
idempotent. The selection matrices U(s) and P turn a string into the one-hot objects
of the embedding equation H⁽⁰⁾ = U(s) W_e + P W_p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridlm.errors import InputError

Tokens = Sequence[int] | torch.Tensor


def concat(s: Tokens, w: Tokens) -> list[int]:
    """s ∘ w: the concatenation of two strings."""
    return [int(x) for x in _as_list(s)] + [int(x) for x in _as_list(w)]


def truncate(s: Tokens, T: int) -> list[int]:
    """Π_T(s): s itself if |s| ≤ T, otherwise its trailing suffix of length T."""
    if T < 1:
        raise InputError(f"context horizon T={T}: expected T ≥ 1")
    s = [int(x) for x in _as_list(s)]
    return s if len(s) <= T else s[len(s) - T :]


def check_tokens(s: Tokens, V: int) -> torch.Tensor:
    """Return s as a LongTensor after checking it is a non-empty string over [0, V)."""
    if not isinstance(s, torch.Tensor):
        s = list(s)
        # Python integers first: one past the int64 range would make torch raise its own overflow error
        outside = next((i for i in s if isinstance(i, int) and not 0 <= i < V), None)
        if outside is not None:
            raise InputError(f"token id {outside} is outside the alphabet: expected 0 ≤ id < V = {V}")
    ids = torch.as_tensor(s, dtype=torch.long)
    if ids.numel() == 0 or ids.shape[-1] == 0:
        raise InputError("empty prompt: the context s must hold at least one token")
    bad = (ids < 0) | (ids >= V)
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise InputError(f"token id {value} is outside the alphabet: expected 0 ≤ id < V = {V}")
    return ids


def selection_U(s: Tokens, V: int) -> torch.Tensor:
    """U(s) ∈ {0,1}^{n×V}: row i is e_{idx(w_i)}ᵀ."""
    ids = check_tokens(s, V)
    return torch.nn.functional.one_hot(ids, V).to(torch.float32)


def selection_P(n: int, T: int, start: int = 0) -> torch.Tensor:
    """P ∈ {0,1}^{n×T}: row i is p_{start+i}ᵀ, the one-hot vector of position start+i."""
    if start < 0 or start + n > T:
        raise InputError(f"positions {start}..{start + n - 1} do not fit the horizon T={T}")
    return torch.nn.functional.one_hot(torch.arange(start, start + n), T).to(torch.float32)


def _as_list(s: Tokens) -> list[int]:
    if isinstance(s, torch.Tensor):
        if s.dim() != 1:
            raise InputError(f"a string is a 1-d sequence of token ids, got shape {tuple(s.shape)}")
        return s.tolist()
    return list(s)
