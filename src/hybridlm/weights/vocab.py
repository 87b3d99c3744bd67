"""Tokenizers from model files: a GGUF file's `tokenizer.ggml.*` metadata, a Hugging Face folder.

A GGUF vocabulary is one of llama.cpp's types (`tokenizer.ggml.model`):

- 'gpt2', byte-level BPE. The text is split by the regexes llama.cpp keeps for the vocabulary's
  pre-tokenizer (`tokenizer.ggml.pre`: 'llama-bpe', 'qwen2', ...), each an isolating split of the
  pieces the one before left; every byte of a piece is then a symbol, and the merges apply in rank order.
- 'llama', SentencePiece's BPE. Spaces become ▁ (one more before the text when `add_space_prefix`);
  the symbols are the characters, and of all adjacent pairs whose union is a piece, the one whose piece
  scores highest merges first; a character outside the vocabulary becomes its bytes `<0xNN>`. That is
  a BPE whose merges are the splits of every piece into two pieces, ranked by the piece's score, as
  transformers converts a SentencePiece model.
- 'gemma4', BPE over characters: ▁ for spaces, the text split only at runs of newlines, then the merges of
  `tokenizer.ggml.merges`; bytes `<0xNN>` for characters outside the vocabulary.

Token types (`tokenizer.ggml.token_type`, SentencePiece's own numbering): control and unknown tokens are
special (only markup produces them), user-defined ones are matched in any text before the model sees it,
byte tokens serve the fallback, unused ones only hold their place in the vocabulary.

A Hugging Face folder's `tokenizer.json` is read by the `tokenizers` library itself; a folder with only
a SentencePiece `tokenizer.model` (of BPE type) is built as the GGUF 'llama' vocabulary is. Both get their
special tokens, `add_bos_token` and chat template from `tokenizer_config.json` (`chat_template.jinja`
overrides its template), `special_tokens_map.json` and `generation_config.json`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hybridlm.errors import WeightsError
from hybridlm.memory import return_freed_memory
from hybridlm.tokenizer import Tokenizer, add_tokens, byte_level_bpe
from hybridlm.weights.gguf_header import meta_value

#: Token types of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type, SentencePiece's piece types).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
TYPE_NAMES = ("undefined", "normal", "unknown", "control", "user-defined", "unused", "byte")
#: Pieces a SentencePiece BPE can reach by merging (control, unknown, unused and byte pieces it cannot).
MERGEABLE = (UNDEFINED, NORMAL, USER_DEFINED)
SPACE = "\u2581"  # ▁, SentencePiece's space
#: Chat-template end-of-turn markers, in order of preference, when the file names none.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
#: What the special-token keys of the GGUF metadata are called (tokenizer.ggml.<key>_token_id).
SPECIAL_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding")
#: Version of `tokenizer_to_json`'s form; a cache entry of another version is rebuilt.
JSON_VERSION = 2
MAX_JSON_BYTES = 64 << 20  # tokenizer_config.json and its kin (tokenizer.json is the library's to read)

# ====================================================================== pre-tokenizers (tokenizer.ggml.pre)
# The regexes llama.cpp splits text with for each pre-tokenizer name (src/llama-vocab.cpp), which are
# those of the Hugging Face tokenizer.json the vocabulary came from; where llama.cpp rewrote one for its
# own regex engine (case-insensitive contractions), the original is kept: the `tokenizers` library reads it.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
         rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs, ..., Hangul
# Non-ASCII characters are written as escapes: an editor that normalises text (NFC) would turn
# U+1F7D into U+03CE and leave an empty range.
DEEPSEEK_LLM = (
    r"[\r\n]",
    ("\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
     "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
     "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
     "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
     "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
     "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
     "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
     "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
     "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
     "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK,
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
             (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"))
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")
DIGITS_THEN_GPT2 = (r"\p{N}", GPT2)  # StarCoder's: every digit alone, then GPT-2's split
BLOOM = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")  # llama.cpp's, for 'default'


def _names(names: str, regexes: tuple[str, ...], ignore_merges: bool = False) -> dict:
    return dict.fromkeys(names.split(), (regexes, ignore_merges))


#: llama.cpp's pre-tokenizer names → (the regexes, in order; whether a piece that is a token skips the merges).
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **_names("default", DEFAULT),
    **_names("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 jina-es jina-de jina-v1-en jina-v2-es "
             "jina-v2-de jina-v2-code gigachat a.x-4.0 mellum modern-bert roberta-bpe", (GPT2,)),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", (LLAMA3,), True),
    **_names("dbrx smaug-bpe chatglm-bpe", (LLAMA3,)),
    **_names("glm4 glm5", (LLAMA3,), True),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open grok-2", (QWEN2,)),
    **_names("qwen35", (QWEN35,)),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", DIGITS_THEN_GPT2),
    **_names("falcon", FALCON),
    **_names("deepseek-llm", DEEPSEEK_LLM),
    **_names("deepseek-coder", DEEPSEEK_CODER),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", DEEPSEEK3),
    **_names("poro-chat bloom gpt3-finnish", BLOOM),
    **_names("viking", BLOOM + (r"\p{N}",)),
    **_names("tekken", (TEKKEN,), True),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", (GPT4O,)),
    **_names("seed-coder", (SEED_CODER,)),
}


def pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The `tokenizers` pre-tokenizer of llama.cpp's name `pre` (each regex an isolating Split, then the
    bytes of each piece as GPT-2's printable alphabet) and whether the vocabulary ignores merges for
    a piece that is itself a token; an unknown name is refused."""
    if pre not in PRE_TOKENIZERS:
        raise WeightsError(f"tokenizer.ggml.pre {pre[:60]!r} is not a pre-tokenizer hybridlm knows; "
                           f"known: {', '.join(sorted(PRE_TOKENIZERS))}")
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level]), ignore_merges


