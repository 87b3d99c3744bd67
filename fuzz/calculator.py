"""Fuzz the calculator: any text; only a finite real number or a ValueError may come out, at once."""

import math

import atheris

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.tools import calculator, evaluate_arithmetic

from common import run


def test_one_input(data: bytes) -> None:
    text = atheris.FuzzedDataProvider(data).ConsumeUnicodeNoSurrogates(len(data))
    try:
        value = evaluate_arithmetic(text)
    except ValueError:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        raise AssertionError(f"{text!r} gave {type(value).__name__} {value!r}: not a finite real number")
    calculator.fn(expression=text)  # the tool's rendering of the same value


if __name__ == "__main__":
    run(test_one_input)
