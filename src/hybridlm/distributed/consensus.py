"""A consensus run split into shards of prompts: the same folder, to the last digit.

Prompt i of a run depends on (seed, i) alone and its E on that prompt alone
(`hybridlm.analysis.runner`), so shards of prompts run anywhere, in any order, and their E
join into the rows one process writes. A finished shard is kept under `shards/` in the
run's folder as it arrives (E per prompt and layer-step, and the states after the last
pass); when all are in, the run's `consensus.csv`, `checkpoint.safetensors`,
`summary.json` and `consensus.png` are written as a local run writes them, and `shards/`
is removed. A folder left by a local run continues here and the other way round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hybridlm.analysis.runner import (
    ConsensusConfig, ShardResult, checkpoint_info, consensus_shard, finish, load_checkpoint, merge_rows,
    prepare_model, read_rows, save_checkpoint, write_rows,
)
from hybridlm.distributed.pool import Job
from hybridlm.distributed.shards import ShardStore, split
from hybridlm.distributed.worker import cached
from hybridlm.errors import InputError

SUFFIX = ".safetensors"


def shard_task(cfg: ConsensusConfig, start: int, stop: int, h: torch.Tensor | None, start_pass: int,
               device: str) -> ShardResult:
    """One shard on a worker, with the run's model loaded once per worker. The blocks of a
    random-redrawn run are drawn again before every pass, so a kept model serves any run
    of the same model, weights mode and seed."""
    t0 = time.perf_counter()
    seed = None if cfg.weights == "pretrained" else cfg.seed
    model = cached(("consensus", cfg.model, cfg.weights, seed, device, cfg.block), lambda: prepare_model(cfg, device))
    t1 = time.perf_counter()
    result = consensus_shard(cfg, model, start, stop, h=h, start_pass=start_pass)
    result.ran = {"node": _node_id(), "pid": os.getpid(), "load_s": round(t1 - t0, 4),
                  "compute_s": round(time.perf_counter() - t1, 4)}
    return result


def _node_id() -> str:
    """The Ray node the shard ran on ("local" outside Ray)."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else "local"


class ShardedConsensus:
    """One run in `out`: the shards still to do (`jobs`), each result as it arrives (`add`),
    and the run's files once all are in (`finish`)."""

    def __init__(self, cfg: ConsensusConfig, out: str | Path, *, shard_prompts: int, device: str = "cpu") -> None:
        self.cfg, self.out, self.device = cfg, Path(out), device
        self.out.mkdir(parents=True, exist_ok=True)
        saved = load_checkpoint(cfg, self.out)  # another run in this folder is an error
        self.h: torch.Tensor | None  # the states the saved passes left (None: start afresh)
        self.h, self.done = saved if saved is not None else (None, 0)
        self.start_pass = self.done + 1
        self.spans = split(cfg.prompts, shard_prompts) if self.start_pass <= cfg.passes else []
        self.store = ShardStore(self.out / "shards")
        self.results: dict[tuple[int, int], ShardResult] = {}
        for span in self.spans:
            result = self._load(span)
            if result is not None:
                self.results[span] = result

    @property
    def complete(self) -> bool:
        return all(span in self.results for span in self.spans)

    def jobs(self) -> list[Job]:
        return [Job(shard_task, (self.cfg, a, b, None if self.h is None else self.h[a:b].clone(), self.start_pass,
                                 self.device))
                for a, b in self.spans if (a, b) not in self.results]

    def add(self, result: ShardResult) -> None:
        span = (result.start, result.stop)
        self.store.write(*span, SUFFIX, lambda path: _save(path, self.cfg, self.start_pass, result))
        self.results[span] = result

    def shards(self) -> list[dict]:
        """Where each shard of this stretch of passes ran and how long it took."""
        return [{"start": a, "stop": b, **self.results[(a, b)].ran} for a, b in self.spans if (a, b) in self.results]

    def finish(self) -> dict:
        if not self.complete:
            raise RuntimeError(f"{self.out}: {len(self.spans) - len(self.results)} shards are missing")
        if self.spans:
            results = [self.results[span] for span in self.spans]
            rows = [r for r in read_rows(self.out) if int(r["pass"]) <= self.done] if self.done else []
            write_rows(self.out, rows + merge_rows(results), fresh=True)
            info = results[0].info
            save_checkpoint(self.out, self.cfg, torch.cat([r.h for r in results]), self.cfg.passes, info)
        else:  # finished before: the files are rewritten from the folder, as a local run does
            info = checkpoint_info(self.out) or _summary_info(self.out)
        summary = finish(self.cfg, self.out, info, self.device)
        self.store.clear()
        return summary

    def _load(self, span: tuple[int, int]) -> ShardResult | None:
        """A kept shard of this run and stretch of passes; one of the same run but another
        stretch (the run was asked for another number of passes) is done again."""
        from safetensors import safe_open

        path = self.store.path(*span, SUFFIX)
        if not path.exists():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            saved = json.loads(meta["config"])
            if not self.cfg.same_run(saved):
                raise InputError(f"{self.out} holds shards of a run with another configuration ({meta['config']}); "
                                 "use another --out")
            if saved != asdict(self.cfg) or int(meta["start_pass"]) != self.start_pass:
                return None
            return ShardResult(span[0], span[1], [tuple(s) for s in json.loads(meta["steps"])], f.get_tensor("E"),
                               f.get_tensor("h"), json.loads(meta["info"]), {**json.loads(meta["ran"]), "kept": True})


