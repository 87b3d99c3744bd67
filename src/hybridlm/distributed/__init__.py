"""Sweeps and evaluations beyond one machine: shards of prompts and tasks as Ray tasks.

A consensus run is a set of independent prompts and an evaluation a set of independent
tasks, so both split into shards whose results join, in order, into exactly what one
process computes (`hybridlm.analysis.runner`, `hybridlm.agent.evaluation`). A shard runs
in this process (`LocalPool`) or as a task of a Ray cluster (`RayPool`): Ray places the
tasks on the nodes, retries a shard whose worker died, and moves the results back; each
worker loads a model once and keeps it for the shards that follow (`worker.cached`).
Finished shards are saved in the output folder as they arrive, so an interrupted run
started again does only the shards it is missing.

Ray is an optional extra (`pip install 'hybridlm[ray]'`) and is imported only when a
command is given `--ray` or `--ray-address`.
"""

from hybridlm.distributed.cluster import local_cluster, open_pool
from hybridlm.distributed.consensus import ShardedConsensus, run_consensus_sharded
from hybridlm.distributed.evaluation import evaluate_sharded
from hybridlm.distributed.pool import Job, LocalPool, RayPool
from hybridlm.distributed.shards import map_shards, split
from hybridlm.distributed.sweep import Sweep, load_sweep, run_sweep
from hybridlm.distributed.worker import cached, worker_model

__all__ = [
    "Job", "LocalPool", "RayPool", "ShardedConsensus", "Sweep", "cached", "evaluate_sharded", "load_sweep", "local_cluster",
    "map_shards", "open_pool", "run_consensus_sharded", "run_sweep", "split", "worker_model",
]