# ====================================================================== GGUF
def tokenizer_from_metadata(meta: dict[str, Any], *, name: str, vocab_size: int | None = None) -> Tokenizer | None:
    """The tokenizer of a GGUF file's `tokenizer.ggml.*` keys; None if the file has none.

    Every key is type-checked and every id must lie in the vocabulary; `vocab_size` (the model's) must
    hold every token. Bad metadata is one WeightsError line naming the key and the value.
    """
    kind = meta_value(meta, "tokenizer.ggml.model", "str", None)
    if kind is None:
        return None
    if kind not in BUILDERS:
        raise WeightsError(f"tokenizer.ggml.model {kind[:60]!r} is not a vocabulary hybridlm builds; known: "
                           "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE), 'gemma4' (BPE over characters)")
    tokens = meta_value(meta, "tokenizer.ggml.tokens", "str list")
    if not tokens:
        raise WeightsError("tokenizer.ggml.tokens holds no token")
    if vocab_size is not None and len(tokens) > vocab_size:
        raise WeightsError(f"tokenizer.ggml.tokens holds {len(tokens):,} tokens, more than the model's "
                           f"vocabulary of {vocab_size:,}")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for an empty token
    types = _per_token(meta, "tokenizer.ggml.token_type", "int list", len(tokens), [NORMAL] * len(tokens))
    bad = next((i for i, k in enumerate(types) if not UNDEFINED <= k <= BYTE), None)
    if bad is not None:
        raise WeightsError(f"tokenizer.ggml.token_type[{bad}] is {types[bad]}: expected a token type 0..6 "
                           f"({', '.join(TYPE_NAMES)})")
    vocab = _vocab(tokens)
    ids = {}
    for key in SPECIAL_KEYS:
        ids[key] = value = meta_value(meta, f"tokenizer.ggml.{key}_token_id", "int", None)
        if value is not None and not 0 <= value < len(tokens):
            raise WeightsError(f"tokenizer.ggml.{key}_token_id is {value}: expected an id in [0, {len(tokens)})")
    # llama.cpp's defaults: SentencePiece-style vocabularies start a prompt with BOS, byte-level ones do not
    add_bos = meta_value(meta, "tokenizer.ggml.add_bos_token", "bool", kind != "gpt2")
    add_eos = meta_value(meta, "tokenizer.ggml.add_eos_token", "bool", False)
    template = meta_value(meta, "tokenizer.chat_template", "str", None)
    backend = BUILDERS[kind](meta, tokens, types, vocab, ids)
    add_tokens(backend, [t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)],
               [t for t, k in zip(tokens, types) if k == USER_DEFINED])
    markers = end_of_turn(template, vocab)
    closer = ids["eot"] if ids["eot"] is not None else next(iter(markers), None)
    tok = Tokenizer(backend, eos_id=ids["eos"], bos_id=ids["bos"], chat_template=template, name=name,
                    end_of_turn_id=closer, end_of_turn_ids={ids["eom"], *markers} - {None},
                    add_bos=add_bos, add_eos=add_eos)
    _check_text_is_text(tok, "tokenizer.ggml.tokens")
    return tok


