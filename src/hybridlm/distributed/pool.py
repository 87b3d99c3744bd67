"""Pools that run jobs: one after another in this process, or as tasks of a Ray cluster."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridlm.errors import HybridLMError


@dataclass(frozen=True)
class Job:
    """fn(*args) on some worker; fn is a module-level function (Ray ships it by reference)."""

    fn: Callable[..., Any]
    args: tuple = ()


class LocalPool:
    """Jobs in this process, in order."""

    kind = "local"

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def run(self, jobs: Sequence[Job], on_result: Callable[[int, Any], None]) -> None:
        for i, job in enumerate(jobs):
            on_result(i, job.fn(*job.args))

    def describe(self) -> dict:
        return {"kind": self.kind, "device": self.device}


class RayPool:
    """Jobs as Ray tasks, spread over the nodes, results handed back as each finishes.

    A task whose worker process dies (killed, out of memory, its node lost) is run again, up
    to `max_retries` times, by Ray; an exception raised by the job itself is not retried
    (the jobs are deterministic: it would raise again) and ends the run, with hybridlm's
    own input errors re-raised as they are.
    """

    kind = "ray"

    def __init__(self, ray, *, device: str = "cpu", num_cpus: float = 1, max_retries: int = 3) -> None:
        self.ray, self.device = ray, device
        num_gpus = 1 if device.startswith("cuda") else 0  # a shard holds its model on one GPU
        self.options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=max_retries, retry_exceptions=False,
                            scheduling_strategy="SPREAD")
        self._remote: dict[Callable, Any] = {}

    def run(self, jobs: Sequence[Job], on_result: Callable[[int, Any], None]) -> None:
        ray = self.ray
        index = {self._task(job.fn).remote(*job.args): i for i, job in enumerate(jobs)}
        pending = list(index)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    on_result(index[ref], self._get(ref))
        finally:
            for ref in pending:  # an error or an interrupt: nothing is left running for us
                ray.cancel(ref, force=True)

    def _task(self, fn):
        if fn not in self._remote:
            self._remote[fn] = self.ray.remote(fn).options(**self.options)
        return self._remote[fn]

    def _get(self, ref):
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, HybridLMError):
                raise exc.cause from None
            raise

    def describe(self) -> dict:
        resources = self.ray.cluster_resources()
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        return {"kind": self.kind, "device": self.device, "nodes": len(nodes), "CPU": resources.get("CPU", 0),
                "GPU": resources.get("GPU", 0),
                "task": {k: self.options[k] for k in ("num_cpus", "num_gpus", "max_retries")}}
