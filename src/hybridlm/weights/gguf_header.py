"""The header of a GGUF file, read with every count and length bounded by the file itself.

The layout (ggml's GGUF specification, versions 2 and 3, little-endian):

    magic "GGUF" · version u32 · tensor_count u64 · kv_count u64
    kv_count ×     key: string · value type u32 · value
    tensor_count × name: string · n_dims u32 · n_dims × u64 (ne₀ first) · ggml type u32 · offset u64
    padding to `general.alignment` (32 unless given), then the tensor data

    string = u64 length · UTF-8 bytes;   array = element type u32 · count u64 · elements

The `gguf` package's reader trusts these counts: a 4 KB file whose array claims 2⁵⁶
elements keeps it iterating and allocating for minutes. Here every count is multiplied by
the least number of bytes one item can take and compared with the bytes left before a
single item is read, so a header is read in time and memory linear in the file's size.
Tensor extents are computed from the ggml type's block size and checked against the file
before any tensor is touched; the tensor data are then numpy views of a read-only map.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from hybridlm.errors import WeightsError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays: no key hybridlm reads has them, but a file may

#: value type → (struct format, size) of the fixed-size scalars.
SCALARS = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1), GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2), GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1), GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8), GGUFValueType.FLOAT64: ("<d", 8),
}
#: the least bytes one element of each type occupies (a string: its u64 length; an array: type and count).
MIN_SIZE = {**{k: size for k, (_, size) in SCALARS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: ggml's ne reversed, [rows, columns]
    data_offset: int  # absolute, in the file
    n_bytes: int
    _file: "Header" = field(repr=False, compare=False)

    def data(self) -> np.ndarray:
        """The stored bytes as a read-only uint8 view, one row of blocks per row of the tensor."""
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        flat = np.frombuffer(self._file.map, dtype=np.uint8, count=self.n_bytes, offset=self.data_offset)
        return flat.reshape(rows, -1) if rows else flat.reshape(0, 0)


@dataclass(frozen=True)
class Unread:
    """An array of the vocabulary that `read_header(vocabulary=False)` walked (every length bounded by
    the file) but did not read: only its element type and count are kept, for readers of the
    weights alone, which need the vocabulary's size and not its 10⁵ strings."""

    item: GGUFValueType
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass
class Header:
    path: Path
    size: int
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    map: Any = field(repr=False)


class _Cursor:
    """Reads little-endian values from the map; asks for no byte past the end of the file."""

    def __init__(self, buf, size: int, origin: str) -> None:
        self.buf, self.size, self.origin, self.at = buf, size, origin, 0

    def fail(self, what: str) -> WeightsError:
        return WeightsError(f"{self.origin}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise self.fail(
                f"truncated or corrupt header: {what} at byte {self.at:,} needs {n:,} bytes, "
                f"{self.size - self.at:,} are left in the file"
            )

    def scalar(self, kind: GGUFValueType, what: str):
        fmt, size = SCALARS[kind]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n:,} bytes)")
        raw = self.buf[self.at:self.at + n]
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def count(self, n: int, each: int, what: str) -> int:
        """n items of at least `each` bytes must fit in what is left."""
        if n * each > self.size - self.at:
            raise self.fail(
                f"truncated or corrupt header: {what} claims {n:,} items of at least {each} bytes at byte "
                f"{self.at:,}, but only {self.size - self.at:,} bytes are left in the file"
            )
        return n

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"the type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has value type {raw}, which GGUF does not define") from None

    def skip_array(self, what: str) -> Unread:
        """An array walked, not read: its strings' lengths are bounded as `value` bounds them."""
        item = self.value_type(f"the elements of {what}")
        n = self.count(self.u64(f"the element count of {what}"), MIN_SIZE[item], what)
        if item in SCALARS:
            self.need(n * SCALARS[item][1], what)
            self.at += n * SCALARS[item][1]
        elif item == GGUFValueType.STRING:
            for i in range(n):
                length = self.u64(f"the length of {what}[{i}]")
                self.need(length, f"{what}[{i}] ({length:,} bytes)")
                self.at += length
        else:  # arrays of arrays, which `value` reads without keeping them
            for i in range(n):
                self.value(item, f"{what}[{i}]", 1)
        return Unread(item, n)

    def value(self, kind: GGUFValueType, what: str, depth: int = 0) -> Any:
        if kind in SCALARS:
            return self.scalar(kind, what)
        if kind == GGUFValueType.STRING:
            return self.string(what)
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item = self.value_type(f"the elements of {what}")
        n = self.count(self.u64(f"the element count of {what}"), MIN_SIZE[item], what)
        if item in SCALARS and item != GGUFValueType.BOOL:
            fmt, size = SCALARS[item]
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.at).tolist()
            self.at += n * size
            return values
        values = [self.value(item, f"{what}[{i}]", depth + 1) for i in range(n)]
        return None if item == GGUFValueType.ARRAY else values  # nested arrays: skipped, as hybridlm reads none