_Default = TypeVar("_Default", bound=list | None)


def _per_token(meta: dict[str, Any], key: str, kind: str, n: int, default: _Default) -> list | _Default:
    """One value per token, or `default` when the key is absent."""
    values = meta_value(meta, key, kind, None)
    if values is None:
        return default
    if len(values) != n:
        raise WeightsError(f"{key} has {len(values):,} entries for {n:,} tokens")
    return values


def _vocab(tokens: list[str], what: str = "tokenizer.ggml.tokens") -> dict[str, int]:
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        seen: dict[str, int] = {}
        for index, token in enumerate(tokens):
            if token in seen:
                raise WeightsError(f"{what} holds {token[:40]!r} twice (ids {seen[token]} and {index})")
            seen[token] = index
    return vocab


def _byte_level_bpe(meta, tokens, types, vocab, ids) -> HFTokenizer:
    """llama.cpp's 'gpt2' vocabulary: the merges of `tokenizer.ggml.merges` after the pre-tokenizer's split."""
    split, ignore_merges = pre_tokenizer(meta_value(meta, "tokenizer.ggml.pre", "str", "default"))
    merges = _merges(meta, vocab)
    return _library(lambda: byte_level_bpe(vocab, merges, pre_tokenizer=split, ignore_merges=ignore_merges))


def _merges(meta, vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = []
    for i, merge in enumerate(meta_value(meta, "tokenizer.ggml.merges", "str list", None) or []):
        cut = merge.find(" ", 1)  # the first space after the first character, as llama.cpp splits a merge
        left, right = merge[:cut], merge[cut + 1:]
        if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
            raise WeightsError(f"tokenizer.ggml.merges[{i}] is {merge[:40]!r}: expected 'left right', two tokens "
                               "whose union is a token")
        merges.append((left, right))
    return merges


def _gemma4_bpe(meta, tokens, types, vocab, ids) -> HFTokenizer:
    """llama.cpp's 'gemma4' vocabulary: merges over characters (not bytes) after ▁ for spaces, the text split
    only at newline runs; bytes for characters outside the vocabulary."""
    merges = _merges(meta, vocab)
    unknown = None if ids["unknown"] is None else tokens[ids["unknown"]]
    backend = _library(lambda: HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True,
                                                      byte_fallback=BYTE in types)))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _sentencepiece_bpe(meta, tokens, types, vocab, ids) -> HFTokenizer:
    """llama.cpp's 'llama' vocabulary: SentencePiece's BPE over `tokenizer.ggml.scores`."""
    scores = _per_token(meta, "tokenizer.ggml.scores", "number list", len(tokens), None)
    if scores is None:
        raise WeightsError("tokenizer.ggml.scores is missing: a SentencePiece vocabulary ranks its merges by score")
    unknown = None if ids["unknown"] is None else tokens[ids["unknown"]]
    prefix = meta_value(meta, "tokenizer.ggml.add_space_prefix", "bool", True)
    return sentencepiece_bpe(tokens, scores, types, unknown=unknown, add_space_prefix=prefix)


def sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], *, unknown: str | None,
                      add_space_prefix: bool) -> HFTokenizer:
    """SentencePiece's BPE as a `tokenizers` BPE: ▁ for spaces (and before the text), merges ranked by
    score, bytes for characters outside the vocabulary, and the decoder that undoes all three."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, scores, types)
    backend = _library(lambda: HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True,
                                                      byte_fallback=BYTE in types)))
    prepend = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []  # the space put before the text
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two mergeable pieces, the piece of highest score first.

    Merging the pair of highest score first is SentencePiece's BPE (and llama.cpp's); control, unknown,
    unused and byte pieces are never the result of a merge (text must not become a control token).
    """
    pieces = {t: i for i, t in enumerate(tokens) if types[i] in MERGEABLE}
    ranked = []
    for piece, i in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _library(build):
    """Run a `tokenizers` constructor; its own exception type becomes one WeightsError line."""
    try:
        return build()
    except WeightsError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every defect
        raise WeightsError(f"the vocabulary does not form a tokenizer ({_one_line(exc)})") from None


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "…"


BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe, "gemma4": _gemma4_bpe}


def end_of_turn(template: str | None, vocab: dict[str, int]) -> list[int]:
    """The ids of the markers that end a turn in the chat template, in order of preference (`<|im_end|>`
    for ChatML; Llama 3's `<|eot_id|>` and `<|eom_id|>`), for files that name none."""
    return [vocab[t] for t in END_OF_TURN_TOKENS if template and t in template and t in vocab]


# ====================================================================== Hugging Face folders
def tokenizer_from_folder(folder: Path, *, vocab_size: int | None = None) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder; None when it has neither tokenizer.json nor tokenizer.model.

    Bad files are one WeightsError line naming the file and the value; `vocab_size` (the model's) must
    hold every id of the tokenizer.
    """
    folder = Path(folder)
    config = _json_object(folder / "tokenizer_config.json")
    defaults: dict[str, Any] = {}  # the special tokens and flags a tokenizer.model implies
    if (folder / "tokenizer.json").is_file():
        backend = _library_file(folder / "tokenizer.json")
    elif (folder / "tokenizer.model").is_file():
        backend, defaults = _sentencepiece_model(folder / "tokenizer.model", config)
    else:
        return None
    origin = "tokenizer.json" if (folder / "tokenizer.json").is_file() else "tokenizer.model"
    backend.no_truncation()
    backend.no_padding()
    vocab = _distinct_ids(backend, origin)
    size = max(vocab.values(), default=-1) + 1
    if vocab_size is not None and size > vocab_size:
        raise WeightsError(f"{folder.name}: the tokenizer's ids reach {size - 1:,}, beyond the model's vocabulary "
                           f"of {vocab_size:,}")
    named = defaults | _json_object(folder / "special_tokens_map.json") | {k: v for k, v in config.items()
                                                                          if v is not None}
    bos, eos = (_token_id(vocab, named, key) for key in ("bos_token", "eos_token"))
    template = _chat_template(folder, config)
    markers = end_of_turn(template, vocab)
    add_bos = _flag(config, "add_bos_token", defaults.get("add_bos_token", _post_processor_adds(backend, bos, 0)))
    add_eos = _flag(config, "add_eos_token", _post_processor_adds(backend, eos, -1))
    tok = Tokenizer(backend, eos_id=eos, bos_id=bos, chat_template=template, name=folder.name,
                    end_of_turn_id=next(iter(markers), None), add_bos=add_bos, add_eos=add_eos,
                    end_of_turn_ids=_generation_eos(folder, size) | set(markers))
    _check_text_is_text(tok, origin)
    return tok


def _distinct_ids(backend: HFTokenizer, origin: str) -> dict[str, int]:
    """token → id of a tokenizer read from a file, every id one token's (a special token sharing its id with
    a word would make that word a special token)."""
    vocab = backend.get_vocab(with_added_tokens=True)
    for i, added in backend.get_added_tokens_decoder().items():
        if vocab.get(added.content) != i:
            raise WeightsError(f"{origin}: added token {added.content[:40]!r} has id {i}, its vocabulary "
                               f"gives it {vocab.get(added.content)}")
    if len(set(vocab.values())) != len(vocab):
        owners: dict[int, str] = {}
        for token, i in vocab.items():
            if i in owners:
                raise WeightsError(f"{origin}: the tokens {owners[i][:40]!r} and {token[:40]!r} share the id {i}")
            owners[i] = token
    return vocab


def _check_text_is_text(tok: Tokenizer, origin: str) -> None:
    """Refuse a tokenizer whose model can spell a special token from text: untrusted text could then open or
    close a turn. Each special token is given to the model's merges as a word (for byte-level BPE a word's
    symbols are bytes, which may sit inside any character of a text), and both its string and the text it
    stands for (byte-level `Ġa` stands for " a", the word a model that looks whole words up would find) are
    encoded as text; a byte fallback `<0xNN>` is refused too. No vocabulary of the families hybridlm runs
    fails it."""
    byte_fallback = getattr(tok.backend.model, "byte_fallback", False)
    for i in sorted(tok.special_ids):
        content = tok.backend.id_to_token(i)
        if not content:
            continue
        text = tok.token_str(i)
        spelled = (content if i in _merged_ids(tok.backend.model, content) or i in tok.encode(content)
                   or byte_fallback and re.fullmatch(r"<0x[0-9A-F]{2}>", content)
                   else text if i in tok.encode(text) else None)
        if spelled is not None:
            raise WeightsError(f"{origin}: its model turns the text {spelled[:40]!r} into the special token {i} "
                               f"({content[:40]!r}), so untrusted text could produce it; hybridlm refuses such "
                               "vocabularies")


def _merged_ids(model, word: str) -> set[int]:
    """The ids the model's merges give `word`; none where it cannot write the word (a word list without an
    unknown token raises). A model that looks a whole word up before merging (Llama 3's) would find every
    token so: the lookup is off here, and whether a text can hold the word is what encoding the text tells."""
    whole_words = getattr(model, "ignore_merges", False)
    try:
        if whole_words:
            model.ignore_merges = False
        return {t.id for t in model.tokenize(word)}
    except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for a word it cannot write
        return set()
    finally:
        if whole_words:
            model.ignore_merges = True


def _json_object(path: Path) -> dict:
    """A JSON object from `path`; {} when there is no such file; one WeightsError line when it is no object."""
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise WeightsError(f"{path.name}: {path.stat().st_size:,} bytes, more than {MAX_JSON_BYTES:,}")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise WeightsError(f"{path.name}: not a JSON object ({_one_line(exc, 80)})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path.name}: a JSON {type(data).__name__}, expected an object")
    return data


def _library_file(path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every defect
        raise WeightsError(f"{path.name}: not a tokenizer the tokenizers library reads ({_one_line(exc)})") from None


def _sentencepiece_model(path: Path, config: dict) -> tuple[HFTokenizer, dict]:
    """A SentencePiece model file (protobuf) of BPE type, built as the GGUF 'llama' vocabulary is, with the
    added tokens tokenizer_config.json lists; and its BOS and EOS, BOS first by default (as LlamaTokenizer)."""
    try:
        from google.protobuf.message import Error as ProtobufError
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise WeightsError(f"{path.name}: reading a SentencePiece model needs the sentencepiece package "
                           "(pip install sentencepiece)") from None
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except (ProtobufError, OSError) as exc:
        raise WeightsError(f"{path.name}: not a SentencePiece model ({_one_line(exc, 80)})") from None
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)
    if kind != "BPE":
        raise WeightsError(f"{path.name}: a SentencePiece {kind} model; hybridlm builds BPE ones (as llama.cpp)")
    if norm.precompiled_charsmap or norm.remove_extra_whitespaces or not norm.escape_whitespaces:
        raise WeightsError(f"{path.name}: its normalizer ({norm.name or 'custom'}: remove_extra_whitespaces="
                           f"{norm.remove_extra_whitespaces}, escape_whitespaces={norm.escape_whitespaces}) is not "
                           "the identity; hybridlm builds identity-normalised SentencePiece models")
    tokens, types = [p.piece for p in proto.pieces], [p.type for p in proto.pieces]
    if not tokens:
        raise WeightsError(f"{path.name}: the model holds no piece")
    _vocab(tokens, path.name)
    unknown = tokens[trainer.unk_id] if 0 <= trainer.unk_id < len(tokens) else None
    backend = sentencepiece_bpe(tokens, [p.score for p in proto.pieces], types, unknown=unknown,
                                add_space_prefix=norm.add_dummy_prefix)
    add_tokens(backend, [t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)],
               [t for t, k in zip(tokens, types) if k == USER_DEFINED])
    _added_tokens(backend, config.get("added_tokens_decoder"))
    named = {key: tokens[i] for key, i in (("bos_token", trainer.bos_id), ("eos_token", trainer.eos_id))
             if 0 <= i < len(tokens)}
    return backend, {**named, "add_bos_token": True}


def _added_tokens(backend: HFTokenizer, listed) -> None:
    """tokenizer_config.json's added_tokens_decoder ({id: {content, special, ...}}) on a tokenizer built from
    tokenizer.model: each token is the piece of that id, or the next id."""
    if listed is None:
        return
    if not isinstance(listed, dict):
        raise WeightsError(f"tokenizer_config.json: added_tokens_decoder is a {type(listed).__name__}, expected "
                           "an object {id: token}")
    for key, entry in sorted(listed.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        content = entry.get("content") if isinstance(entry, dict) else None
        if not str(key).isdigit() or not isinstance(content, str) or not content:
            raise WeightsError(f"tokenizer_config.json: added_tokens_decoder holds {str(key)[:20]!r}: "
                               f"{str(entry)[:40]!r}, expected an id and {{\"content\": text}}")
        at, size = backend.token_to_id(content), backend.get_vocab_size(with_added_tokens=True)
        if at != int(key) and not (at is None and int(key) == size):
            raise WeightsError(f"tokenizer_config.json: added token {content[:40]!r} has id {key}, the model's "
                               f"pieces put it at {size if at is None else at}")
        add_tokens(backend, *([[content], []] if entry.get("special") is True else [[], [content]]))


def _token_id(vocab: dict[str, int], named: dict, key: str) -> int | None:
    """The id of a folder's `bos_token`/`eos_token` (a string, or an AddedToken's {"content": ...})."""
    value = named.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return None
    if not isinstance(value, str) or value not in vocab:
        raise WeightsError(f"tokenizer_config.json: {key} is {str(value)[:40]!r}: expected a token of the "
                           "vocabulary")
    return vocab[value]


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise WeightsError(f"tokenizer_config.json: {key} is {str(value)[:40]!r}: expected true or false")
    return value


def _post_processor_adds(backend: HFTokenizer, token: int | None, where: int) -> bool:
    """Whether tokenizer.json's post-processor (a TemplateProcessing, alone or in a Sequence) puts `token`
    at `where` (0: first, -1: last) of a single sequence: how Llama 3's tokenizer.json says that a prompt
    starts with BOS."""
    if token is None:
        return False
    post = json.loads(backend.to_str()).get("post_processor") or {}
    for step in post.get("processors", [post]):
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if single:
            edge = single[where].get("SpecialToken", {})
            return token in step.get("special_tokens", {}).get(edge.get("id"), {}).get("ids", [])
    return False


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja, else chat_template.json's, else tokenizer_config.json's (a string, or a list of
    {name, template} of which 'default' is the one)."""
    if (folder / "chat_template.jinja").is_file():
        try:
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WeightsError(f"chat_template.jinja: not readable as UTF-8 text ({_one_line(exc, 80)})") from None
    template = _json_object(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise WeightsError(f"{folder.name}: chat_template is {str(template)[:40]!r}: expected a template's text")
    return template


def _generation_eos(folder: Path, size: int) -> set[int]:
    """generation_config.json's eos_token_id (an id or a list of them): every token that ends generation."""
    value = _json_object(folder / "generation_config.json").get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size):
            raise WeightsError(f"generation_config.json: eos_token_id holds {str(v)[:40]!r}: expected an id in "
                               f"[0, {size})")
    return set(values)


