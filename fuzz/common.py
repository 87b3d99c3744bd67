"""What every harness shares: a scratch file per process, and atheris's entry point."""

import os
import sys
import tempfile

import atheris

SCRATCH = tempfile.mkdtemp(prefix="hybridlm-fuzz-")


def scratch(name: str, data: bytes) -> str:
    """Write `data` to a file of that name in this process's scratch folder; return its path."""
    path = os.path.join(SCRATCH, name)
    with open(path, "wb") as fh:
        fh.write(data)
    return path


def run(test_one_input) -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
