"""Every probe of the attack suite (tests/attack_probes.py) against `hybridlm serve`, measured.

    python benchmarks/attacks.py [--model smollm2-135m]

One server (server-side calculator and an MCP stdio server, 256 descriptors: a connection cap of 128)
takes the request probes in turn; for each: its status, its time, the server's RSS before and after
(once nothing runs in it), the worst /health latency while it ran (polled from a process of its own)
and the worst gap between the chunks of a stream kept running meanwhile. `--steady` first brings the
server to the memory it holds after a while in service: a request that generates, and long prompts
that fill the prefix cache to its bound (states a fresh server has yet to keep), so that RSS before →
after measures what a probe leaves behind. The probes that kill a server, or run a command or a tool
server of their own, get their own process (their RSS and stream columns are empty). Prints a
markdown table (docs/server.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import attack_probes as P  # (the probes live beside the tests that assert them)

PREFIX_CACHE_MB = 256  # the served --prefix-cache-mb (the default)


def fmt(x: float | None, unit: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the served model [default: the embedded SmolLM2-135M]")
    parser.add_argument("--part", choices=["all", "requests", "others"], default="all",
                        help="the request probes on one server, the others (own processes), or all")
    parser.add_argument("--steady", action="store_true",
                        help="fill the server's kept states to their bounds before the request probes")
    args = parser.parse_args()
    rows = []

    def row(name: str, out: P.Outcome, rss=(None, None), watch: P.Watch | None = None) -> None:
        health = watch.health_worst if watch is not None else None
        gap = watch.gap_worst if watch is not None and watch.stream else None
        fails = f" ({len(watch.failures)} polls refused)" if watch is not None and watch.failures else ""
        rows.append(f"| {name} | {out.status} | {out.seconds:.2f} s | {fmt(rss[0])} → {fmt(rss[1])} MB "
                    f"| {fmt(health, ' s')}{fails} | {fmt(gap, ' s')} | {out.detail[:90].replace('|', '/')} |")
        print(rows[-1], flush=True)

    if args.part != "others":
        requests(args, row)
    if args.part != "requests":
        others(args, row)
    print("\n| probe | status | time | RSS before → after | /health worst | stream's worst chunk gap | answer |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def requests(args, row) -> None:
    served = P.Served("--tools", "calculator", "--mcp", f"{sys.executable} {P.MCP_SERVER}", "--max-batch", "4",
                      "--prefix-cache-mb", str(PREFIX_CACHE_MB),
                      fds=256, model=args.model)
    from hybridlm.weights.loading import load_model

    specials = list(load_model(args.model).tokenizer.special_strings)
    if args.steady:
        steady(served)
    probes = [
        ("role injection: every special token in a tool observation", lambda s: P.role_injection(s, specials)),
        ("text/plain body", P.text_plain),
        ("foreign Host (DNS rebinding)", P.foreign_host),
        ("page names a server-side tool (foreign Origin)", P.page_forces_tool),
        ("85,000 tool calls (7 MB body)", P.many_calls),
        ("10,000 short messages", P.many_messages),
        ("4 stop strings of 40,000 characters, streamed", P.long_stops),
        ("logit_bias of 256,870 entries", P.logit_bias),
        ("schema: a 4,000-digit bound", P.schema_digits),
        ("schema: 400 levels of nesting", P.schema_depth),
        ("/metrics (no key set)", P.metrics_without_key),
        ("100 slow connections (below the cap)", lambda s: P.slowloris(s, 100)),
        ("200 slow connections (cap 128)", lambda s: P.slowloris(s, 200)),
        ("a 6,000-token prefill", P.prefill_gap),
    ]
    try:
        for name, probe in probes:
            before = settled_rss(served)
            with P.Watch(served, stream=True) as watch:
                out = probe(served)
            row(name, out, (before, settled_rss(served)), watch)
        row("SIGKILL of serve with an MCP server", P.kill_leaves_no_mcp_children(served))
    finally:
        served.stop()


def gauges(served: P.Served) -> dict[str, float]:
    """The server's /metrics, name → value (the unlabelled samples)."""
    text = served.request("GET", "/metrics").body
    found = {}
    for line in str(text).splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("hybridlm_") and value:
            found[name.removeprefix("hybridlm_")] = float(value)
    return found


def settled_rss(served: P.Served, timeout: float = 20.0) -> float:
    """The server's RSS once nothing runs in it and its freed pages are back with the kernel (the stream
    the Watch kept running is cancelled when the Watch closes its connection; its state is freed and
    trimmed when the engine sees that, a moment after the batch gauge reads 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gauges(served)
        if g.get("batch_rows", 1) + g.get("queue_length", 1) + g.get("external_sequences", 1) == 0:
            break
        time.sleep(0.1)
    rss = served.rss_mb()
    while time.monotonic() < deadline:  # until it stops falling
        time.sleep(0.25)
        now = served.rss_mb()
        if now > rss - 1:
            return min(rss, now)
        rss = now
    return rss


def steady(served: P.Served) -> None:
    """A request that generates, then long prompts of other text until the prefix cache is at its bound
    (256 MB by default; a 6,000-token prompt's copies fill it on SmolLM2)."""
    served.chat({"messages": P.ask("Tell me a story."), "max_tokens": 64, "temperature": 1.0, "seed": 2})
    for word in (" world", " river", " stone"):
        g = gauges(served)
        if g.get("prefix_cache_bytes", 0) >= 0.9 * 2**20 * PREFIX_CACHE_MB:
            break
        served.request("POST", "/v1/completions", {"model": P.MODEL, "prompt": word * 6000, "max_tokens": 1},
                       timeout=600)
    print(f"steady: prefix cache {gauges(served).get('prefix_cache_bytes', 0) / 2**20:.0f} MB, "
          f"RSS {settled_rss(served):.0f} MB", flush=True)


def others(args, row) -> None:
    from hybridlm.weights.loading import load_model

    term = P.Served("--max-batch", "4", model=args.model)
    try:
        row("SIGTERM with a stream and a request in flight", P.sigterm_in_flight(term))
    finally:
        term.stop()
    keyed = P.Served("--api-key", "k3y", model=args.model)
    try:
        row("/metrics without the key (--api-key set)", P.metrics_without_key(keyed))
    finally:
        keyed.stop()
    row("MCP: a 100 MB result, then a normal call", P.mcp_flood_then_call())
    row("MCP: the server crashes mid-call, then a call", P.mcp_crash_then_call())
    with tempfile.TemporaryDirectory() as tmp:
        row("agent --trace /dev/full", P.trace_to_full_disk())
        row("agent --trace through a symlink", P.trace_through_symlink(Path(tmp)))
        row("trace replay of a forged budget (10⁹ steps)", P.forged_replay_budget(load_model(args.model), Path(tmp)))
    row("report /dev/zero", P.report_of_a_device())


if __name__ == "__main__":
    main()