def _save(path: Path, cfg: ConsensusConfig, start_pass: int, result: ShardResult) -> None:
    from safetensors.torch import save_file

    save_file({"E": result.E.contiguous(), "h": result.h.contiguous()}, str(path),
              metadata={"config": json.dumps(asdict(cfg)), "start_pass": str(start_pass),
                        "steps": json.dumps(result.steps), "info": json.dumps(result.info),
                        "ran": json.dumps(result.ran)})


def _summary_info(out: Path) -> dict:
    path = out / "summary.json"
    if not path.exists():
        raise InputError(f"{out}: the checkpoint names no model and there is no summary.json; "
                         "continue the run to more passes, or run it again in another folder")
    summary = json.loads(path.read_text())
    return {"model_source": summary["model_source"], "shape": summary["shape"]}


def run_many(runs: list[ShardedConsensus], pool, *, on_finish=None, on_shard=None) -> list[dict]:
    """All shards of all runs on one pool at once; each run is written as its last shard
    arrives. `on_shard(run, result, done, total)` and `on_finish(run, summary)` report progress."""
    owner, jobs = [], []
    for run in runs:
        for job in run.jobs():
            owner.append(run)
            jobs.append(job)
    summaries: dict[int, dict] = {}

    def finish_run(i: int) -> None:
        summaries[i] = runs[i].finish()
        if on_finish is not None:
            on_finish(runs[i], summaries[i])

    for i, run in enumerate(runs):
        if run.complete:  # nothing left to compute (kept shards, or finished before)
            finish_run(i)

    arrivals = [0]

    def arrived(j: int, result: ShardResult) -> None:
        run = owner[j]
        run.add(result)
        arrivals[0] += 1
        if on_shard is not None:
            on_shard(run, result, arrivals[0], len(jobs))
        if run.complete:
            finish_run(runs.index(run))

    pool.run(jobs, arrived)
    return [summaries[i] for i in range(len(runs))]


def run_consensus_sharded(cfg: ConsensusConfig, out: str | Path, *, pool, shard_prompts: int, on_shard=None) -> dict:
    """`run_consensus` with the prompts in shards of `shard_prompts` run on `pool`."""
    run = ShardedConsensus(cfg, out, shard_prompts=shard_prompts, device=pool.device)
    return run_many([run], pool, on_shard=on_shard)[0]
