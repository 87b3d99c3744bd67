"""Agents on one engine: 8 tasks whose tool takes 1 s of wall time per call, run one after
another and then concurrently on one engine; the ratio of the wall times is printed.

While a task's tool runs (mode q_E) its rows leave the batch and the other tasks keep
generating: the token clock and wall time are separate clocks. The concurrent run must give
every task the tokens it gets alone (same seeds), and its trace shows the rows leaving the
batch in q_E.

    python benchmarks/engine_concurrency.py [--tasks 8] [--sleep 1.0] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hybridlm import load_model
from hybridlm.agent import HybridAgent, Limits
from hybridlm.tools import ToolRegistry, tool
from hybridlm.agent.evaluation import correct, problems
from hybridlm.tools import evaluate_arithmetic
from hybridlm.engine.trace import read_trace


def slow_calculator(seconds: float):
    @tool(name="calculator", timeout_s=seconds + 10, properties={"expression": {"pattern": r"^[0-9+*/(). -]+$"}})
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. "12 * (3 + 4)"."""
        time.sleep(seconds)  # a tool that takes wall time: a remote service, a plant, a person
        return str(evaluate_arithmetic(expression))

    return calculator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--sleep", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for the traces (default: a temporary one)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model()
    tools = ToolRegistry()
    tools.register(slow_calculator(args.sleep))
    agent = HybridAgent(model, tools, limits=Limits(max_token_steps=120, max_jumps=2))
    tasks = [pr.question for pr in problems(args.tasks)]
    expected = [pr.answer for pr in problems(args.tasks)]
    agent.run("What is 2 + 2?")  # warm: the shared prompt prefix enters the prefix cache
    out = Path(args.out or tempfile.mkdtemp(prefix="engine-concurrency-"))
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    alone = [agent.run(task, trace=out / f"alone-{i}.jsonl") for i, task in enumerate(tasks)]
    sequential_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    together = agent.run_many(tasks, traces=[out / f"together-{i}.jsonl" for i in range(len(tasks))])
    concurrent_s = time.perf_counter() - t0

    same = [a.generated_ids == b.generated_ids for a, b in zip(alone, together)]
    left = []
    for i in range(len(tasks)):
        events = read_trace(out / f"together-{i}.jsonl")
        left.append(sum(1 for e in events if e["event"] == "batch" and e["action"] == "leave" and e["reason"] == "q_E"))
    report = {
        "tasks": len(tasks), "tool_sleep_s": args.sleep, "threads": args.threads,
        "sequential_s": round(sequential_s, 2), "concurrent_s": round(concurrent_s, 2),
        "speedup": round(sequential_s / concurrent_s, 2),
        "jumps": [len(a.jumps) for a in together], "rows_left_batch_in_q_E": left,
        "tokens_identical_to_alone": all(same), "correct": sum(correct(a.answer, e) for a, e in zip(together, expected)),
        "traces": str(out),
    }
    print(f"{len(tasks)} agent tasks, tool {args.sleep:g} s per call: one after another {sequential_s:.1f} s, "
          f"concurrently on one engine {concurrent_s:.1f} s: {sequential_s / concurrent_s:.2f}x; "
          f"tokens identical to alone: {all(same)}; rows left the batch in q_E: {left}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