# ====================================================================== the cache's form
def tokenizer_to_json(tok: Tokenizer | None) -> dict | None:
    if tok is None:
        return None
    return {
        "version": JSON_VERSION, "backend": tok.backend.to_str(), "eos_id": tok.eos_id, "bos_id": tok.bos_id,
        "end_of_turn_id": tok.end_of_turn_id, "end_of_turn_ids": sorted(tok.end_of_turn_ids),
        "add_bos": tok.add_bos, "add_eos": tok.add_eos, "chat_template": tok.chat_template, "name": tok.name,
    }


def tokenizer_from_json(text: str) -> Tokenizer | None:
    """The tokenizer of `json.dumps(tokenizer_to_json(...))`; a ValueError for another version (the caller
    rebuilds it).

    Read from the text, so that every copy of the vocabulary is gone before the heap is handed back: the
    library parses its JSON through a tree of its own, freed when it returns (for 262 144 tokens and
    514 847 merges some 250 MB, which glibc would keep resident), and the backend's str is itself up to
    four bytes a character, eight with the UTF-8 copy `from_str` would cache on it."""
    data = json.loads(text)
    if data is None:
        return None
    if not isinstance(data, dict) or data.pop("version", None) != JSON_VERSION:
        raise ValueError(f"a tokenizer stored in another form (version {JSON_VERSION} expected)")
    backend = HFTokenizer.from_buffer(data.pop("backend").encode("utf-8"))
    return_freed_memory()
    return Tokenizer(backend, **data)
