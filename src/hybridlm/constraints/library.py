"""The grammar library under every constraint: llguidance (docs/constraints.md says why).

llguidance compiles a JSON Schema, a regular expression or a Lark-like grammar into an
Earley parser over bytes and computes, at each token step, the set of tokens whose bytes
can continue a string of the language. Working on bytes is what makes every token of the
tokenizer reachable: ` -` after `": `, or the byte-level halves of 上海 that decode to
U+FFFD on their own.

Its tokenizer object (a token trie over the whole vocabulary) is built once per tokenizer
and cached here, by tokenizer object and by content, so no constraint re-scans the
49,152-token vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import llguidance
import numpy as np
import torch

from hybridlm.errors import InputError

# Compact JSON in the form json.dumps writes (", " and ": "), with no other whitespace: a
# free whitespace pattern would let a model pad a call with blanks until its budget is gone.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_by_object: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_by_content: dict[str, llguidance.LLTokenizer] = {}


def library_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a hybridlm `Tokenizer` (built once, then cached).

    The end-of-sequence tokens are the tokenizer's stop ids: the grammar's end is where the
    turn may stop.
    """
    try:
        return _by_object[tokenizer]
    except (KeyError, TypeError):
        pass
    text = tokenizer.backend.to_str()
    stops = sorted(tokenizer.stop_ids())
    key = hashlib.sha256(text.encode("utf-8")).hexdigest() + json.dumps([stops, tokenizer.vocab_size])
    lib = _by_content.get(key)
    if lib is None:
        lib = llguidance.LLTokenizer(text, n_vocab=tokenizer.vocab_size, eos_token=stops or None)
        _by_content[key] = lib
    try:
        _by_object[tokenizer] = lib
    except TypeError:
        pass
    return lib


def json_grammar(schema: dict | str, *, lenient: bool = False) -> str:
    """llguidance's grammar for a JSON Schema, in compact JSON; InputError names a bad schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InputError(f"JSON schema: not JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise InputError(f"JSON schema: expected an object, got {type(schema).__name__}")
    options = {**JSON_FORMAT, "lenient": lenient}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InputError(f"JSON schema: {_one_line(exc)}") from None


def lark_grammar(text: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InputError(f"grammar: {_one_line(exc)}") from None


def regex_grammar(pattern: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_regex(pattern)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InputError(f"regular expression {pattern!r}: {_one_line(exc)}") from None


def matcher(lib: llguidance.LLTokenizer, grammar: str, what: str) -> llguidance.LLMatcher:
    """A parser for the grammar, or InputError with the library's reason (checked before any decoding)."""
    m = llguidance.LLMatcher(lib, grammar, log_level=0)
    if m.is_error():
        raise InputError(f"{what}: {_one_line(m.get_error())}")
    return m


class MaskBuffer:
    """One matcher's token bitmask, filled in place and read as a bool tensor [V]."""

    def __init__(self, vocab_size: int) -> None:
        self.V = vocab_size
        self.words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        self.full = self.words.size * 32 == vocab_size  # no padding bits in the last word

    def fill(self, m: llguidance.LLMatcher) -> None:
        m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)

    def allows_all(self) -> bool:
        if self.full:
            return bool((self.words == -1).all())
        return bool(self.bools().all())

    def bools(self) -> np.ndarray:
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")
        return bits[: self.V].astype(bool)

    def tensor(self, size: int | None = None) -> torch.Tensor:
        allowed = torch.from_numpy(self.bools())
        if size is not None and size > self.V:  # a model whose embedding is padded past the tokenizer
            allowed = torch.cat([allowed, torch.zeros(size - self.V, dtype=torch.bool)])
        return allowed


def _one_line(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
