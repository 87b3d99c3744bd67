"""Effects of the control inputs on SmolLM2-135M-Instruct (hybridlm.control).

1. Safety filter: 200 sampled continuations (τ = 1) of prompts that elicit a banned word,
   with and without the filter: occurrences of the word, and the probability mass the
   filter removed per step.
2. Steering: a sentiment contrast vector at layer ℓ; effect versus scale α, as the
   next-token log-odds of positive vs negative adjectives and as a lexicon score of
   sampled continuations.
3. Soft prefix: the target log-probability before and after a fixed budget of gradient steps.
4. Zero input: no controller, an empty list and steering with α = 0 give identical tokens.

    OMP_NUM_THREADS=1 python benchmarks/control_effects.py --out control_effects.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

from hybridlm import Kernel, generate, load_model
from hybridlm.control import (
    SoftPrefix, Steering, ban_words, contrast_vector, optimise_prefix, rollout,
)

BAN_PROMPTS = [
    "The capital of France is",
    "The Eiffel Tower is located in the city of",
    "Q: What is the capital of France?\nA:",
    "My favourite city in Europe is",
]
POSITIVE = ["I love this. It is wonderful, beautiful and great.", "What a happy, joyful, excellent day!",
            "This is the best thing ever, I am so glad.", "Everything was amazing and delightful."]
NEGATIVE = ["I hate this. It is awful, ugly and terrible.", "What a sad, miserable, horrible day!",
            "This is the worst thing ever, I am so upset.", "Everything was disgusting and dreadful."]
NEUTRAL = ["I think the movie was", "My day at work was", "The food at the restaurant was",
           "Honestly, the weather today is"]
POS_WORDS = {"good", "great", "wonderful", "amazing", "excellent", "fantastic", "happy", "love", "loved", "best",
             "beautiful", "delicious", "perfect", "nice", "enjoyed", "fun", "awesome", "glad", "brilliant", "lovely"}
NEG_WORDS = {"bad", "terrible", "awful", "horrible", "boring", "disappointing", "sad", "hate", "hated", "worst",
             "ugly", "disgusting", "poor", "angry", "annoying", "upset", "miserable", "dreadful", "tired", "wrong"}
NEXT_POS = [" great", " good", " wonderful", " amazing", " excellent", " fantastic"]
NEXT_NEG = [" terrible", " bad", " awful", " horrible", " boring", " disappointing"]


def occurrences(text: str, word: str, after: int, *, word_start: bool = False) -> int:
    """Occurrences of `word` (any case; anywhere, or only at word starts) ending after character `after`."""
    pattern = (r"(?<!\w)" if word_start else "") + re.escape(word)
    return sum(1 for m in re.finditer(pattern, text, re.IGNORECASE) if m.end() > after)


def banned_word(model, word: str, per_prompt: int, steps: int, seed: int) -> dict:
    tok = model.tokenizer
    stops = tok.stop_ids()
    out: dict = {"word": word, "prompts": BAN_PROMPTS, "continuations": per_prompt * len(BAN_PROMPTS),
                 "tokens_each": steps, "temperature": 1.0}
    for label, controllers in (("unfiltered", []), ("filtered", [ban_words([word], tok)])):
        rows_hit = hits = exact = starts = 0
        masses, empty, t0 = [], 0, time.perf_counter()
        examples = []
        for i, prompt in enumerate(BAN_PROMPTS):
            ids = tok.encode(prompt)
            r = rollout(model, ids, batch=per_prompt, kernel=Kernel(), controllers=controllers,
                        max_new_tokens=steps, seed=seed + i)
            for cont in r.continuations(stops):
                full = tok.decode(ids + cont)
                n = occurrences(full, word, len(tok.decode(ids)))
                hits, rows_hit = hits + n, rows_hit + (n > 0)
                starts += occurrences(full, word, len(tok.decode(ids)), word_start=True)
                exact += tok.decode(cont).count(word)
                if len(examples) < 3 and (label == "filtered" or n):
                    examples.append(tok.decode(cont))
            for recs in r.records:
                for rec in recs:
                    if rec.removed_mass is not None:
                        masses += rec.removed_mass
                    empty += len(rec.note.get("no_safe_token", []))
        out[label] = {"occurrences": hits, "continuations_with_word": rows_hit,
                      "rate": rows_hit / out["continuations"], "word_start_occurrences": starts,
                      "case_sensitive_substring_count": exact,
                      "wall_s": round(time.perf_counter() - t0, 1), "examples": examples}
        if masses:
            out[label]["removed_mass"] = {
                "row_steps": len(masses), "mean": statistics.fmean(masses), "median": statistics.median(masses),
                "max": max(masses), "steps_over_0.01": sum(m > 0.01 for m in masses),
                "steps_over_0.5": sum(m > 0.5 for m in masses), "no_safe_token": empty}
        print(f"[ban] {label}: {rows_hit}/{out['continuations']} continuations contain {word!r} "
              f"({hits} occurrences)", flush=True)
    return out


def lexicon(text: str) -> int:
    words = re.findall(r"[a-z']+", text.lower())
    return sum(w in POS_WORDS for w in words) - sum(w in NEG_WORDS for w in words)


@torch.no_grad()
def steering(model, layer: int, logodds_scales, sample_scales, per_prompt: int, steps: int, seed: int) -> dict:
    tok = model.tokenizer
    cv = contrast_vector(model, POSITIVE, NEGATIVE, layer)
    pos_ids = [tok.encode(w)[0] for w in NEXT_POS]
    neg_ids = [tok.encode(w)[0] for w in NEXT_NEG]
    rows = []
    for scale in sorted(set(logodds_scales) | set(sample_scales)):
        row: dict = {"scale": scale}
        with model.hooks(Steering(cv, scale=scale).hooks(model)):
            logodds = []
            for p in NEUTRAL:
                lp = torch.log_softmax(model(torch.tensor([tok.encode(p)]), last_only=True)[0, -1].float(), -1)
                logodds.append(float(lp[pos_ids].logsumexp(0) - lp[neg_ids].logsumexp(0)))
            row["next_token_logodds_pos_vs_neg"] = statistics.fmean(logodds)
        if scale in sample_scales:
            scores = []
            for i, p in enumerate(NEUTRAL):
                ids = tok.encode(p)
                r = rollout(model, ids, batch=per_prompt, kernel=Kernel(), controllers=[Steering(cv, scale=scale)],
                            max_new_tokens=steps, seed=seed + i)
                scores += [lexicon(tok.decode(c)) for c in r.continuations(tok.stop_ids())]
            row["lexicon_score_mean"] = statistics.fmean(scores)
            row["lexicon_score_sem"] = statistics.stdev(scores) / len(scores) ** 0.5
            row["samples"] = len(scores)
            with model.hooks(Steering(cv, scale=scale).hooks(model)):
                g = generate(model, tok.encode(NEUTRAL[0]), kernel=Kernel(greedy=True), max_new_tokens=16)
            row["greedy_example"] = tok.decode(g.generated_ids)
        rows.append(row)
        print(f"[steer] α={scale:+g}: {row}", flush=True)
    return {"layer": layer, "vector_norm": float(cv.vector.norm()), "positive_prompts": POSITIVE,
            "negative_prompts": NEGATIVE, "neutral_prompts": NEUTRAL, "tokens_each": steps, "rows": rows}


def prefix(model, steps: int, lr: float) -> dict:
    tok = model.tokenizer
    out = {}
    for name, prompt, target, sign in (("raise ' Rome'", BAN_PROMPTS[0], " Rome", 1),
                                       ("lower ' Paris'", BAN_PROMPTS[0], " Paris", -1)):
        t0 = time.perf_counter()
        res = optimise_prefix(model, tok.encode(prompt), tok.encode(target), steps=steps, lr=lr, sign=sign)
        g = generate(model, tok.encode(prompt), kernel=Kernel(greedy=True), max_new_tokens=10,
                     controllers=[SoftPrefix(res.prefix)])
        out[name] = {"prompt": prompt, "target": target, "sign": sign, "steps": steps, "lr": lr,
                     "logprob_no_prefix": res.logprob_no_prefix,
                     "logprob_before": sign * res.objective_before, "logprob_after": sign * res.objective_after,
                     "objective_before": res.objective_before, "objective_after": res.objective_after,
                     "greedy_with_prefix": tok.decode(g.generated_ids), "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"[prefix] {name}: {out[name]}", flush=True)
    return out


def zero_input(model) -> dict:
    tok = model.tokenizer
    ids = tok.encode(NEUTRAL[0])
    cv = contrast_vector(model, POSITIVE[:1], NEGATIVE[:1], 10)
    runs = [generate(model, ids, kernel=Kernel(), max_new_tokens=24, seed=7, controllers=c)
            for c in (None, [], [Steering(cv, scale=0.0)])]
    ref = [(s.token, s.logprob) for s in runs[0].steps]
    return {"identical": all([(s.token, s.logprob) for s in r.steps] == ref for r in runs[1:]), "tokens": len(ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--per-prompt", type=int, default=50, help="continuations per ban prompt (4 prompts)")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--prefix-steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="run one part: ban, steer, prefix")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model = load_model()
    report = {"model": model.source, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    if a.only is None:
        report["zero_input"] = zero_input(model)
    if a.only in (None, "ban"):
        report["banned_word"] = banned_word(model, "Paris", a.per_prompt, a.tokens, a.seed)
    if a.only in (None, "steer"):
        report["steering"] = steering(model, a.layer, [-8, -4, -2, -1, 0, 1, 2, 4, 8], [-4, -2, 0, 2, 4], 16, 24,
                                      a.seed)
    if a.only in (None, "prefix"):
        report["prefix"] = prefix(model, a.prefix_steps, 0.05)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
