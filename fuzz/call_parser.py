"""Fuzz the tool-call parsers: the free parser on any text, and the constrained path.

Free: any text between <tool_call> and </tool_call> gives calls or one error line, never an
exception. Constrained: tokens chosen by the fuzzer among those the mask allows always parse
into calls whose arguments are what json reads from the text.

    python fuzz/call_parser.py fuzz_corpus/ -max_total_time=60   (see fuzz/README.md)
"""

import json

import atheris
import numpy as np
import torch

with atheris.instrument_imports(include=["hybridlm"]):
    from hybridlm.turns import tool_call_constraint
    from hybridlm.turns.codecs.tagged_json import CLOSE, OPEN, parse_calls
    from hybridlm.tokenizer import gpt2_tokenizer

from common import run

torch.set_num_threads(1)  # small tensors: a thread team only waits on the other process's cores
TOKENIZER = gpt2_tokenizer()
TOOLS = [
    {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6},
        "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3}}, "required": ["n"]}},
    {"name": "g", "parameters": {"type": "object", "properties": {"e": {"enum": ["a", "上海"]}}}},
]
# compiled once: each input walks a fresh copy under a budget it picks (compiling took ~14 ms an input)
CONSTRAINT = tool_call_constraint(TOKENIZER, TOOLS, "required", parallel=True, max_calls=2)


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    text = fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 4096))
    for candidate in (text, OPEN + text + CLOSE):
        calls, error = parse_calls(candidate, ["f", "g"])
        if error is not None and (not isinstance(error, str) or "\n" in error):
            raise AssertionError(f"the error is not one line: {error!r}")
    c = CONSTRAINT.fresh(budget=fdp.PickValueInList([None, 8, 24, 64]))
    for _ in range(96):  # a budget of 64 closes within it; without one, 96 tokens reach every construct
        if c.finished or not fdp.remaining_bytes():
            break
        allowed = c.mask()
        ids = range(TOKENIZER.vocab_size) if allowed is None else np.flatnonzero(allowed.numpy())
        c.advance(int(ids[fdp.ConsumeIntInRange(0, len(ids) - 1)]))
    for call in c.calls():
        assert call.name in ("f", "g") and isinstance(call.arguments, dict)
    if c.finished:
        body = c.text[len(OPEN):].split(CLOSE)[0]
        assert c.calls()[0].arguments == json.loads(body)["arguments"]


if __name__ == "__main__":
    run(test_one_input)
