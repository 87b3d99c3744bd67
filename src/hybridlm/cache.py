"""Files hybridlm keeps between runs (the float32 cache of GGUF weights, compiled kernels), and
how they are written: under `$HYBRIDLM_CACHE` (default `~/.cache/hybridlm`), atomically, so a
killed process never leaves a half-written file where a reader would take it as whole.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDLM_CACHE") or Path.home() / ".cache" / "hybridlm")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Let `write` fill a temporary file beside `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
