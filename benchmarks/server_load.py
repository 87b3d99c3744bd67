"""Load on `hybridlm serve` beside llama-cpp-python's OpenAI server, on the same GGUF file and threads.

Both servers run as subprocesses on 127.0.0.1; the same streamed chat requests (a shared system
prompt of about 400 tokens, varied questions, greedy, max_tokens fixed) go to each at 1, 4 and 16
concurrent clients, the two servers taking turns at every level. The clients read the event streams
with the standard library (as a load generator would: they share the machine with the servers). For each: aggregate output tokens
per second, time to first token (p50/p95) and time per output token after the first (p50/p95).
Output tokens are counted by re-encoding each answer with the model's own tokenizer, the same
measure for both. The ratios are printed; --out writes every figure as JSON.

    python benchmarks/server_load.py [--model qwen2.5-coder-0.5b] [--clients 1,4,16] [--requests 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = [
    "What is photosynthesis?", "Why is the sky blue?", "How do bees make honey?", "What causes tides?",
    "How does a compass work?", "Why do leaves change colour in autumn?", "What is a black hole?",
    "How do vaccines work?", "What is the water cycle?", "Why do cats purr?", "How are rainbows formed?",
    "What is inflation in economics?", "How does a refrigerator keep food cold?", "Why do we have seasons?",
    "What is the speed of sound?", "How do airplanes stay in the air?", "What is DNA?", "Why is the sea salty?",
    "How do volcanoes erupt?", "What is a prime number?",
]
SYSTEM = ("You are a patient teacher for curious students. Answer every question in plain words, with one short "
          "example from everyday life, and never use jargon without explaining it. ")


def system_prompt(tokenizer, tokens: int) -> str:
    """A system prompt of about `tokens` tokens (the teacher's rules, repeated with numbered notes)."""
    text, i = SYSTEM, 1
    while len(tokenizer.encode(text)) < tokens:
        text += f"Note {i}: keep the answer friendly, correct and short, and check every fact before you state it. "
        i += 1
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"server at {url} did not start: {log.read_text()[-2000:]}")


def start_servers(gguf: str, model: str, threads: int, max_batch: int, logs: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    servers = {}
    port = free_port()
    log = logs / "hybridlm.log"
    servers["hybridlm"] = dict(url=f"http://127.0.0.1:{port}/v1", model=model, log=log, proc=subprocess.Popen(
        [sys.executable, "-m", "hybridlm.cli", "serve", "--model", model, "--precision", "auto", "--port", str(port),
         "--threads", str(threads), "--max-batch", str(max_batch), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env))
    port = free_port()
    log = logs / "llama_cpp.log"
    servers["llama.cpp"] = dict(url=f"http://127.0.0.1:{port}/v1", model=gguf, log=log, proc=subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "4096", "--n_threads", str(threads),
         "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env))
    for s in servers.values():
        wait_ready(s["url"], s["proc"], s["log"])
    return servers


def one_request(server: dict, system: str, question: str, max_tokens: int, tokenizer) -> dict:
    """One streamed chat request, read as server-sent events with the standard library (a light
    client, like a load generator's: the clients share the two cores with the server)."""
    host, port = server["url"].split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": server["model"], "messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": question}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"{server['url']}: HTTP {response.status}: {response.read()[:300]!r}")
    first, parts = None, []
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
        if delta:
            if first is None:
                first = time.perf_counter()
            parts.append(delta)
    conn.close()
    end = time.perf_counter()
    tokens = len(tokenizer.encode("".join(parts)))
    first = first if first is not None else end
    return {"ttft": first - t0, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens, "start": t0, "end": end}


def run_level(server: dict, clients: int, requests: int, system: str, max_tokens: int, tokenizer, rng) -> dict:
    questions = [rng.choice(QUESTIONS) for _ in range(clients * requests)]

    def client_loop(c: int) -> list[dict]:
        return [one_request(server, system, questions[c * requests + r], max_tokens, tokenizer)
                for r in range(requests)]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        rows = [row for rows in pool.map(client_loop, range(clients)) for row in rows]
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in rows)
    tpot = sorted(r["tpot"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"clients": clients, "requests": len(rows), "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "tpot_p50": pct(tpot, 50), "tpot_p95": pct(tpot, 95)}


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m",
                    help="the embedded model or a registry name (qwen2.5-coder-0.5b, gemma-3-270m): both servers load its GGUF")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from hybridlm.weights.gguf import smollm2_path
    from hybridlm.weights.loading import load_model
    from hybridlm.weights.registry import real_model_path

    gguf = str(smollm2_path() if args.model == "smollm2-135m" else real_model_path(args.model))
    tokenizer = load_model(args.model).tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    levels = [int(c) for c in args.clients.split(",")]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as logs:
        servers = start_servers(gguf, args.model, args.threads, args.max_batch, Path(logs))
        try:
            for s in servers.values():  # warm: load, first prefill of the shared prompt
                one_request(s, system, QUESTIONS[0], 4, tokenizer)
            results = {name: [] for name in servers}
            for level in levels:
                order = list(servers)
                rng.shuffle(order)
                for name in order:
                    row = run_level(servers[name], level, args.requests, system, args.max_tokens, tokenizer,
                                    random.Random(args.seed + level))
                    results[name].append(row)
                    print(f"{name:>9} × {level:>2} clients: {row['tokens_per_s']:7.1f} tok/s, TTFT p50 "
                          f"{row['ttft_p50']:.3f} s p95 {row['ttft_p95']:.3f} s, TPOT p50 {row['tpot_p50'] * 1e3:.1f} "
                          f"ms p95 {row['tpot_p95'] * 1e3:.1f} ms ({row['tokens']} tokens in {row['wall_s']:.1f} s)",
                          flush=True)
        finally:
            for s in servers.values():
                s["proc"].terminate()
            for s in servers.values():
                try:
                    s["proc"].wait(timeout=30)
                except subprocess.TimeoutExpired:
                    s["proc"].kill()
    print("\nratios hybridlm / llama.cpp server (same GGUF, same threads):")
    print("clients | aggregate tok/s | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95")
    def ratio(a: float, b: float) -> str:
        return f"{a / b:8.2f}" if b > 0 else "       -"

    for ours, theirs in zip(results["hybridlm"], results["llama.cpp"]):
        print(f"{ours['clients']:>7} | {ratio(ours['tokens_per_s'], theirs['tokens_per_s']):>15} | "
              f"{ratio(ours['ttft_p50'], theirs['ttft_p50'])} | {ratio(ours['ttft_p95'], theirs['ttft_p95'])} | "
              f"{ratio(ours['tpot_p50'], theirs['tpot_p50'])} | {ratio(ours['tpot_p95'], theirs['tpot_p95'])}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
