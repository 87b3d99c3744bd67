"""SmolLM2-135M-Instruct in the loop of the water tank, with and without the CBF filter.

N runs of H plant seconds per condition, the conditions interleaved (run i without the
filter, then run i with it, from the same initial level and valve), so that drift in the
machine's load falls on both alike. Per run: the time inside the band 40–60 cm, the number
of barrier violations (exits from the band), the commands and how many the filter
corrected; per decision: token steps and wall seconds. Writes JSON, a Markdown table, and
the figure of the first run of each condition.

    python benchmarks/plant_experiment.py --runs 10 --horizon 120 --speed 1 --out runs/plant
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from hybridlm import load_model
from hybridlm.agent.supervisor import Supervisor, spread
from hybridlm.plant import WallClock, tank

TASK = "Keep the level between 40 and 60 cm for the next {h:g} s"


def one_run(model, *, cbf: bool, level: float, valve: float, horizon: float, speed: float, period: float,
            seed: int, out: Path, figure: bool) -> dict:
    plant = tank(level=level, valve=valve, clock=WallClock(speed), cbf=cbf)
    supervisor = Supervisor(model, plant, horizon_s=horizon, period_s=period, seed=seed)
    name = f"run{seed:02d}-{'cbf' if cbf else 'raw'}"
    arc = supervisor.run(TASK.format(h=horizon), trace=out / f"{name}.jsonl",
                         figure=out / f"{name}.png" if figure else None)
    return {"seed": seed, "cbf": cbf, "level0": level, "valve0": valve, "safe_time_s": arc.safe_time_s,
            "safe_fraction": arc.safe_fraction, "violations": arc.violations, "decisions": len(arc.decisions),
            "commands": len(arc.corrections), "corrected": sum(1 for c in arc.corrections if c["corrected"]),
            "token_steps": [d.token_steps for d in arc.decisions], "wall_s": [d.wall_s for d in arc.decisions],
            "plant_s": [d.tau1 - d.tau0 for d in arc.decisions],
            "jumps": [j for d in arc.decisions for j in d.jumps]}


def table(rows: list[dict]) -> str:
    lines = ["| condition | time in band (mean ± sd) | min – max | violations (total, per run) | commands corrected |"
             " decision: token steps median / p95 | wall s median / p95 |", "|---|---|---|---|---|---|---|"]
    for cbf in (False, True):
        runs = [r for r in rows if r["cbf"] == cbf]
        if not runs:
            continue
        frac = [100 * r["safe_fraction"] for r in runs]
        steps = spread([s for r in runs for s in r["token_steps"]])
        walls = spread([s for r in runs for s in r["wall_s"]])
        lines.append(
            f"| {'CBF filter' if cbf else 'no filter'} ({len(runs)} runs) | {statistics.mean(frac):.1f} % ± "
            f"{statistics.pstdev(frac):.1f} | {min(frac):.1f} – {max(frac):.1f} % | "
            f"{sum(r['violations'] for r in runs)} ({', '.join(str(r['violations']) for r in runs)}) | "
            f"{sum(r['corrected'] for r in runs)} of {sum(r['commands'] for r in runs)} | "
            f"{steps['median']:g} / {steps['p95']:g} | {walls['median']:.2f} / {walls['p95']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--horizon", type=float, default=120.0)
    ap.add_argument("--speed", type=float, default=1.0, help="plant seconds per wall second")
    ap.add_argument("--period", type=float, default=10.0)
    ap.add_argument("--out", default="runs/plant")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model()
    rng = np.random.default_rng(2026)
    starts = [(float(rng.uniform(44, 56)), float(rng.uniform(0.0, 0.6))) for _ in range(args.runs)]
    rows, t0 = [], time.perf_counter()
    for i, (level, valve) in enumerate(starts):
        for cbf in (False, True):
            row = one_run(model, cbf=cbf, level=level, valve=valve, horizon=args.horizon, speed=args.speed,
                          period=args.period, seed=i, out=out, figure=i == 0)
            rows.append(row)
            print(f"run {i} {'cbf' if cbf else 'raw'}: level0 {level:.1f} valve0 {valve:.2f} → in band "
                  f"{100 * row['safe_fraction']:.1f} %, {row['violations']} violations, {row['decisions']} decisions, "
                  f"jumps {[(j['tool'], j['arguments']) for j in row['jumps']]}", flush=True)
            (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    report = table(rows)
    (out / "table.md").write_text(report + "\n")
    print(report)
    print(f"[{time.perf_counter() - t0:.0f} s]")


if __name__ == "__main__":
    main()
