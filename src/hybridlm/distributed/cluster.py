"""Opening a pool: this process, a local Ray instance (started or joined), or a Ray cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TypedDict

from hybridlm.distributed.pool import LocalPool, RayPool
from hybridlm.errors import InputError

INSTALL_HINT = "Ray is not installed: pip install 'hybridlm[ray]'"


def import_ray():
    try:
        import ray
    except ImportError:
        raise InputError(f"--ray needs Ray. {INSTALL_HINT}") from None
    return ray


@contextlib.contextmanager
def open_pool(use_ray: bool = False, address: str | None = None, *, device: str = "cpu",
              max_retries: int = 3) -> Iterator[LocalPool | RayPool]:
    """The pool the options ask for, its `device` resolved ("auto": cuda where the workers
    have a GPU). Without `use_ray` and `address`, a `LocalPool` (Ray is not imported). With
    `use_ray`, `ray.init()`: it joins the Ray instance running on this machine (RAY_ADDRESS,
    or the last one `ray start` began) or starts one; with `address`, it joins that cluster.
    A Ray instance started here is shut down on the way out, one joined is left running."""
    if not use_ray and address is None:
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        yield LocalPool(device)
        return
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, include_dashboard=False, logging_level="WARNING")
        except ConnectionError as exc:
            raise InputError(f"--ray-address {address}: no Ray cluster answers there ({exc})") from None
    try:
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        yield RayPool(ray, device=device, max_retries=max_retries)
    finally:
        if started:
            ray.shutdown()


class _NodeArgs(TypedDict):
    """The arguments of each node of `local_cluster` (Ray's `Cluster.add_node`)."""

    node_ip_address: str
    include_dashboard: bool
    num_cpus: int
    object_store_memory: int


@contextlib.contextmanager
def local_cluster(nodes: int = 2, *, cpus_per_node: int = 1, object_store_mb: int = 80) -> Iterator[object]:
    """A Ray cluster of `nodes` nodes on this machine, every process listening on 127.0.0.1,
    its session in a private temporary folder; this process is connected to it, and all is
    shut down and removed on the way out, on error too. Yields Ray's `Cluster` (its nodes'
    processes are in `head_node` and `worker_nodes`).

    For tests and measurements of a multi-node run on one machine. It must come before
    anything else imports Ray: Ray reads its local-only switch when it is imported.
    """
    tmp = tempfile.mkdtemp(prefix="hlray")  # short: Ray's socket paths must stay under 108 bytes
    env = {"RAY_TMPDIR": tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    saved = {k: os.environ.get(k) for k in env}
    # RAY_TMPDIR keeps the session, and the "current cluster" file that `ray.init()` joins,
    # private; the second is Ray's switch for local-only mode, in which every Ray process
    # listens on 127.0.0.1 and a driver reaches them there.
    os.environ.update(env)
    cluster = None
    try:
        ray = import_ray()
        from ray._private import services
        from ray.cluster_utils import Cluster

        if services.get_node_ip_address() != "127.0.0.1":
            raise RuntimeError("local_cluster: Ray was imported before; start the cluster before anything imports Ray")
        node = _NodeArgs(node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus_per_node,
                         object_store_memory=object_store_mb * 2**20)
        cluster = Cluster(initialize_head=True, head_node_args=dict(node))
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
