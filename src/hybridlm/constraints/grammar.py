"""A constraint from a grammar: the mask M_t of the kernel input, from llguidance's parser.

`GrammarConstraint` speaks the engine's protocol (hybridlm.engine.constraint): `mask()`
is the set of tokens that can continue a string of the grammar's language, `advance(token)`
feeds the drawn token to the parser, `finished` says the string is complete.

A token budget makes the constrained text end in time. The constraint computes a closing
witness: a short continuation that completes the grammar (forced tokens first, then closing
characters, then separators such as "@" and ".", then the lowest-numbered allowed token),
found on a copy of the parser. While the witness fits the remaining budget with a margin the
model chooses freely; once it no longer does, the witness is what the mask allows. A runaway
string then ends with its closing quote and the call is still made.

The witness costs a parser step per token, so it is not computed at every token: after a
check that leaves a slack of S tokens the next comes S/2 tokens later (so a schema whose
shortest completion is long, e.g. many required keys, is still closed in time), and at every
token in the last `TAIL` tokens of the budget.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from hybridlm.constraints import library
from hybridlm.errors import InputError

TAIL = 48  # in the last TAIL tokens of a budget the witness is computed at every token
MARGIN = 8  # free choice while witness + MARGIN < remaining tokens
WITNESS_CAP = 512  # the longest witness searched for (a longer one is "none yet")
CLOSERS = '"}], '
SEPARATORS = "@.:/"  # what a format's value needs between its parts (email, host, uri)


class GrammarConstraint:
    """M_t from a compiled llguidance grammar over a hybridlm tokenizer."""

    margin = MARGIN  # tokens of free choice kept beyond the witness (a subclass may close later)

    def __init__(self, tokenizer, grammar: str, *, kind: str, source, budget: int | None = None,
                 vocab_size: int | None = None) -> None:
        if budget is not None and budget < 1:
            raise InputError(f"constraint budget {budget}: expected ≥ 1 token")
        self.tokenizer = tokenizer
        self.kind, self.source, self.budget = kind, source, budget
        self.lib = library.library_tokenizer(tokenizer)
        self.matcher = library.matcher(self.lib, grammar, f"{kind} constraint")
        self.vocab_size = vocab_size
        self.tokens: list[int] = []
        self._buffer = library.MaskBuffer(self.lib.vocab_size)
        self._forced: int | None = None  # the witness token the last mask allowed alone
        self._next_check = 0  # the token count at which the closing witness is checked next
        self._plan: list[int] = []  # the rest of the witness being forced
        self.forced = False  # the budget has forced the closing witness (the value was cut short to fit)

    def fresh(self, budget: int | None | str = "same") -> "GrammarConstraint":
        """The same constraint at its start, sharing the compiled grammar (another turn with the
        same tools or schema costs no compilation), with the same token budget or `budget`."""
        kept = self.budget if budget == "same" else budget
        if isinstance(kept, str) or (kept is not None and kept < 1):
            raise InputError(f"constraint budget {kept}: expected ≥ 1 token")
        new = copy.copy(self)
        new.budget = kept
        new.matcher = self.matcher.deep_copy()
        new.matcher.reset()
        new.tokens, new._forced, new._next_check, new._plan, new.forced = [], None, 0, [], False
        new._buffer = library.MaskBuffer(self.lib.vocab_size)
        return new

    # ------------------------------------------------------------------ the protocol
    def mask(self) -> torch.Tensor | None:
        """The allowed tokens; None when every token is (nothing restricted at this step)."""
        self._forced = self._closing_token()
        if self._forced is not None:
            allowed = torch.zeros(max(self.lib.vocab_size, self.vocab_size or 0), dtype=torch.bool)
            allowed[self._forced] = True
            return allowed
        self._buffer.fill(self.matcher)
        if self._buffer.allows_all() and (self.vocab_size or 0) <= self.lib.vocab_size:
            return None
        return self._buffer.tensor(self.vocab_size)

    def advance(self, token: int) -> None:
        token = int(token)
        if self._forced is not None and token != self._forced:
            raise InputError(f"token {token} was not allowed: the budget's closing witness allowed only "
                             f"{self._forced}")
        if not self.matcher.consume_token(token):
            raise InputError(f"token {token} ({self.lib.dbg_tokens([token])}) does not continue the "
                             f"{self.kind} constraint: {self.matcher.get_error()}")
        self.tokens.append(token)
        self._plan = self._plan[1:] if self._forced is not None and self._plan[:1] == [token] else []

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete string of the language (it may still go on)."""
        return self.matcher.is_accepting()

    def describe(self) -> dict:
        out = {"kind": self.kind, "source": self.source}
        if self.budget is not None:
            out["budget"] = self.budget
        return out

    @property
    def text(self) -> str:
        """The constrained text so far (a stop token is the end of the text, not part of it)."""
        stops = self.tokenizer.stop_ids()
        return self.lib.decode_str([t for t in self.tokens if t not in stops])

    # ------------------------------------------------------------------ the budget
    def shortest_completion(self) -> int | None:
        """Tokens of the closing witness from the current state (an upper bound on the shortest
        completion), or None when none of at most WITNESS_CAP tokens was found."""
        witness = closing_witness(self.matcher, self.lib, limit=WITNESS_CAP, before=self.tokens)
        return None if witness is None else len(witness)

    @property
    def remaining(self) -> int | None:
        return None if self.budget is None else self.budget - len(self.tokens)

    def _closing_token(self) -> int | None:
        """The witness's first token when the budget leaves no room for more, else None."""
        left = self.remaining
        if left is None or self.finished:
            return None
        if self._plan:  # once forcing, the witness is followed to its end (it is what fits)
            return self._plan[0]
        if left > TAIL and len(self.tokens) < self._next_check:
            return None
        witness = closing_witness(self.matcher, self.lib, limit=min(left, WITNESS_CAP), before=self.tokens)
        slack = (left - TAIL) if witness is None else (left - len(witness) - self.margin)
        if slack > 0 or witness is None:
            self._next_check = len(self.tokens) + max(1, slack // 2)
            return None
        self._plan, self.forced = witness, True
        return witness[0]


def closing_witness(m: llguidance.LLMatcher, lib: llguidance.LLTokenizer, *, limit: int,
                    before: Sequence[int] = ()) -> list[int] | None:
    """A short token sequence that completes the grammar from m's state (m is not changed).

    None when none of at most `limit` tokens was found. The end-of-sequence token counts as
    a token where the grammar needs it to stop. `before`: the tokens already written (their
    last two steer the choice between closers and separators).
    """
    m = m.deep_copy()
    buffer = library.MaskBuffer(lib.vocab_size)
    closers = _closer_ids(lib)
    out: list[int] = []
    while len(out) < limit:
        if m.is_stopped():
            return out
        forced = m.compute_ff_tokens()
        if forced:
            forced = forced[: limit - len(out)]
            if not m.consume_tokens(forced):
                return None
            out += forced
            continue
        buffer.fill(m)
        allowed = buffer.bools()
        if m.is_accepting():
            return out + [lib.eos_token]
        choice = _progress([*before[-2:], *out], allowed, closers, _separator_ids(lib))
        if choice is None:
            ids = np.flatnonzero(allowed)
            if ids.size == 0:
                return None
            choice = int(ids[0])
        if not m.consume_token(choice):
            return None
        out.append(choice)
    return out if m.is_stopped() else None  # (a witness of exactly `limit` tokens)


def _progress(out: list[int], allowed, closers: list[int], separators: list[int]) -> int | None:
    """The witness's next token among closers and separators, if one is allowed.

    Closers come first, unless the last two tokens were closers and the text is still open:
    inside a string a closing character may be one more character of it ("}" in an e-mail's
    local part), so a separator ("@", ".", ":", "/") is tried first there, one not used yet
    by preference.
    """
    fresh = [t for t in separators if t not in out] + [t for t in separators if t in out and out[-1] != t]
    groups = (closers, fresh)
    if len(out) >= 2 and out[-1] in closers and out[-2] in closers:
        groups = (fresh, closers)
    for group in groups:
        for t in group:
            if allowed[t]:
                return t
    return None


_per_tokenizer: dict[tuple[str, int], list] = {}  # (what, id of the library's tokenizer) -> token ids


def _memo(what: str, lib: llguidance.LLTokenizer, build) -> list:
    key = (what, id(lib))
    if key not in _per_tokenizer:
        _per_tokenizer[key] = build(lib)
    return _per_tokenizer[key]


def _token_bytes(lib: llguidance.LLTokenizer) -> list[tuple[bytes, int]]:
    """(bytes, id) of every ordinary token, read once per tokenizer."""
    return _memo("bytes", lib, lambda lib: [(lib.decode_bytes([i]), i) for i in range(lib.vocab_size)
                                            if not lib.is_special_token(i)])


def _closer_ids(lib: llguidance.LLTokenizer) -> list[int]:
    """Tokens made only of closing characters, then "0": what ends a value soonest.

    Those that start with a quote come first (inside a string only a quote ends it; a
    bracket would be one more character of the string), then those without a comma (a
    comma opens one more item, needed only where a required key is still to come),
    longest first.
    """
    def build(lib):
        texts = _token_bytes(lib)
        closing = [(len(b), b, i) for b, i in texts if b.strip() and all(chr(c) in CLOSERS for c in b)]
        zero = [i for b, i in texts if b == b"0"]
        order = sorted(closing, key=lambda p: (not p[1].startswith(b'"'), b"," in p[1], -p[0]))
        return [i for _, _, i in order] + zero

    return _memo("closers", lib, build)


def _separator_ids(lib: llguidance.LLTokenizer) -> list[int]:
    """The one-character tokens of SEPARATORS, in that order."""
    def build(lib):
        ids = dict(_token_bytes(lib))
        return [ids[c.encode()] for c in SEPARATORS if c.encode() in ids]

    return _memo("separators", lib, build)


# ---------------------------------------------------------------------- constructors
def json_schema_constraint(tokenizer, schema: dict | bool | str, *, budget: int | None = None, lenient: bool = False,
                           vocab_size: int | None = None) -> GrammarConstraint:
    """Text that is one JSON value valid under the schema (compact: ", " and ": " separators)."""
    grammar = library.json_grammar(schema, lenient=lenient)
    return GrammarConstraint(tokenizer, grammar, kind="json_schema", source=schema, budget=budget,
                             vocab_size=vocab_size)


def regex_constraint(tokenizer, pattern: str, *, budget: int | None = None,
                     vocab_size: int | None = None) -> GrammarConstraint:
    """Text that matches the regular expression whole (Rust `regex` syntax)."""
    return GrammarConstraint(tokenizer, library.regex_grammar(pattern), kind="regex", source=pattern,
                             budget=budget, vocab_size=vocab_size)


def grammar_constraint(tokenizer, grammar: str, *, budget: int | None = None,
                       vocab_size: int | None = None) -> GrammarConstraint:
    """Text of a grammar in llguidance's Lark-like format (with `%json {...}` for inline schemas)."""
    return GrammarConstraint(tokenizer, library.lark_grammar(grammar), kind="grammar", source=grammar,
                             budget=budget, vocab_size=vocab_size)
