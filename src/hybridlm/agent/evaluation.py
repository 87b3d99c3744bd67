"""A built-in, deterministic evaluation: arithmetic word problems that need a calculator.

`problems(n)` draws n problems from fixed templates with a fixed seed, so every run and
every machine sees the same set. Operands are large enough (3 to 6 digits) that a
135M-parameter model cannot do them in its head. An answer is correct when the last
number it states equals the exact result.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from dataclasses import dataclass

from hybridlm.errors import InputError

TEMPLATES = [
    ("A warehouse has {a} boxes with {b} screws in each box. How many screws are there in total?", "{a} * {b}"),
    ("A library had {a} books and received {b} more. How many books does it have now?", "{a} + {b}"),
    ("A tank holds {a} litres. {b} litres are drained. How many litres remain?", "{a} - {b}"),
    ("What is {a} times {b}?", "{a} * {b}"),
    ("A farm harvested {a} kg of apples on Monday and {b} kg on Tuesday. How many kg in total?", "{a} + {b}"),
    ("A factory makes {a} bolts per day. How many bolts does it make in {b} days?", "{a} * {b}"),
    ("A city had {a} residents; {b} moved away. How many residents are left?", "{a} - {b}"),
    ("{p} pencils are shared equally among {b} pupils. How many pencils does each pupil get?", "{p} / {b}"),
    ("What is {a} plus {b}?", "{a} + {b}"),
    ("What is {a} multiplied by {b}?", "{a} * {b}"),
]


@dataclass(frozen=True)
class Problem:
    question: str
    expression: str
    answer: int


def problems(n: int = 50, seed: int = 2024) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, expression = TEMPLATES[i % len(TEMPLATES)]
        a, b = rng.randint(1000, 99999), rng.randint(12, 999)
        if "-" in expression and a < b:
            a, b = b, a
        p = a * b  # for exact division
        values = {"a": a, "b": b, "p": p}
        expr = expression.format(**values)
        answer = {"*": a * b, "+": a + b, "-": a - b, "/": a}[expression.split()[1]]
        out.append(Problem(question.format(**values), expr, answer))
    return out


MODES = ("tools", "no-tools")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def correct(answer_text: str, expected: int) -> bool:
    value = last_number(answer_text)
    return value is not None and abs(value - expected) < 1e-6


def solve(model, mode: str, tasks: list[tuple[int, Problem]], *, seed: int = 0, progress=None) -> list[dict]:
    """Rows of the problems `tasks` (index, problem) in one mode: "tools" (the calculator) or
    "no-tools". Every arc starts its sampler from `seed` and the agent's fixed prompt prefix
    is the same for all, so a row depends on its problem alone, not on the problems solved
    before it in the same process: any split of the problems gives the same rows."""
    from hybridlm.agent.automaton import HybridAgent, Limits
    from hybridlm.tools import ToolRegistry, registry

    if mode not in MODES:
        raise InputError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    tools = registry(["calculator"]) if mode == "tools" else ToolRegistry()
    agent = HybridAgent(model, tools, limits=Limits(max_token_steps=96), seed=seed)
    rows = []
    for index, problem in tasks:
        t0 = time.perf_counter()
        arc = agent.run(problem.question)
        rows.append({
            "index": index, "question": problem.question, "expected": problem.answer, "answer": arc.answer,
            "correct": correct(arc.answer, problem.answer), "jumps": len(arc.jumps),
            "wall_s": time.perf_counter() - t0, "token_steps": arc.token_steps,
        })
        if progress:
            progress(mode, rows[-1])
    return rows


def summarize(n: int, rows_by_mode: dict[str, list[dict]]) -> dict:
    """The report of `evaluate` from the rows of each mode, in problem order."""
    report: dict = {"n": n, "modes": {}}
    for mode, rows in rows_by_mode.items():
        report["modes"][mode] = {
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "mean_jumps": statistics.mean(r["jumps"] for r in rows),
            "mean_wall_s": statistics.mean(r["wall_s"] for r in rows),
            "mean_token_steps": statistics.mean(r["token_steps"] for r in rows),
            "rows": rows,
        }
    return report


def evaluate(model, *, n: int = 50, modes=("tools", "no-tools"), seed: int = 0, progress=None) -> dict:
    """Run the agent on the problems with the calculator and without tools; report accuracy."""
    tasks = list(enumerate(problems(n)))
    return summarize(n, {mode: solve(model, mode, tasks, seed=seed, progress=progress) for mode in modes})
