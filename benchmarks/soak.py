"""Soak: N agent episodes back to back on one model, watching for leaks and lost records.

    python benchmarks/soak.py --episodes 1000 [--model SPEC] [--out soak.json] [--keep-traces DIR]
    python benchmarks/soak.py --server --clients 8 --episodes 1000 [--out soak-server.json]

Each episode is `HybridAgent(model, calculator).run(task, trace=...)` on a problem of the
built-in evaluation (hybridlm.agent.evaluation.problems, cycled). After every episode the
script records the process's resident memory (RSS), open file descriptors, OS threads and
child processes (from /proc, Linux), and checks the episode's trace: every line parses and
passes the trace schema (hybridlm's reader), the last event is `end`, and its answer equals
the arc's. The summary says whether RSS after the first 50 episodes stays within ±5 % of its
value at episode 50, and whether file descriptors, threads or children grew.
Exit code 0 when every check holds, 1 otherwise.

With --server the episodes go through `hybridlm serve --tools calculator` (a subprocess on
127.0.0.1) from --clients concurrent clients: each episode is a chat request (tool_choice
required) whose calculator calls the server runs itself; the figures are the server process's,
read after every answered request, and each request's arc (GET /v1/arcs/{id}) is checked against
the trace schema, ends with `end`, and its cause is the response's. The episodes go in waves of
50; between waves, with no request in flight, the server's RSS is read again, and those readings
are the ones held to ±5 % (after an answer the other requests' states are still resident).
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
ANSWERED = ("stop_token", "token_budget", "jump_horizon")  # an arc that ended with an answer (a cut one too)


def process_figures(pid: int | None = None) -> dict:
    """RSS (MiB), open fds, OS threads and live child processes of a process (this one by default), from /proc."""
    proc = Path("/proc") / (str(pid) if pid else "self")
    status = (proc / "status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    me = str(pid or os.getpid())
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
        "fds": len(os.listdir(proc / "fd")),
        "threads": int(fields["Threads"]),
        "children": children,
    }


def check_trace(path: Path, arc) -> str | None:
    """None when the trace is complete and agrees with the arc, else what is wrong."""
    from hybridlm.engine.trace import read_trace
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


def summarise(rows: list[dict], baseline: int = 0) -> dict:
    """`baseline`: the episode whose fds, threads and children later ones are compared with (a
    server's worker threads are made on demand over its first requests)."""
    first = rows[min(baseline, len(rows) - 1)]
    after = rows[WARMUP - 1:] if len(rows) >= WARMUP else []
    reference = after[0]["rss_mib"] if after else None
    drift = max((abs(r["rss_mib"] - reference) / reference for r in after), default=None) if after else None
    growth = {k: max(r[k] for r in rows[baseline:]) - first[k] for k in ("fds", "threads", "children")}
    last = {k: rows[-1][k] - first[k] for k in ("fds", "threads", "children")}
    return {
        "episodes": len(rows),
        "rss_mib_first": round(rows[0]["rss_mib"], 1),
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
    parser.add_argument("--precision", default="auto", help="as hybridlm agent's --precision (default: auto)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None, help="write every row and the summary as JSON here")
    parser.add_argument("--keep-traces", default=None, help="keep the traces in this folder (default: deleted)")
    parser.add_argument("--server", action="store_true", help="through `hybridlm serve` with --clients clients")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be ≥ 1")
    if args.server:
        return soak_server(args)

    from hybridlm import load_model
    from hybridlm.agent import HybridAgent, Limits
    from hybridlm.tools import registry
    from hybridlm.agent.evaluation import problems
    from hybridlm.memory import configure

    configure()  # the memory settings of the command line (hybridlm eval agent runs episodes like these)
    model = load_model(args.model, precision=args.precision)
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
                     "answer_recorded": isinstance(arc.answer, str) and arc.stop_reason in ANSWERED,
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


def soak_server(args) -> int:
    import concurrent.futures as cf
    import re
    import subprocess
    import threading
    import urllib.request

    from hybridlm.agent.evaluation import problems
    from hybridlm.engine.trace import read_trace
    from hybridlm.errors import InputError

    cmd = [sys.executable, "-m", "hybridlm.cli", "serve", "--port", "0", "--tools", "calculator", "--log-level",
           "warning", "--max-arcs", "64", "--precision", args.precision] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    line = ""
    while "/v1" not in line:
        line = server.stderr.readline()
        if not line and server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode})")
    url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line).group(1)
    threading.Thread(target=server.stderr.read, daemon=True).start()  # drain its log
    tasks = problems(min(args.episodes, 200))
    lock = threading.Lock()
    rows, problems_seen, t_start = [], [], time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="hybridlm-soak-"))

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())

    def episode(i: int) -> None:
        task = tasks[i % len(tasks)]
        t0 = time.perf_counter()
        r = post("/chat/completions", {"model": "smollm2-135m", "messages": [{"role": "user", "content": task.question}],
                                       "tool_choice": "required",  # the first turn calls, as the agent's does
                                       "max_tokens": args.max_new_tokens, "temperature": 0, "seed": i})
        wall = time.perf_counter() - t0
        ext = r["hybridlm"]
        trace = folder / f"episode{i:05d}.jsonl"
        with urllib.request.urlopen(f"{url}/arcs/{ext['arcs'][0]}", timeout=60) as a:
            trace.write_bytes(a.read())
        problem = None
        try:
            events = read_trace(trace)
            if not events or events[-1]["event"] != "end":
                problem = f"arc {ext['arcs'][0]}: no end event"
            elif events[-1]["stop_reason"] != ext["termination"][0]:
                problem = (f"arc {ext['arcs'][0]}: ends with {events[-1]['stop_reason']}, "
                           f"the response says {ext['termination'][0]}")
        except InputError as exc:
            problem = str(exc)
        trace.unlink(missing_ok=True)
        jumps = ext.get("jumps", [[]])[0]
        with lock:
            if problem:
                problems_seen.append(problem)
            rows.append({"episode": len(rows) + 1, "wall_s": round(wall, 3), "trace_ok": problem is None,
                         "answer_recorded": isinstance(r["choices"][0]["message"]["content"], str)
                         and ext["termination"][0] in ANSWERED,
                         "jumps": len(jumps), "tool_errors": sum(j["error"] is not None for j in jumps),
                         **process_figures(server.pid)})
            row = rows[-1]
            print(f"{row['episode']:>5} {wall:6.2f}s server rss {row['rss_mib']:7.1f} MiB fds {row['fds']:>3} "
                  f"threads {row['threads']:>3} children {row['children']} jumps {row['jumps']}"
                  f"{'' if problem is None else ' ARC: ' + problem}", file=sys.stderr, flush=True)

    quiet = []  # the server's figures between waves of WARMUP episodes, no request in flight
    try:
        with cf.ThreadPoolExecutor(args.clients) as pool:
            for start in range(0, args.episodes, WARMUP):
                for f in [pool.submit(episode, i) for i in range(start, min(start + WARMUP, args.episodes))]:
                    f.result()
                time.sleep(0.5)  # the engine lets the wave's last sequences go
                quiet.append({"episode": len(rows), **process_figures(server.pid)})
                print(f"  quiet after {len(rows)}: rss {quiet[-1]['rss_mib']:.1f} MiB", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
        try:
            folder.rmdir()
        except OSError:
            pass
    summary = summarise(rows, baseline=WARMUP - 1)
    # After each answer 7 other requests are still in flight, their KV states resident: that RSS
    # varies by ±8 % with them. What is kept is read between waves, with none in flight.
    summary["rss_in_flight_mib"] = [round(min(r["rss_mib"] for r in rows), 1), round(max(r["rss_mib"] for r in rows), 1)]
    summary["rss_quiet_mib"] = [round(q["rss_mib"], 1) for q in quiet]
    summary["quiet"] = quiet
    if len(quiet) >= 2:
        reference = quiet[0]["rss_mib"]
        summary["rss_drift_after_warmup"] = round(max(abs(q["rss_mib"] - reference) / reference for q in quiet[1:]), 4)
        summary["rss_flat"] = summary["rss_drift_after_warmup"] <= RSS_BAND
        # a server's thread pool grows and shrinks with its connections: growth is a trend, the
        # second half's most above the first half's, read with no request in flight
        half = len(quiet) // 2
        summary["no_growth"] = all(max(q[k] for q in quiet[half:]) <= max(q[k] for q in quiet[:half])
                                   for k in ("fds", "threads", "children"))
    summary["total_s"] = round(time.perf_counter() - t_start, 1)
    summary["clients"] = args.clients
    summary["trace_problems"] = problems_seen[:10]
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    ok = (summary["traces_complete"] == summary["answers_recorded"] == len(rows) and summary["no_growth"]
          and (summary["rss_flat"] or len(rows) < WARMUP))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
