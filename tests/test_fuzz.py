"""A bounded smoke run of every atheris harness in fuzz/ (the long runs are in docs/robustness.md).

Each harness runs in a subprocess on a copy of its seed corpus for HYBRIDLM_FUZZ_SECONDS
(default 15: nine harnesses, and the suite keeps within its 30 minutes) with libFuzzer's own
limits: 5 s per input (a hang is a failure) and 1 GB of memory above the test process's own
peak; any uncaught exception ends the run with a non-zero exit code and the input.
"""

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parents[1] / "fuzz"
HARNESSES = ["gguf_reader", "gguf_vocab", "tokenizer_folder", "hub_reader", "trace_reader", "calculator",
             "knowledge_base", "call_parser", "server_request"]


@pytest.mark.fuzz
@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_smoke_run(harness, tmp_path):
    import atheris  # noqa: F401 - the fuzz extra is part of the test extra: missing it is a failure

    seconds = int(os.environ.get("HYBRIDLM_FUZZ_SECONDS", "15"))
    corpus = tmp_path / "corpus"
    shutil.copytree(FUZZ / "corpus" / harness, corpus)
    # Linux carries a process's peak RSS across fork and exec, and libFuzzer reads that peak: a
    # harness started from a test process that loaded models would start "over" a fixed limit.
    # The 1 GB budget is therefore counted above this process's own peak.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    cmd = [sys.executable, str(FUZZ / f"{harness}.py"), str(corpus), f"-max_total_time={seconds}", "-timeout=5",
           f"-rss_limit_mb={inherited_mb + 1024}", "-max_len=16384", f"-artifact_prefix={tmp_path}/"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Done" in p.stderr and not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
