"""llguidance vs xgrammar on hybridlm's tokenizers: schema coverage and mask time per token.

Coverage: which JSON Schema constructs each compiles, and how many of BFCL's function
schemas (simple_python, multiple, parallel, live_simple; BFCL's types mapped as its
handlers map them). Time: the mask of every token of real JSON (BFCL's ground-truth
arguments for its simple_python functions, spelled as the tokenizer splits them), median
and p95 per token, for SmolLM2's tokenizer (from the GGUF file) and GPT-2's.

    pip install --no-deps bfcl-eval xgrammar && pip install apache-tvm-ffi
    python benchmarks/constraint_libraries.py [--tasks 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import numpy as np

from hybridlm.agent import bfcl
from hybridlm.constraints import library
from hybridlm.tokenizer import gpt2_tokenizer

CONSTRUCTS = {
    "object": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    "nested object": {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "q": {"type": "string"}}, "required": ["q"]}}, "required": ["p"]},
    "array min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "enum": {"type": "string", "enum": ["metric", "imperial"]},
    "const": {"const": "fixed"},
    "optional property": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                          "required": ["a"]},
    "integer bounds": {"type": "integer", "minimum": -5, "maximum": 300},
    "number bounds": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 10},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "string format date-time": {"type": "string", "format": "date-time"},
    "string format email": {"type": "string", "format": "email"},
    "string min/maxLength": {"type": "string", "minLength": 2, "maxLength": 8},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "$ref/$defs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
                   "type": "array", "items": {"$ref": "#/$defs/pt"}},
}


class LLG:
    name = "llguidance"

    def __init__(self, tok):
        t = time.perf_counter()
        self.lib = library.library_tokenizer(tok)
        self.setup_s = time.perf_counter() - t
        self.buf = library.MaskBuffer(self.lib.vocab_size)

    def compile(self, schema):
        m = llguidance.LLMatcher(self.lib, library.json_grammar(schema), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask_times(self, m, ids):
        out = []
        for i in ids:
            t = time.perf_counter()
            self.buf.fill(m)
            out.append(time.perf_counter() - t)
            assert m.consume_token(i), m.get_error()
        return out


class XGR:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.x = xgrammar
        t = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size,
                                                       stop_token_ids=sorted(tok.stop_ids()))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - t
        self.bitmask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, schema):
        g = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self.x.GrammarMatcher(g)

    def mask_times(self, m, ids):
        out = []
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(self.bitmask)
            out.append(time.perf_counter() - t)
            assert m.accept_token(i), i
        return out


def instance(answer: dict) -> dict:
    """The first accepted value of each parameter BFCL's answer names ("" marks optional)."""
    (params,) = answer.values()
    return {k: v[0] for k, v in params.items() if v and v[0] != ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=100, help="simple_python tasks whose answers are timed")
    args = ap.parse_args()
    from hybridlm.weights.loading import load_model

    tokenizers = {"SmolLM2": load_model().tokenizer, "GPT-2": gpt2_tokenizer()}
    functions = [f for c in bfcl.CATEGORIES for t in bfcl.tasks(c) for f in t.functions]
    timed = [t for t in bfcl.tasks("simple_python")[: args.tasks]]
    for tname, tok in tokenizers.items():
        for Lib in (LLG, XGR):
            lib = Lib(tok)
            ok = []
            for cname, schema in CONSTRUCTS.items():
                try:
                    lib.compile(schema)
                    ok.append(cname)
                except Exception:  # noqa: BLE001 - a construct the library refuses
                    pass
            failed_bfcl, compile_s = 0, []
            for f in functions:
                t = time.perf_counter()
                try:
                    lib.compile(bfcl.json_schema(f["parameters"]))
                except Exception:  # noqa: BLE001 - a library's refusal of a schema is a row
                    failed_bfcl += 1
                compile_s.append(time.perf_counter() - t)
            times = []
            for task in timed:
                schema = bfcl.json_schema(task.functions[0]["parameters"])
                ids = tok.encode(json.dumps(instance(task.answer[0]), ensure_ascii=False))
                try:
                    times += lib.mask_times(lib.compile(schema), ids)
                except Exception:  # noqa: BLE001 - an answer outside the schema (BFCL has a few)
                    continue
            times = np.array(times) * 1e6
            missing = [c for c in CONSTRUCTS if c not in ok]
            print(f"{tname:8} {lib.name:10} setup {lib.setup_s:5.2f} s  constructs {len(ok)}/{len(CONSTRUCTS)}"
                  f" (fails: {', '.join(missing) or 'none'})  BFCL schemas {len(functions) - failed_bfcl}/"
                  f"{len(functions)}  compile median {statistics.median(compile_s) * 1e3:.2f} ms  "
                  f"mask/token median {np.median(times):.0f} µs p95 {np.percentile(times, 95):.0f} µs "
                  f"({times.size} tokens)")


if __name__ == "__main__":
    main()
