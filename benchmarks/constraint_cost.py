"""The cost of a constraint's mask beside the step it masks: median mask time per token vs a
float32 decode step of SmolLM2 (`model.F(x, w)` on a state from `model.init_state(ids)`),
measured interleaved in the same run. Target: the mask ≤ 10 % of the step.

    python benchmarks/constraint_cost.py [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hybridlm.turns import tool_call_constraint
from hybridlm.turns.codecs.tagged_json import CLOSE, OPEN
from hybridlm.weights.loading import load_model

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city"]}},
    {"name": "solve", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}, "c": {"type": "number"}}, "required": ["a", "b", "c"]}},
    {"name": "tag", "parameters": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}, "required": ["items"]}},
]
CALLS = [
    ("get_weather", {"city": "上海", "unit": "celsius", "days": 3}),
    ("solve", {"a": 1, "b": -3, "c": 2.5}),
    ("tag", {"items": ["red", "green", "blue"]}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20, help="calls replayed (cycling over the examples)")
    args = ap.parse_args()
    model = load_model()
    tok = model.tokenizer
    x = model.init_state(tok.encode("You are a helpful assistant. " * 20))
    masks, steps = [], []
    for n in range(args.calls):
        name, arguments = CALLS[n % len(CALLS)]
        text = f"Let me call it. {OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CLOSE}"
        c = tool_call_constraint(tok, TOOLS, "auto", budget=128)
        for token in tok.encode(text):
            t = time.perf_counter()
            c.mask()
            masks.append(time.perf_counter() - t)
            c.advance(token)
            if len(steps) < 3 * n + 3:  # a decode step between masks: both under the same load
                t = time.perf_counter()
                model.F(x, [token])
                steps.append(time.perf_counter() - t)
    mask, step = statistics.median(masks), statistics.median(steps)
    print(f"mask per token: median {mask * 1e6:.0f} µs, p95 {sorted(masks)[int(0.95 * len(masks))] * 1e6:.0f} µs "
          f"({len(masks)} tokens)")
    print(f"float32 decode step of SmolLM2: median {step * 1e3:.1f} ms ({len(steps)} steps)")
    print(f"mask / step = {mask / step:.3%} (target ≤ 10 %)")


if __name__ == "__main__":
    main()
