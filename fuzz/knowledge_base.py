"""Fuzz the knowledge-base reader and the lookup tool built on it (size, encoding, nesting, null values)."""

import json

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.tools.sandbox import outcome
    from hybridlm.tools import lookup_tool
    from hybridlm.errors import InputError

from common import run, scratch


def test_one_input(data: bytes) -> None:
    path = scratch("kb.json", data)
    try:
        lookup = lookup_tool(path)
    except InputError:
        return
    present = list(json.loads(data.decode("utf-8")))[:3]  # it was read, so it parses
    for key in ("", "a", data[:8].decode("utf-8", "replace"), *present):
        text, error = outcome("lookup", lookup.fn, {"key": key}, 2000)
        if error not in (None, "exception", "too_large"):
            raise AssertionError(f"lookup({key!r}) gave {error}: {text}")


if __name__ == "__main__":
    run(test_one_input)
