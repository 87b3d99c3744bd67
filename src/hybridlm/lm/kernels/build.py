"""The build of the compiled kernels: the C sources of this folder compiled once per machine with
the system's C compiler into one shared library, cached, and loaded with ctypes.

Build. On first use `cc` compiles the sources side by side (a few seconds) into `$HYBRIDLM_CACHE/kernels`
(default `~/.cache/hybridlm/kernels`), under a name that hashes the sources, the flags and the
runtime, so a changed source or another machine's CPU gets its own build. AVX2, FMA and F16C are
used where /proc/cpuinfo lists them; elsewhere the same sums run as plain C loops. AVX-512F is
added where the CPU has it (`HYBRIDLM_AVX512=off` leaves it out); `blockquant.c` also takes
AVX-512BW, VL and VNNI where the CPU has all of them (its 16-bit multiply-adds, on the same
integers: the bits do not change). Where no compiler is found or the build fails, `load` raises
`Unavailable` with the reason, and every caller keeps its PyTorch path. `HYBRIDLM_KERNELS=off`
chooses the PyTorch paths outright.

Threads. The library is linked against the OpenMP runtime that PyTorch loaded (found in the
process's memory map), so its parallel loops run on PyTorch's own intra-op pool and
`torch.set_num_threads` governs them. A second OpenMP runtime would keep a second pool of
spinning workers fighting PyTorch's for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from hybridlm.cache import cache_root
from hybridlm.errors import InputError
from hybridlm.lm.cpu import cpuinfo

SOURCES = ("affine.c", "int4.c", "attention.c", "layer.c", "blockquant.c")  # in the folder of this module
HEADERS = ("simd.h", "kernels.h")  # what they include (part of the build's digest)

T = TypeVar("T")


class Unavailable(Exception):
    """The library cannot be used here (the message says why)."""


def load(bind: Callable[[ctypes.CDLL, Path], T]) -> T:
    """bind(the library, where it lies), the library built first where the cache does not hold
    this build, and built again once where the cached file cannot be loaded or bound."""
    choice = os.environ.get("HYBRIDLM_KERNELS", "auto").lower()
    if choice not in ("auto", "off"):
        raise InputError(f"HYBRIDLM_KERNELS={choice!r}: expected auto or off")
    if choice == "off":
        raise Unavailable("HYBRIDLM_KERNELS=off")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise Unavailable("no C compiler found")
    runtime = torch_openmp()
    flags = ["-O3", "-fPIC", "-std=c11", "-ffp-contract=off"] + cpu_flags() + (["-fopenmp"] if runtime else [])
    sources = [folder() / name for name in SOURCES]
    extra = {src: source_flags(src.name) for src in sources}
    texts = [path.read_bytes() for path in [*sources, *(folder() / name for name in HEADERS)]]
    described = " ".join(flags) + "|" + " ".join(f"{src.name}:{' '.join(f)}" for src, f in extra.items())
    digest = hashlib.sha256(b"\0".join([*texts, described.encode(),
                                        str(runtime).encode(), compiler.encode()])).hexdigest()[:16]
    target = cache_root() / "kernels" / f"hybridlm-{digest}.so"
    if not target.exists():
        _build(compiler, flags, extra, runtime, sources, target)
    try:
        return bind(ctypes.CDLL(str(target)), target)
    except (OSError, AttributeError):  # a damaged cache file: built again, once
        _build(compiler, flags, extra, runtime, sources, target)
    try:
        return bind(ctypes.CDLL(str(target)), target)
    except (OSError, AttributeError) as exc:
        raise Unavailable(f"could not load {target}: {exc}") from None


def folder() -> Path:
    return Path(__file__).parent


def _build(compiler: str, flags: list[str], extra: dict, runtime: Path | None, sources: list[Path],
           target: Path) -> None:
    """Compile and link into `target` atomically (a temporary file, then a rename)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects = [Path(tmp) / f"{src.stem}.o" for src in sources]
            lib = Path(tmp) / "hybridlm.so"
            # Linked with the runtime file itself (not -fopenmp, which would add the system's
            # libgomp): the library then needs the runtime PyTorch has already loaded.
            link = [str(runtime), f"-Wl,-rpath,{runtime.parent}"] if runtime else []
            compiles = [[compiler, *flags, *extra.get(src, []), "-c", str(src), "-o", str(obj)]
                        for src, obj in zip(sources, objects)]
            running = [(cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                       for cmd in compiles]  # side by side: the sources compile independently
            failed: list[str | None] = [why for why in (_finished(cmd, proc) for cmd, proc in running) if why]  # (all waited for)
            link_cmd = [compiler, "-shared", *map(str, objects), "-o", str(lib), *link, "-lm"]
            failed = failed or [_finished(link_cmd, subprocess.Popen(link_cmd, stdout=subprocess.DEVNULL,
                                                                     stderr=subprocess.PIPE, text=True))]
            if failed[0]:
                raise Unavailable(f"build failed: {failed[0]}")
            os.replace(lib, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"build failed: {exc}") from None


def _finished(cmd: list[str], proc: subprocess.Popen) -> str | None:
    """Wait for one step of the build: None, or why it failed (with its command)."""
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"{' '.join(cmd)}: no result in 300 s"
    return f"{' '.join(cmd)}: {err.strip()[-400:]}" if proc.returncode else None


def torch_openmp() -> Path | None:
    """The OpenMP runtime file that PyTorch mapped into this process, if any (Linux)."""
    torch.get_num_threads()  # PyTorch's runtime is mapped once its thread pool is asked about
    try:
        with open("/proc/self/maps") as fh:
            mapped = {Path(line.split()[-1]) for line in fh if "/" in line}
    except OSError:
        return None
    home = Path(torch.__file__).resolve().parent.parent  # site-packages: torch/lib, torch.libs
    runtimes = sorted(p for p in mapped if p.name.startswith(("libgomp", "libiomp5", "libomp")) and p.exists())
    for p in runtimes:  # PyTorch's own first, should another library have mapped a second one
        if home in p.resolve().parents:
            return p
    return runtimes[0] if runtimes else None


def cpu_flags() -> list[str]:
    """The vector extensions every source is built with."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    have = _cpu_features()
    if not {"avx2", "fma", "f16c"} <= have:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] + (["-mavx512f"] if "avx512f" in have and avx512_wanted() else [])


def source_flags(name: str) -> list[str]:
    """Extensions one source takes beyond `cpu_flags`: blockquant.c's AVX-512 integer instructions
    (byte and word masks, 256-bit forms, the fused 16-bit multiply-add)."""
    wanted = {"avx512bw", "avx512vl", "avx512_vnni"}
    if name != "blockquant.c" or "-mavx512f" not in cpu_flags() or not wanted <= _cpu_features():
        return []
    return ["-mavx512bw", "-mavx512vl", "-mavx512vnni"]


def _cpu_features() -> set[str]:
    return set((cpuinfo("flags") or "").split())


def avx512_wanted() -> bool:
    """AVX-512 vectors in the kernels (the same bits as AVX2: each output's arithmetic in the same
    order); HYBRIDLM_AVX512=off leaves them out."""
    return os.environ.get("HYBRIDLM_AVX512", "on").lower() not in ("0", "off", "no", "false")
