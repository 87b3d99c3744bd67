"""What every harness shares: a scratch file per process, the one-line check of an error, a tokenizer's
exercise, and atheris's entry point."""

import os
import sys
import tempfile

import atheris

SCRATCH = tempfile.mkdtemp(prefix="hybridlm-fuzz-")


def scratch(name: str, data: bytes) -> str:
    """Write `data` to a file of that name in this process's scratch folder; return its path."""
    path = os.path.join(SCRATCH, name)
    with open(path, "wb") as fh:
        fh.write(data)
    return path


def one_line(exc: Exception) -> None:
    """The project's errors are one line."""
    if "\n" in str(exc):
        raise AssertionError(f"the error is not one line: {exc}") from None


def exercise_tokenizer(tok, text: str) -> None:
    """Both encodings, decoding, token texts, BOS/EOS framing and the token table of a tokenizer a reader
    built; untrusted text never gives a special token. Text that is no Unicode (a lone surrogate) is
    refused in one line."""
    from hybridlm.errors import HybridLMError

    try:
        for ids in (tok.encode(text), tok.encode_markup(text)):
            tok.decode(ids)
            [tok.token_str(i) for i in ids]
            tok.with_special(ids)
        if set(tok.encode(text)) & tok.special_ids:
            raise AssertionError(f"untrusted text {text!r} gave a special token")
        tok.table.starting_with("<")
    except HybridLMError as exc:
        one_line(exc)


def run(test_one_input) -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
