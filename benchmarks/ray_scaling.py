"""Ray on one machine: a fixed small sweep on 1 node × 1 CPU and 2 nodes × 1 CPU, and Ray's
overhead per task (a no-op task's round trip; one consensus shard timed inside the task,
from the driver, and in this process without Ray).

    python benchmarks/ray_scaling.py [--figures 8] [--passes 5] [--rounds 2] [--out ray_scaling.json]

The clusters are `hybridlm.distributed.local_cluster`: every Ray process on 127.0.0.1, torn
down at the end. The machine is shared and its load drifts: the script prints the load
average beside every figure, and the in-process and in-Ray shard timings alternate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "sweeps" / "survey_consensus.yaml"


def fixed_sweep(figures: list[str], passes: int):
    """The small scale of the survey spec, restricted to some figures, with fewer passes."""
    from hybridlm.distributed import load_sweep
    from hybridlm.distributed.sweep import SweepRun, run_name

    sweep = load_sweep(SPEC, "small")
    runs = []
    for run in sweep.runs:
        if set(run.figures) & set(figures):
            cfg = dataclasses.replace(run.config, passes=passes)
            runs.append(SweepRun(cfg, run_name(cfg), run.figures))
    return dataclasses.replace(sweep, runs=runs)


def time_sweep(sweep, nodes: int) -> dict:
    from hybridlm.distributed import RayPool, local_cluster, run_sweep

    with local_cluster(nodes=nodes, cpus_per_node=1, object_store_mb=100), tempfile.TemporaryDirectory() as out:
        import ray  # after local_cluster: it sets Ray's environment first

        pool = RayPool(ray)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        record = run_sweep(sweep, out, pool)
        wall = time.perf_counter() - t0
    shards = [s for r in record["runs"] for s in r["shards"]]
    return {"nodes": nodes, "wall_s": round(wall, 2), "runs": len(record["runs"]), "shards": len(shards),
            "compute_s_total": round(sum(s["compute_s"] for s in shards), 2),
            "load_s_total": round(sum(s["load_s"] for s in shards), 2),
            "model_loads": sum(s["load_s"] > 0.05 for s in shards),
            "nodes_used": len({s["node"] for s in shards}), "loadavg_1min_at_start": round(load, 2)}


def overhead(repeats: int = 5) -> dict:
    import torch

    from hybridlm.analysis.runner import ConsensusConfig, consensus_shard, prepare_model
    from hybridlm.distributed import Job, RayPool, local_cluster
    from hybridlm.distributed.consensus import shard_task

    torch.set_num_threads(1)  # as in a Ray worker of one CPU
    cfg = ConsensusConfig(model="random:gpt2", weights="random-fixed", prompts=2, prompt_len=32, passes=3, seed=0)
    out: dict = {}
    with local_cluster(nodes=2, cpus_per_node=1, object_store_mb=100):
        import ray  # after local_cluster: it sets Ray's environment first

        @ray.remote(num_cpus=1)
        def noop():
            return None

        ray.get([noop.remote() for _ in range(20)])  # workers started
        trips = []
        for _ in range(200):
            t0 = time.perf_counter()
            ray.get(noop.remote())
            trips.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ray.get([noop.remote() for _ in range(500)])
        batch = time.perf_counter() - t0
        out["noop_round_trip_ms"] = {"median": round(1e3 * statistics.median(trips), 3),
                                     "p90": round(1e3 * sorted(trips)[int(0.9 * len(trips))], 3)}
        out["noop_throughput_per_s"] = round(500 / batch, 1)

        pool = RayPool(ray)
        model = prepare_model(cfg, "cpu")
        job = Job(shard_task, (cfg, 0, cfg.prompts, None, 1, "cpu"))
        got: dict = {}
        pool.run([job], lambda i, r: got.update(r=r))  # the worker loads its model once
        local, inside, outside = [], [], []
        for _ in range(repeats):  # alternate, so that drifting load touches both alike
            t0 = time.perf_counter()
            consensus_shard(cfg, model, 0, cfg.prompts)
            local.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pool.run([job], lambda i, r: got.update(r=r))
            outside.append(time.perf_counter() - t0)
            inside.append(got["r"].ran["compute_s"])
        med = statistics.median
        out["shard"] = {"config": dataclasses.asdict(cfg), "in_process_s": round(med(local), 4),
                        "inside_ray_task_s": round(med(inside), 4), "driver_round_trip_s": round(med(outside), 4),
                        "ray_overhead_s": round(med(o - i for o, i in zip(outside, inside)), 4),
                        "loadavg_1min": round(os.getloadavg()[0], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--figures", default="8", help="figures of the small sweep to run (comma separated)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="1-node and 2-node sweeps, alternating, this many times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sweep = fixed_sweep(args.figures.split(","), args.passes)
    result = {"sweep": {"figures": args.figures, "runs": [r.name for r in sweep.runs],
                        "shard_prompts": sweep.shard_prompts},
              "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    result["overhead"] = overhead()
    result["scaling"] = [time_sweep(sweep, nodes) for _ in range(args.rounds) for nodes in (1, 2)]
    walls = {n: [r["wall_s"] for r in result["scaling"] if r["nodes"] == n] for n in (1, 2)}
    result["speedup_2_nodes"] = [round(a / b, 3) for a, b in zip(walls[1], walls[2])]  # per round
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
