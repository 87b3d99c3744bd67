"""A bounded smoke run of every atheris harness in fuzz/ (the long runs are in docs/robustness.md).

Each harness runs in a subprocess on a copy of its seed corpus for HYBRIDLM_FUZZ_SECONDS
(default 15) with libFuzzer's own limits: 5 s per input (a hang is a failure) and 1 GB of memory
above the test process's own peak; any uncaught exception ends the run with a non-zero exit code
and the input. The nine runs go three at a time, which takes about a third of the suite's time
they took one after the other; on two cores each run then makes about two thirds of the
executions it makes alone, in the same seconds and with the same 5 s per input.
"""

import base64
import os
import resource
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

FUZZ = Path(__file__).parents[1] / "fuzz"
HARNESSES = ["gguf_reader", "gguf_vocab", "tokenizer_folder", "hub_reader", "trace_reader", "calculator",
             "knowledge_base", "call_parser", "server_request"]
AT_ONCE = 3


def smoke_run(harness: str, folder: Path, seconds: int, inherited_mb: int) -> subprocess.CompletedProcess:
    corpus = folder / "corpus"
    shutil.copytree(FUZZ / "corpus" / harness, corpus)
    cmd = [sys.executable, str(FUZZ / f"{harness}.py"), str(corpus), f"-max_total_time={seconds}", "-timeout=5",
           f"-rss_limit_mb={inherited_mb + 1024}", "-max_len=16384", f"-artifact_prefix={folder}/"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300, cwd=folder)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The run of every harness this session selected, started at once on a pool of AT_ONCE: harness →
    (its folder, its future). (`-k gguf_reader` runs that harness alone, not all nine.)"""
    import atheris  # noqa: F401 - the fuzz extra is part of the test extra: missing it is a failure

    seconds = int(os.environ.get("HYBRIDLM_FUZZ_SECONDS", "15"))
    # Linux carries a process's peak RSS across fork and exec, and libFuzzer reads that peak: a
    # harness started from a test process that loaded models would start "over" a fixed limit.
    # The 1 GB budget is therefore counted above this process's own peak.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        started: dict[str, tuple[Path, Future]] = {}
        for harness in selected(request.session.items):
            folder = tmp_path_factory.mktemp(harness)
            started[harness] = folder, pool.submit(smoke_run, harness, folder, seconds, inherited_mb)
        yield started


def selected(items) -> list[str]:
    """The harnesses of the collected tests of this file (after -k, -m and deselection)."""
    return [item.callspec.params["harness"] for item in items
            if item.originalname == "test_harness_smoke_run" and Path(item.path) == Path(__file__)]


@pytest.mark.fuzz
@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_smoke_run(harness, runs):
    folder, future = runs[harness]
    p = future.result()
    found = sorted(folder.glob("crash-*")) + sorted(folder.glob("timeout-*"))
    # atheris prints an uncaught exception's traceback on stdout, libFuzzer its own report on stderr; the
    # input itself goes into the report too, so that a failure on another machine can be replayed here
    # (`python fuzz/<harness>.py FILE`).
    report = "\n".join([p.stdout[-4000:], p.stderr[-2000:],
                        *(f"{f.name} (base64): {base64.b64encode(f.read_bytes()[:8192]).decode()}" for f in found)])
    assert p.returncode == 0 and not found, report
    assert "Done" in p.stderr
