"""A running stream's chunk gaps while another client's long prompt is prefilled (`hybridlm serve`).

For each --prefill-chunk value (0: a prompt in one piece, the reference), a fresh `hybridlm serve`
runs the embedded model as a subprocess on 127.0.0.1. One client streams a long completion
(greedy, counting); once it has received a few chunks, a second client sends a conversation of
about --tokens prompt tokens (many messages) with max_tokens=1. Printed per chunk value: the
stream's worst gap between two chunks while the long request was in flight, its median gap before
it, and the long request's own latency (its prefill). --out writes every figure as JSON.

    python benchmarks/prefill_interleave.py [--chunks 0,256,64] [--tokens 5900] [--threads 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

TOPICS = ["rivers", "bridges", "clocks", "gardens", "harbours", "libraries", "mountains", "railways"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 1200) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start(chunk: int, threads: int, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridlm.cli", "serve", "--port", str(port), "--threads",
                             str(threads), "--prefill-chunk", str(chunk), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"server did not start: {log.read_text()[-2000:]}")


def conversation(port: int, tokens: int) -> list[dict]:
    """User and assistant messages of about 60 tokens each, about `tokens` tokens in all."""
    messages: list[dict] = [{"role": "system", "content": "You are a careful assistant."}]
    i, total = 0, 0
    while total < tokens - 120:
        topic = TOPICS[i % len(TOPICS)]
        text = (f"Message {i}: tell me one more fact about {topic}, in a plain sentence, and say how it relates "
                f"to the fact about {TOPICS[(i + 3) % len(TOPICS)]} from message {max(0, i - 1)}, briefly.")
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        total += len(post(port, "/tokenize", {"content": text})["tokens"]) + 5
        i += 1
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Now summarise."})
    return messages


def stream(port: int, times: list[float], stop: threading.Event) -> None:
    body = json.dumps({"model": "smollm2-135m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 4000, "temperature": 0,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    for line in response:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            times.append(time.perf_counter())
        if stop.is_set():
            break
    conn.close()


def one(chunk: int, tokens: int, threads: int, logs: Path) -> dict:
    proc, port = start(chunk, threads, logs / f"serve_{chunk}.log")
    try:
        messages = conversation(port, tokens)
        times: list[float] = []
        stop = threading.Event()
        reader = threading.Thread(target=stream, args=(port, times, stop), daemon=True)
        reader.start()
        while len(times) < 12:
            time.sleep(0.05)
        t0 = time.perf_counter()
        out = post(port, "/v1/chat/completions", {"model": "smollm2-135m", "messages": messages, "max_tokens": 1})
        t1 = time.perf_counter()
        n = len(times)
        while len(times) < n + 3 and reader.is_alive():
            time.sleep(0.05)
        stop.set()
        ts = list(times)
        before = [b - a for a, b in zip(ts, ts[1:]) if b <= t0]
        during = [b - a for a, b in zip(ts, ts[1:]) if b > t0 and a < t1]
        return {"prefill_chunk": chunk, "prompt_tokens": out["usage"]["prompt_tokens"], "messages": len(messages),
                "long_request_s": round(t1 - t0, 3), "worst_gap_s": round(max(during), 3),
                "median_gap_before_s": round(statistics.median(before), 4), "chunks_during": len(during)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="0,256,64", help="--prefill-chunk values; 0 (one piece) is the reference")
    ap.add_argument("--tokens", type=int, default=5900, help="prompt tokens of the long request (about)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for chunk in [int(c) for c in args.chunks.split(",")]:
            rows.append(one(chunk, args.tokens, args.threads, Path(logs)))
            print(json.dumps(rows[-1]), flush=True)
    ref = next((r for r in rows if r["prefill_chunk"] == 0), None)
    for r in rows:
        if ref is not None and r is not ref:
            print(f"prefill_chunk={r['prefill_chunk']}: worst gap {r['worst_gap_s']} s vs {ref['worst_gap_s']} s in one "
                  f"piece ({r['worst_gap_s'] / ref['worst_gap_s']:.3f}x); long request {r['long_request_s']} s vs "
                  f"{ref['long_request_s']} s ({r['long_request_s'] / ref['long_request_s']:.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
