"""Soak: N agent episodes back to back on one model, watching for leaks and lost records.

    python benchmarks/soak.py --episodes 1000 [--model SPEC] [--out soak.json] [--keep-traces DIR]

Each episode is `HybridAgent(model, calculator).run(task, trace=...)` on a problem of the
built-in evaluation (hybridlm.agent.evaluation.problems, cycled). After every episode the
script records the process's resident memory (RSS), open file descriptors, OS threads and
child processes (from /proc, Linux), and checks the episode's trace: every line parses and
passes the trace schema (hybridlm's reader), the last event is `end`, and its answer equals
the arc's. The summary says whether RSS after the first 50 episodes stays within ±5 % of its
value at episode 50, and whether file descriptors, threads or children grew.
Exit code 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 50  # episodes before RSS is expected to be flat
RSS_BAND = 0.05


def process_figures() -> dict:
    """RSS (MiB), open fds, OS threads and live child processes of this process, from /proc."""
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    me = str(os.getpid())
    children = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:  # field 4, the parent pid, after "(comm)"
                children += 1
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(fields["Threads"]),
        "children": children,
    }


def check_trace(path: Path, arc) -> str | None:
    """None when the trace is complete and agrees with the arc, else what is wrong."""
    from hybridlm.agent.trace import read_trace
    from hybridlm.errors import InputError

    try:
        events = read_trace(path)
    except InputError as exc:
        return str(exc)
    if not events or events[-1]["event"] != "end":
        return f"{path}: no end event"
    if events[-1].get("answer") != arc.answer:
        return f"{path}: the end event's answer {events[-1].get('answer')!r} is not the arc's {arc.answer!r}"
    return None


def summarise(rows: list[dict]) -> dict:
    first = rows[0]
    after = rows[WARMUP - 1:] if len(rows) >= WARMUP else []
    reference = after[0]["rss_mib"] if after else None
    drift = max((abs(r["rss_mib"] - reference) / reference for r in after), default=None) if after else None
    growth = {k: max(r[k] for r in rows) - first[k] for k in ("fds", "threads", "children")}
    last = {k: rows[-1][k] - first[k] for k in ("fds", "threads", "children")}
    return {
        "episodes": len(rows),
        "rss_mib_first": round(first["rss_mib"], 1),
        "rss_mib_at_warmup": round(reference, 1) if reference else None,
        "rss_mib_last": round(rows[-1]["rss_mib"], 1),
        "rss_mib_max_after_warmup": round(max(r["rss_mib"] for r in after), 1) if after else None,
        "rss_drift_after_warmup": round(drift, 4) if drift is not None else None,
        "rss_flat": drift is not None and drift <= RSS_BAND,
        "max_growth_over_first": growth,
        "last_minus_first": last,
        "no_growth": all(v <= 0 for v in last.values()),
        "traces_complete": sum(r["trace_ok"] for r in rows),
        "answers_recorded": sum(r["answer_recorded"] for r in rows),
        "jumps": sum(r["jumps"] for r in rows),
        "tool_errors": sum(r["tool_errors"] for r in rows),
        "median_episode_s": round(statistics.median(r["wall_s"] for r in rows), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--model", default=None, help="load_model spec (default: the embedded SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None, help="write every row and the summary as JSON here")
    parser.add_argument("--keep-traces", default=None, help="keep the traces in this folder (default: deleted)")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be ≥ 1")

    from hybridlm import load_model
    from hybridlm.agent import HybridAgent, Limits, registry
    from hybridlm.agent.evaluation import problems

    model = load_model(args.model)
    agent = HybridAgent(model, registry(["calculator"]), limits=Limits(max_token_steps=args.max_new_tokens))
    tasks = problems(min(args.episodes, 200))
    folder = Path(args.keep_traces) if args.keep_traces else Path(tempfile.mkdtemp(prefix="hybridlm-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows, problems_seen = [], []
    t_start = time.perf_counter()
    for episode in range(args.episodes):
        task = tasks[episode % len(tasks)]
        trace = folder / f"episode{episode:05d}.jsonl"
        t0 = time.perf_counter()
        arc = agent.run(task.question, trace=trace)
        wall = time.perf_counter() - t0
        problem = check_trace(trace, arc)
        if problem:
            problems_seen.append(problem)
        if not args.keep_traces:
            trace.unlink(missing_ok=True)
        rows.append({"episode": episode + 1, "wall_s": round(wall, 3), "trace_ok": problem is None,
                     "answer_recorded": isinstance(arc.answer, str) and arc.stop_reason in ("answer", "token_budget"),
                     "jumps": len(arc.jumps), "tool_errors": sum(j.error is not None for j in arc.jumps),
                     **process_figures()})
        r = rows[-1]
        print(f"{r['episode']:>5} {wall:6.2f}s rss {r['rss_mib']:7.1f} MiB fds {r['fds']:>3} threads {r['threads']:>3} "
              f"children {r['children']} jumps {r['jumps']} {'' if problem is None else 'TRACE: ' + problem}",
              file=sys.stderr, flush=True)
    summary = summarise(rows)
    summary["total_s"] = round(time.perf_counter() - t_start, 1)
    summary["trace_problems"] = problems_seen[:10]
    if not args.keep_traces:
        try:
            folder.rmdir()
        except OSError:
            pass
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    ok = (summary["traces_complete"] == summary["answers_recorded"] == len(rows) and summary["no_growth"]
          and (summary["rss_flat"] or len(rows) < WARMUP))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