MISSING = object()  # "no default": a missing key is an error

#: what each kind of metadata value `meta_value` accepts
_KINDS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "str list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "int list": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "number list": lambda v: isinstance(v, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v),
}


def meta_value(meta: dict[str, Any], key: str, kind: str, default: Any = MISSING) -> Any:
    """meta[key] checked to be of `kind`: "int" (not bool), "number" (finite), "bool", "str", "str list",
    "int list", "number list" (finite); `default` when the key is absent, an error naming it if none is given."""
    value = meta.get(key, default)
    if value is MISSING:
        raise WeightsError(f"metadata key '{key}' is missing")
    if value is default:
        return value
    if not _KINDS[kind](value):
        shown = repr(value) if len(repr(value)) < 60 else f"a {type(value).__name__}"
        raise WeightsError(f"metadata key '{key}' is {shown}: expected {'an' if kind == 'int' else 'a'} {kind}")
    return value


def read_header(path: str | os.PathLike, *, vocabulary: bool = True) -> Header:
    """Metadata and tensor table of a GGUF file; a WeightsError naming the first bound a field breaks.

    `vocabulary=False`: the arrays of `tokenizer.ggml.*` (tokens, scores, types, merges) are walked
    but kept only as `Unread` (their count), for a reader of the weights or the tensor table alone:
    a 262 144-token vocabulary read as Python strings costs some 40 MB of resident memory."""
    path = Path(path)
    origin = path.name
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{origin}: cannot read the file ({exc})") from None
    if size < 24 or buf[:4] != MAGIC:
        raise WeightsError(f"{origin} ({size:,} bytes) is not a readable GGUF file: truncated or corrupt "
                           f"(it does not start with the GGUF magic and a header)")
    cur = _Cursor(buf, size, origin)
    cur.at = 4
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise WeightsError(f"{origin} is a big-endian GGUF file; hybridlm reads little-endian files only")
    if version not in VERSIONS:
        raise WeightsError(f"{origin}: GGUF version {version}; hybridlm reads versions {VERSIONS}")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    cur.count(n_kv, 8 + 4 + 1, "the metadata table")  # key length, value type, a 1-byte value at least
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        value_type = cur.value_type(f"metadata {key!r}")
        skip = not vocabulary and value_type == GGUFValueType.ARRAY and key.startswith("tokenizer.ggml.")
        metadata[key] = cur.skip_array(f"metadata {key!r}") if skip else cur.value(value_type, f"metadata {key!r}")
    cur.count(n_tensors, 8 + 4 + 4 + 8, "the tensor table")  # name length, n_dims, type, offset
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment={alignment!r}: expected a power of two")
    table = [_tensor_entry(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.at // alignment) * alignment
    header = Header(path, size, version, metadata, [], alignment, data_start, buf)
    names: set[str] = set()
    for name, dims, kind, offset in table:
        if name in names:
            raise cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        header.tensors.append(_tensor(header, name, dims, kind, offset, origin))
    return header


def _tensor_entry(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"the name of tensor #{i}")
    n_dims = cur.u32(f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
    dims = tuple(cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
    kind = cur.u32(f"the type of tensor {name!r}")
    offset = cur.u64(f"the data offset of tensor {name!r}")
    return name, dims, kind, offset


def _tensor(header: Header, name: str, dims: tuple[int, ...], raw_kind: int, offset: int, origin: str) -> TensorInfo:
    try:
        kind = GGMLQuantizationType(raw_kind)
        block, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise WeightsError(f"{origin}: tensor {name!r} has ggml type {raw_kind}, which GGUF does not define") from None
    if 0 in dims:
        raise WeightsError(f"{origin}: tensor {name!r} has shape {list(reversed(dims))}: a dimension of 0 holds no weights")
    if dims[0] % block:
        raise WeightsError(f"{origin}: tensor {name!r}: its rows of {dims[0]} are not whole {kind.name} blocks of {block}")
    n_bytes = math.prod(dims) // block * block_bytes  # exact integers: no overflow to hide an extent
    if offset % header.alignment:
        raise WeightsError(f"{origin}: tensor {name!r} starts at offset {offset}, not a multiple of the alignment "
                           f"{header.alignment}")
    start = header.data_start + offset
    if start + n_bytes > header.size:
        raise WeightsError(f"{origin} is truncated: tensor {name!r} ({kind.name}, shape {list(reversed(dims))}) "
                           f"ends at byte {start + n_bytes:,}, the file has {header.size:,} bytes")
    return TensorInfo(name, kind, tuple(int(n) for n in reversed(dims)), start, n_bytes, header)
