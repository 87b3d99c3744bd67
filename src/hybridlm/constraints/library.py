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
import math
import re
import weakref
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from hybridlm.errors import InputError

if TYPE_CHECKING:
    import torch

# Compact JSON in the form json.dumps writes (", " and ": "), with no other whitespace: a
# free whitespace pattern would let a model pad a call with blanks until its budget is gone.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON as a model pretty-prints it in a Markdown block: between tokens nothing, one space, or one newline and an
# indent. Bounded the same way: no blank lines, no run of blanks longer than an indent.
JSON_PRETTY = {"whitespace_flexible": True, "whitespace_pattern": r"( |\n {0,24})?"}

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


def json_grammar(schema: dict | bool | str, *, lenient: bool = False) -> str:
    """llguidance's grammar for a JSON Schema, in compact JSON; InputError names a bad schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InputError(f"JSON schema: not JSON ({exc})") from None
    if schema is False:
        raise InputError("JSON schema: false admits no value")
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InputError(f"JSON schema: expected an object, got {type(schema).__name__}")
    _check_size(schema)
    compact: dict = _representable(schema)
    options: Any = {**JSON_FORMAT, "lenient": lenient}  # (llguidance's JsonCompileOptions, a TypedDict)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(compact, overrides=options)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InputError(f"JSON schema: {_one_line(exc)}") from None


INT64 = 2**63
# The library writes a bounded number by a regular expression over its digits, and cannot build
# one for bounds of 19 digits (integers) or beyond 10^15 (numbers). Such bounds are tightened to
# these: every value the mask admits still satisfies the schema; values of more digits than this
# are no longer reachable.
INTEGER_LIMIT = 10**18 - 1
NUMBER_LIMIT = 10**15
LOWER, UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")
DATA = {"const", "enum", "default", "examples"}  # values, not schemas: left as they are


MAX_SCHEMA_DEPTH = 64  # nesting of objects and arrays (a real schema nests a handful)
MAX_SCHEMA_NODES = 20_000  # values in the whole schema
MAX_SCHEMA_DIGITS = 400  # digits of one integer (float(10**400) overflows; a bound needs 20)


def _check_size(schema) -> None:
    """Bounds checked before any walk that recurses or converts: InputError for a schema nested or
    sized beyond what any real schema is, or an integer too long to be a number the library reads."""
    stack, nodes = [(schema, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise InputError(f"JSON schema: nested more than {MAX_SCHEMA_DEPTH} levels deep (the limit)")
        if nodes > MAX_SCHEMA_NODES:
            raise InputError(f"JSON schema: more than {MAX_SCHEMA_NODES:,} values; too large to compile")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, int) and not isinstance(node, bool) and node.bit_length() > MAX_SCHEMA_DIGITS * 3.33:
            raise InputError(f"JSON schema: an integer of about {int(node.bit_length() / 3.33)} digits; "
                             f"at most {MAX_SCHEMA_DIGITS} are read")


def _representable(node, path: str = "schema"):
    """The schema as the library can read it: integers beyond 64 bits as floats (the library
    reads numbers as 64-bit values), bounds it cannot write tightened (see INTEGER_LIMIT);
    InputError for a number that is not finite or a range that lies wholly beyond the limits."""
    if isinstance(node, dict):
        out = {k: v if k in DATA else _representable(v, f"{path}.{k}") for k, v in node.items()}
        return _tightened(out, path)
    if isinstance(node, list):
        return [_representable(v, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, bool):
        return node
    if isinstance(node, int) and not -INT64 <= node < INT64:
        return float(node)
    if isinstance(node, float) and not math.isfinite(node):
        raise InputError(f"JSON schema: {path} is {node}, not a finite number")
    return node


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tightened(node: dict, path: str) -> dict:
    bounds = [k for k in (*LOWER, *UPPER) if _number(node.get(k))]
    if not bounds:
        return node
    limit = INTEGER_LIMIT if node.get("type") == "integer" else NUMBER_LIMIT
    out = dict(node)
    for k in bounds:
        v, lower = out[k], k in LOWER
        if (v < -limit) if lower else (v > limit):
            del out[k]
            out["minimum" if lower else "maximum"] = -limit if lower else limit
    for k in bounds:
        v, lower = node[k], k in LOWER
        if (v > limit) if lower else (v < -limit):
            raise InputError(f"JSON schema: {path}.{k} is {node[k]:g}: the constraint library bounds numbers "
                             f"only within ±{limit:.0e}")
    return out


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


def validate(grammar: str, what: str) -> str:
    """The grammar, checked without a tokenizer (what can be found before a model loads);
    InputError naming `what` and the library's reason."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InputError(f"{what}: {_one_line(error)}")
    return grammar


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
        import torch  # (here: the call formats use this module to read schemas, with no model loaded)

        allowed = torch.from_numpy(self.bools())
        if size is not None and size > self.V:  # a model whose embedding is padded past the tokenizer
            allowed = torch.cat([allowed, torch.zeros(size - self.V, dtype=torch.bool)])
        return allowed


def _one_line(exc) -> str:
    """The library's message on one line: every line that says something (not the carets that
    point into a pattern), with advice about options this project does not expose rewritten."""
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    text = " ".join(line for line in lines if line and set(line) - set("^ "))
    text = re.sub(r"Enable 'coerce_one_of' option[^.]*", "Write anyOf instead", text)
    return text or type(exc).__name__
