"""The speed benchmark of `hybridlm bench`, runnable as a script with the same options.

    python benchmarks/bench.py [--threads 2] [--repeats 3] [--out bench.json]
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hybridlm.cli import cli

if __name__ == "__main__":
    sys.exit(cli(["bench", *sys.argv[1:]]))
