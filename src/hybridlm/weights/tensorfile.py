"""safetensors files read with their headers checked first, and one tensor at a time.

Shared by the Hugging Face folder reader (`weights/hub.py`) and the float32 cache of GGUF files
(`weights/gguf.py`): a bad header is one `WeightsError` line naming the tensor and the field, and a
model is copied out tensor by tensor rather than mapped whole.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import math
import os
from pathlib import Path
import struct
from typing import TypeGuard

import torch

from hybridlm.errors import WeightsError

MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit on the JSON header


#: safetensors dtypes → bytes per element.
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _naturals(value: object) -> TypeGuard[list[int]]:
    """A JSON list of integers ≥ 0 (a shape, or data offsets)."""
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)


def check_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file, every length and extent checked against the file.

    Layout: u64 N · N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}
    · the data, offsets counted from its start. The safetensors library checks much of this
    too; checking it here first gives one error that names the tensor and the field.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path}: {size} bytes, too short for a safetensors header; is it truncated or corrupt?")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise WeightsError(f"{path}: the header claims {n:,} bytes, the file has {size - 8:,} after the length "
                               f"(limit {MAX_SAFETENSORS_HEADER:,}); is it truncated or corrupt?")
        raw = fh.read(n)
    try:
        table = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        reason = exc.__class__.__name__ if isinstance(exc, RecursionError) else exc
        raise WeightsError(f"{path}: the header is not a JSON object ({reason}); is it truncated or corrupt?") from None
    if not isinstance(table, dict):
        raise WeightsError(f"{path}: the header is a JSON {type(table).__name__}, expected an object")
    data = size - 8 - n
    table.pop("__metadata__", None)
    for name, entry in table.items():
        where = f"{path}: tensor {name[:80]!r}"
        if not isinstance(entry, dict):
            raise WeightsError(f"{where}: expected {{dtype, shape, data_offsets}}, got a {type(entry).__name__}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise WeightsError(f"{where}: dtype {str(dtype)[:20]!r} is not one of {sorted(SAFETENSORS_DTYPES)}")
        if not _naturals(shape) or len(shape) > 8:
            raise WeightsError(f"{where}: shape {str(shape)[:40]} is not a list of at most 8 integers ≥ 0")
        if not _naturals(offsets) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= data:
            raise WeightsError(f"{where}: data_offsets {str(offsets)[:60]} do not lie within the {data:,} bytes of data; "
                               "is the file truncated or corrupt?")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[dtype]:
            raise WeightsError(f"{where}: data_offsets span {offsets[1] - offsets[0]:,} bytes, shape {shape} of "
                               f"{dtype} needs {math.prod(shape) * SAFETENSORS_DTYPES[dtype]:,}")
    return table



class LazyWeights(Mapping):
    """The tensors of a safetensors file, each read from the file when asked (its shape without
    reading). Read, not mapped: a mapped file's pages count in the process's resident memory
    until it is closed, so copying a whole model out of a mapping costs the model twice."""

    _DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
               "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
               "F64": torch.float64}

    def __init__(self, path: Path) -> None:
        self.table = check_safetensors_header(path)
        self._fh = open(path, "rb")
        self.start = 8 + int.from_bytes(self._fh.read(8), "little")

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.table[name]
        begin, end = entry["data_offsets"]
        buffer = bytearray(end - begin)
        view = memoryview(buffer)
        done = 0
        while done < len(buffer):
            got = os.preadv(self._fh.fileno(), [view[done:]], self.start + begin + done)
            if got <= 0:
                raise ValueError(f"{name}: the file ends inside the tensor")
            done += got
        dtype = self._DTYPES[entry["dtype"]]
        if not buffer:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).view(entry["shape"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.table[name]["shape"])

    def __iter__(self):
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def __enter__(self) -> "LazyWeights":
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


