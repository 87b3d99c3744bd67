"""Process memory settings that make repeated forward passes and recordings cheap.

A forward pass of 512 tokens allocates and frees hundreds of megabytes of activations, and a
recording of every activation keeps about a gigabyte alive until it is dropped. glibc hands
freed blocks above its mmap threshold, and the free top of its heap, back to the kernel; the
next pass then pays a page fault (and, under a hypervisor, often a host fault) for every page
again, which costs more than the arithmetic of the pass. `keep_freed_memory` raises the mmap
threshold to glibc's ceiling (32 MiB) and the trim threshold out of reach, so freed pages stay
in the process and are reused warm. The price: the resident size stays at its peak.

Importing hybridlm changes nothing in the host process: the command line and the benchmark
call `configure()` at their start (unless HYBRIDLM_KEEP_FREED_MEMORY=0), and a program that
embeds hybridlm may call it too. A server is the exception: it runs for hours while states of
every size come and go, and there keeping the peak means keeping a fragmented heap
(`configure(long_running=True)`, which `hybridlm serve` calls). It does nothing where the C
library has no `mallopt` (not glibc).
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest accepted mmap threshold on 64-bit
_TRIM_NEVER = 2**31 - 1
_MAP_FROM = 4 * 2**20  # a server's mmap threshold: KV states beyond ~90 positions; a step's logits stay on the heap


def keep_freed_memory() -> bool:
    """Keep freed heap memory in the process; True when the C library accepted it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER))


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim; nothing elsewhere).

    For one-time work that frees as much as it keeps (building a quantised model matrix by
    matrix): glibc raises its mmap threshold to the size of the blocks freed, so the next
    blocks come from the heap, where freed ones stay resident unless trimmed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


configured = False  # whether configure() ran in this process


def configure(*, long_running: bool = False) -> None:
    """Huge pages for large tensors and freed memory kept warm, for this process (opt-in).

    long_running: a process that serves requests for hours (`hybridlm serve`) leaves PyTorch's
    huge-page allocation off (its 2 MiB-aligned blocks, for KV states of every size coming and
    going, fragmented glibc's heap: a server's resident size grew 17 MB a request without end)
    and gives large blocks mappings of their own (`map_large_blocks`).
    """
    global configured
    if long_running:
        map_large_blocks()
        configured = True
        return
    # Large tensors (weights, KV states, recorded trajectories) on transparent huge pages:
    # fewer TLB misses while a decode step streams the weights, fewer page faults while a
    # recording allocates. PyTorch reads this at its first large allocation; 0 opts out.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if os.environ.get("HYBRIDLM_KEEP_FREED_MEMORY", "1") != "0":
        keep_freed_memory()
    configured = True


def map_large_blocks() -> bool:
    """Blocks of 4 MiB and more each in a mapping of its own, unmapped when freed (a fixed mmap
    threshold: glibc no longer raises it to the largest block freed). For a server: its
    sequences' KV states come and go in every size, and from the heap they left it fragmented
    at its peak. True when the C library accepted it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MAP_FROM))
