"""How tokens enter a sequence's state: the prefill phase, prefix reuse, and the context horizon.

Prefill in canonical segments. A prompt is prefilled segment by segment, with boundaries at
the cuts of a grid that depends on positions alone (`grid`: cells of `SEGMENT` tokens at the start
of a context, shorter ones deeper in it, where each token reads more keys) and at the marks the
caller gives (the ends of chat messages). So the state after a prefix is always computed the same
way, whatever follows it, and a cache of states keyed by their segments is exact to the last bit:
by causal prefix invariance (docs/theory.md §3) the state of s is the state of its prefix p
continued with the rest, and with the same segments it is the same arithmetic.

`PrefixCache` holds such states in a trie of segments, bounded in bytes (a segmented LRU: what
is found again is dropped last): a shared system prompt, a tool list or the earlier turns of a
conversation are prefilled once.

The context horizon T. Π_T keeps the last T tokens. `ContextPolicy("exact")` applies it at
every step past T (each such step rebuilds the state from Π_T(s ∘ w): the reference, and a
full prefill of T tokens per step). The block policy makes reaching n = T a guard of the
hybrid system whose jump map truncates the string to its last T − δ tokens once (one
rebuild), after which δ ordinary steps follow; it is the default, with δ = T/8.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridlm.errors import InputError
from hybridlm.lm.state import KVState

SEGMENT = 128  # positions of the first canonical prefill segment (the grid's scale), by default


# ---------------------------------------------------------------------- the context horizon
@dataclass(frozen=True)
class ContextPolicy:
    """What happens when a sequence reaches the context horizon T: "exact" (Π_T at every step) or
    "block" (truncate to T − δ once; δ = None: T/8)."""

    kind: str = "block"
    delta: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("exact", "block"):
            raise InputError(f"context policy {self.kind!r}: expected exact or block[:δ]")
        if self.delta is not None and (isinstance(self.delta, bool) or not isinstance(self.delta, int)
                                       or self.delta < 1):
            raise InputError(f"context policy block:{self.delta!r}: expected δ an integer ≥ 1")

    @classmethod
    def parse(cls, text: str) -> "ContextPolicy":
        """'exact', 'block' or 'block:δ'."""
        kind, _, given = str(text).strip().partition(":")
        if given:
            try:
                delta = int(given)
            except ValueError:
                raise InputError(f"context policy {text!r}: δ must be a positive integer, e.g. block:256") from None
            return cls(kind, delta)
        return cls(kind)

    def margin(self, T: int) -> int:
        """δ for a horizon T (at least 1, less than T)."""
        if self.kind == "exact":
            return 0
        delta = self.delta if self.delta is not None else max(1, T // 8)
        if delta >= T:
            raise InputError(f"context policy block:{delta}: δ must be below the horizon T={T}")
        return delta

    def keep(self, T: int) -> int:
        """How many trailing tokens a string keeps when it must fit: T (exact) or T − δ (block)."""
        return T - self.margin(T)

    def describe(self) -> str:
        return "exact" if self.kind == "exact" else "block" if self.delta is None else f"block:{self.delta}"


# ---------------------------------------------------------------------- prefix reuse
class _Node:
    __slots__ = ("children", "state", "parent", "segment")

    def __init__(self, parent=None, segment=()) -> None:
        self.children: dict[tuple, _Node] = {}
        self.state = None
        self.parent, self.segment = parent, segment


class PrefixCache:
    """States of prefilled prefixes in a trie of canonical segments, bounded in bytes.

    Eviction is a segmented LRU: a state enters on probation and is protected once it is found again
    (a shared system prompt, a tool list, a conversation that continues). Room is made from the
    probationary states only, least recently used first, and a state larger than the room the protected
    ones leave is not kept: so one long conversation's copies, seen once, cannot push out the prefixes
    every client shares. Protected states keep at most `protect` of the bytes (some room is always
    left); past that their least recently used goes back on probation."""

    def __init__(self, max_bytes: int = 256 * 2**20, *, protect: float = 0.8) -> None:
        if max_bytes < 0:
            raise InputError(f"prefix cache of {max_bytes} bytes: expected ≥ 0")
        if not 0 <= protect < 1:
            raise InputError(f"prefix cache protected share {protect!r}: expected at least 0 and below 1")
        self.max_bytes = max_bytes
        self.protect = protect
        self.root = _Node()
        # nodes holding a state, least recently used first: seen once, and found again since
        self._probation: OrderedDict[int, _Node] = OrderedDict()
        self._protected: OrderedDict[int, _Node] = OrderedDict()
        self.bytes = self.protected_bytes = 0
        self.hits = self.misses = self.hit_tokens = 0

    def longest(self, segments: Sequence[tuple]) -> tuple[int, object] | None:
        """The deepest cached state along these segments: (segments matched, a copy of its state)."""
        node: _Node | None = self.root
        best: tuple[int, _Node] | None = None
        for depth, seg in enumerate(segments):
            node = node.children.get(seg) if node is not None else None
            if node is None:
                break
            if node.state is not None:
                best = (depth + 1, node)
        if best is None:
            self.misses += 1
            return None
        depth, found = best
        state: Any = found.state
        self.hits += 1
        self.hit_tokens += state.n
        self._promote(found)
        return depth, state.clone()

    def put(self, segments: Sequence[tuple], state) -> None:
        """Keep a copy of the state reached after these segments."""
        size = _nbytes(state)
        if size > self.max_bytes - self.protected_bytes:  # kept, it would push out what is shared
            return
        node = self.root
        for seg in segments:
            node = node.children.setdefault(seg, _Node(node, seg))
        if node.state is not None:
            self._promote(node)
            return
        node.state = compact_copy(state)
        self._probation[id(node)] = node
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop()

    def _promote(self, node: _Node) -> None:
        """Found again: protected, most recently used."""
        key = id(node)
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        del self._probation[key]
        self._protected[key] = node
        self.protected_bytes += _nbytes(node.state)
        while self.protected_bytes > self.protect * self.max_bytes and len(self._protected) > 1:
            _, old = self._protected.popitem(last=False)  # back on probation, as its most recent
            self.protected_bytes -= _nbytes(old.state)
            self._probation[id(old)] = old

    def _drop(self) -> None:
        """Evict the least recently used state on probation (there is one: what was put fits beside the
        protected states)."""
        _, old = self._probation.popitem(last=False)
        self.bytes -= _nbytes(old.state)
        old.state = None
        while old is not self.root and old.state is None and not old.children:  # prune empty branches
            del old.parent.children[old.segment]
            old = old.parent

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def stats(self) -> dict:
        return {"entries": len(self), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "protected_bytes": self.protected_bytes, "hits": self.hits, "misses": self.misses,
                "hit_tokens": self.hit_tokens}


def _nbytes(state) -> int:
    return int(state.nbytes()) if hasattr(state, "nbytes") else 0


def compact_copy(state):
    """A copy holding only the filled part of the state (a KVState's buffer trimmed to n)."""
    return state.clone(compact=True) if isinstance(state, KVState) else state.clone()


# ---------------------------------------------------------------------- the prefill phase
def grid(end: int, size: int = SEGMENT, cost: Callable[[int], float] | None = None) -> list[int]:
    """The canonical grid's cuts in (0, end). From position 0 on, each cell is the longest whose tokens
    cost no more than the first `size` tokens of a context, where a token reading n keys costs `cost(n)`
    (a model config's `token_cost`; None: every token the same, cells of `size`). So a chunk deep in a
    long context takes no longer than one at its start, and the cuts depend on positions alone: a prefix
    is always cut the same way, whatever follows it."""
    if cost is None:
        return list(range(size, end, size))
    budget = size * cost(size)
    cuts: list[int] = []
    p = 0
    while True:
        lo, hi = 1, size  # the longest s with s·cost(p + s) ≤ budget (a bound on its tokens' cost; it grows with s)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if mid * cost(p + mid) <= budget else (lo, mid - 1)
        p += lo
        if p >= end:
            return cuts
        cuts.append(p)


def segments(end: int, marks: Iterable[int] = (), start: int = 0, size: int = SEGMENT,
             cost: Callable[[int], float] | None = None, *, cuts: Iterable[int] | None = None) -> list[tuple[int, int]]:
    """The canonical segments [a, b) of the positions start..end − 1: boundaries at the grid's cuts (`cuts`
    where the caller has them already, `grid(end, size, cost)` otherwise) and at the marks."""
    cuts = {c for c in (grid(end, size, cost) if cuts is None else cuts) if start < c < end}
    cuts |= {int(m) for m in marks if start < int(m) < end}
    bounds = [start, *sorted(cuts), end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def copied_ends(cuts: Iterable[int], marks: Iterable[int]) -> set[int]:
    """The segment ends at which a prefill leaves a copy of its state in the prefix cache. A copy costs
    what it holds, so besides the first mark (a system prompt, a tool list: what prompts share most) and
    the last end (what a conversation's next request continues), copies are spaced geometrically, each
    at least twice as long as the one before: a prefill copies a few times its final state at most,
    however many messages it holds, instead of a state per message."""
    marks = sorted(set(marks))
    ends = sorted(set(cuts) | set(marks))
    copied = {marks[0], marks[-1]} if marks else set()
    if ends:
        copied.add(ends[-1])
    last = 0
    for e in ends:
        if e >= 2 * last or e in copied:
            copied.add(e)
            last = e
    return copied


def token_cost(model) -> Callable[[int], float] | None:
    """The model's cost of a token by the keys it reads (None where a token costs the same at any depth,
    as in a recurrence)."""
    return getattr(getattr(model, "config", None), "token_cost", None)


def prefill(model, tokens: Sequence[int], *, marks: Iterable[int] = (), cache: PrefixCache | None = None,
            soft_prefix: torch.Tensor | None = None, policy: ContextPolicy = ContextPolicy(), segment: int = SEGMENT):
    """x_0 for the string `tokens` (one sequence), in canonical segments, reusing cached prefixes.

    A string longer than the horizon keeps its last `policy.keep(T)` tokens. With a soft prefix
    (a control input, hybridlm.control.inputs) the prefix rows come first and nothing is cached.
    """
    return run_to_end(prefill_steps(model, tokens, marks=marks, cache=cache, soft_prefix=soft_prefix, policy=policy,
                                    segment=segment))


def run_to_end(steps):
    """What a generator of steps (`prefill_steps`, `inject_steps`) returns, all its steps taken at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.no_grad()
def prefill_steps(model, tokens: Sequence[int], *, marks: Iterable[int] = (), cache: PrefixCache | None = None,
                  soft_prefix: torch.Tensor | None = None, policy: ContextPolicy = ContextPolicy(),
                  segment: int = SEGMENT):
    """`prefill` a chunk at a time, for an engine that interleaves a long prefill with the token steps
    of its running rows: yields the tokens taken from the cache, then once after each chunk that costs
    no more than the first `segment` tokens of a context (whole segments: a conversation's short ones go
    together); returns x_0 (StopIteration's value). `segment` is the scale of the canonical grid; the
    cache stays exact whatever it is, since its keys are the segments themselves (a path of keys fixes
    the arithmetic)."""
    tokens = [int(i) for i in tokens]
    if not tokens:
        raise InputError("empty prompt: a sequence needs at least one token")
    T = model.config.n_ctx
    if not hasattr(model, "empty_state"):  # a bare state-space form (init_state, F, G): its own Π_T
        return model.init_state(tokens)
    if soft_prefix is not None:
        p = soft_prefix.shape[-2]
        if p + len(tokens) > T:
            raise InputError(f"soft prefix ({p}) and prompt ({len(tokens)}) exceed the horizon T={T}")
        x = model.empty_state(1, capacity=p + len(tokens))
        ids = torch.tensor([tokens], dtype=torch.long)
        x.logits = model(ids, x, last_only=True, prefix=soft_prefix.detach())[:, -1]
        return x
    keep = policy.keep(T)
    if len(tokens) > T:
        shift = len(tokens) - keep
        tokens, marks = tokens[shift:], [m - shift for m in marks]
    cost = token_cost(model)
    cuts = grid(len(tokens) + 1, segment, cost)  # the prompt's end may be a cut: copied_ends needs it
    parts = segments(len(tokens), marks, cuts=cuts)
    keys = [tuple(tokens[a:b]) for a, b in parts]
    x, done = None, 0
    if cache is not None:
        found = cache.longest(keys)
        if found is not None:
            done, x = found
    if x is None:
        x = model.empty_state(1, capacity=len(tokens))
    yield x.n if done else 0
    copied = copied_ends(cuts, [m for m in marks if 0 < m <= len(tokens)])
    budget = segment * (cost(segment) if cost else 1)
    spent = 0.0  # the cost prefilled since the last yield: short segments (messages) share one chunk
    for i in range(done, len(parts)):
        a, b = parts[i]
        c = (b - a) * (cost(b) if cost else 1)
        if spent and spent + c > budget:
            yield a
            spent = 0.0
        model.F(x, tokens[a:b])
        spent += c
        if cache is not None and b in copied:  # (a prompt's own tail is no prefix of another's segments)
            cache.put(keys[: i + 1], x)
    return x


@torch.no_grad()
def inject_steps(model, x, tokens: Sequence[int], *, policy: ContextPolicy = ContextPolicy(), chunk: int = SEGMENT):
    """Append tokens (an observation enc(y)) to a state through a prefill, a cell of the canonical grid of
    scale `chunk` at a time (0: in one piece), yielding between two chunks, for an engine that interleaves the landing of
    a long observation with the token steps of its running rows; under the block policy a string that would
    pass T is first cut to its last T − δ tokens. Returns whether the state was rebuilt (StopIteration's
    value). The chunks are a function of the tokens, the state's length and `chunk` alone, so a sequence's arithmetic does not
    depend on what else the engine runs."""
    tokens = [int(i) for i in tokens]
    if not tokens:
        return False
    T = model.config.n_ctx
    if policy.kind == "block" and hasattr(x, "n") and x.n + len(tokens) > T:
        yield from _rebuild_steps(model, x, (x.tokens[0].tolist() + tokens)[-policy.keep(T):])
        return True
    rebuilds = getattr(x, "rebuilds", 0)
    n0 = getattr(x, "n", 0)
    parts = segments(n0 + len(tokens), start=n0, size=chunk, cost=token_cost(model)) if chunk else [(n0, n0 + len(tokens))]
    for a, b in parts:
        if a > n0:
            yield
        model.F(x, tokens[a - n0 : b - n0])  # past T, F itself rebuilds from Π_T(s ∘ w): the exact policy
    return getattr(x, "rebuilds", 0) > rebuilds


def truncate_for_step(model, x, policy: ContextPolicy) -> bool:
    """The block policy's guard and jump map: a full state (n = T) is cut to its last T − δ
    tokens before the next step. True when it jumped."""
    T = model.config.n_ctx
    if policy.kind != "block" or not hasattr(x, "n") or x.n < T:
        return False
    _rebuild(model, x, x.tokens[0].tolist()[-policy.keep(T):])
    return True


def _rebuild(model, x, tokens: list[int]) -> None:
    run_to_end(_rebuild_steps(model, x, tokens))


def _rebuild_steps(model, x, tokens: list[int]):
    """x rebuilt from `tokens` in canonical segments, yielding between two."""
    if any(i < 0 for i in tokens):
        raise InputError("the context holds soft-prefix rows, which a truncation cannot rebuild; "
                         "shorten the prompt or the budget")
    x.reset()
    x.rebuilds += 1
    for i, (a, b) in enumerate(segments(len(tokens), cost=token_cost(model))):
        if i:
            yield
        model.F(x, tokens[a:b])
