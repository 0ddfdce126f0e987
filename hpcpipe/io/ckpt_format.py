"""Checkpoint format: names, the slice arithmetic, checksums, and the index and shard files.

Everything here is pure (no MPI): a checkpoint is read, verified and resharded by any process.
The on-disk layout is documented in docs/formats.md; this module is its single implementation.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "CheckpointError",
    "ShardSpec",
    "block_index",
]

FORMAT = "hpcpipe-checkpoint"
SHARD_FORMAT = "hpcpipe-checkpoint-shard"
FORMAT_VERSION = 2
INDEX_FILE = "index.h5"
SHARED_FILE = "data.h5"
LIBVER = "v108"
"""HDF5 1.8 object formats or newer: metadata blocks carry checksums, attributes may be large."""

BLOCK_BYTES = 64 * 2**20
"""Reads stream a slice in row blocks of about this size, so memory stays bounded."""

RESERVED_ATTRS = frozenset(
    {
        "format",
        "format_version",
        "step",
        "checkpoint_id",
        "created",
        "code_version",
        "layout",
        "world_size",
        "index_crc32",
        "attr_codecs",
    }
)
_NUMERIC_KINDS = "biufc"


class CheckpointError(Exception):
    """A checkpoint cannot be written, found, read or trusted; names the file and the tensor."""

    def __init__(self, message: str, *, path: Path | str | None = None, tensor: str | None = None):
        self.path = Path(path) if path is not None else None
        self.tensor = tensor
        where = f"{path}: " if path is not None else ""
        what = f"tensor {tensor!r}: " if tensor is not None else ""
        super().__init__(where + what + message)


# ---------------------------------------------------------------- slices


def _normalize_index(index: Sequence[slice], shape: tuple[int, ...]) -> tuple[slice, ...]:
    if not isinstance(index, tuple | list):
        raise ValueError(f"index must be a tuple of slices, got {index!r}")
    if len(index) > len(shape):
        raise ValueError(f"index {index!r} has more entries than the {len(shape)}-d tensor")
    padded = (*index, *[slice(None)] * (len(shape) - len(index)))
    out = []
    for dim, (item, n) in enumerate(zip(padded, shape, strict=True)):
        if not isinstance(item, slice):
            raise ValueError(
                f"index[{dim}] = {item!r} must be a slice (write slice(i, i + 1) for one entry)"
            )
        start = 0 if item.start is None else item.start
        stop = n if item.stop is None else item.stop
        step = 1 if item.step is None else item.step
        if not all(isinstance(v, int | np.integer) for v in (start, stop, step)):
            raise ValueError(f"index[{dim}] = {item!r} must have integer bounds")
        if step < 1:
            raise ValueError(f"index[{dim}] = {item!r}: step must be >= 1")
        if not 0 <= start <= stop <= n:
            raise ValueError(
                f"index[{dim}] = {item!r} is outside 0..{n} (negative or reversed bounds "
                "are not accepted)"
            )
        out.append(slice(int(start), int(stop), int(step)))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """The part of one global tensor that a rank holds (or asks for when loading).

    `index` has one slice per dimension (missing trailing ones mean the whole dimension). Saving
    needs step-1 slices (a box); loading accepts any positive step.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: npt.DTypeLike
    index: tuple[slice, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "\0" in self.name:
            raise ValueError(f"tensor name must be a non-empty string without NUL: {self.name!r}")
        shape = tuple(int(n) for n in self.global_shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"tensor {self.name!r}: global_shape {shape} has a negative size")
        dtype = np.dtype(self.dtype)
        if dtype.kind not in _NUMERIC_KINDS or dtype.subdtype is not None:
            raise ValueError(
                f"tensor {self.name!r}: dtype {dtype} is not a plain numeric type "
                "(bool, integer, float or complex)"
            )
        try:
            index = _normalize_index(self.index, shape)
        except ValueError as exc:
            raise ValueError(f"tensor {self.name!r}: {exc}") from None
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "index", index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardSpec):
            return NotImplemented
        return (self.name, self.global_shape, self.dtype, self._key()) == (
            other.name,
            other.global_shape,
            other.dtype,
            other._key(),
        )

    def __hash__(self) -> int:
        return hash((self.name, self.global_shape, self.dtype.str, self._key()))

    def _key(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((s.start, s.stop, s.step) for s in self.index)

    @classmethod
    def whole(cls, name: str, global_shape: Sequence[int], dtype: npt.DTypeLike) -> ShardSpec:
        """The entire tensor (a replicated parameter, or a load of the full tensor)."""
        return cls(name, tuple(global_shape), dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the local array this spec describes."""
        return tuple(len(range(s.start, s.stop, s.step)) for s in self.index)

    @property
    def is_box(self) -> bool:
        return all(s.step == 1 for s in self.index)

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(s.start for s in self.index)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(s.stop for s in self.index)


def block_index(global_shape: Sequence[int], axis: int, parts: int, part: int) -> tuple[slice, ...]:
    """Part `part` of `parts` near-equal blocks along `axis` (the first ones one longer)."""
    shape = tuple(global_shape)
    if not 0 <= axis < len(shape):
        raise ValueError(f"axis {axis} out of range for shape {shape}")
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts} is not a valid block")
    base, extra = divmod(shape[axis], parts)
    start = part * base + min(part, extra)
    stop = start + base + (1 if part < extra else 0)
    return tuple(slice(start, stop) if d == axis else slice(0, n) for d, n in enumerate(shape))


def format_box(start: Sequence[int], stop: Sequence[int]) -> str:
    """`[0:4, 2:8]`; `[]` for a scalar."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(start, stop, strict=True)) + "]"


def box_overlap(
    a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]
) -> bool:
    """Do two boxes (start, stop) share at least one element? (Two scalars always do.)"""
    (a0, a1), (b0, b1) = a, b
    return all(max(x0, y0) < min(x1, y1) for x0, x1, y0, y1 in zip(a0, a1, b0, b1, strict=True))


def box_volume(start: Sequence[int], stop: Sequence[int]) -> int:
    return math.prod(b - a for a, b in zip(start, stop, strict=True))


def first_overlap(
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[int, int] | None:
    """Indices of two overlapping boxes, or None. Sweeps along the dimension where the boxes'
    starts differ most, so block decompositions along any axis cost near-linear time."""
    live = [i for i, (a, b) in enumerate(boxes) if box_volume(a, b) > 0]
    if len(live) < 2:
        return None
    ndim = len(boxes[live[0]][0])
    if ndim == 0:  # scalars: any two overlap
        return live[0], live[1]
    axis = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in live}))
    order = sorted(live, key=lambda i: boxes[i][0][axis])
    for pos, i in enumerate(order):
        for j in order[pos + 1 :]:
            if boxes[j][0][axis] >= boxes[i][1][axis]:
                break
            if box_overlap(boxes[i], boxes[j]):
                return min(i, j), max(i, j)
    return None


def crc32(array: np.ndarray, value: int = 0) -> int:
    """CRC32 (zlib) of the array's bytes in C order, continuing from `value`."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8), value) & 0xFFFFFFFF


def iter_row_blocks(dataset: h5py.Dataset, block_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) blocks of a dataset along axis 0, so memory stays bounded; a 0-d or
    empty dataset comes as one block."""
    shape = dataset.shape
    if not shape or shape[0] == 0 or math.prod(shape) == 0:
        yield 0, dataset[()]
        return
    row_bytes = max(1, math.prod(shape[1:]) * dataset.dtype.itemsize)
    rows = max(1, block_bytes // row_bytes)
    for r0 in range(0, shape[0], rows):
        yield r0, dataset[r0 : r0 + rows]


# ---------------------------------------------------------------- attributes


def fixed_strings(values: Sequence[str]) -> np.ndarray:
    """Fixed-length UTF-8 strings. Variable-length ones live in HDF5's global heap, which has
    no checksum: a flipped byte there can make the HDF5 library loop forever on read."""
    raw = [v.encode("utf-8") for v in values]
    return np.array(raw, dtype=h5py.string_dtype("utf-8", max([1, *map(len, raw)])))


def set_attr(attrs: h5py.AttributeManager, key: str, value: Any) -> None:
    """Set an attribute, storing text as a fixed-length UTF-8 string (see `fixed_strings`)."""
    if isinstance(value, str):
        attrs[key] = fixed_strings([value])[0]
    else:
        attrs[key] = value


def encode_attrs(attrs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """HDF5-storable values plus a codec map for the ones that need decoding (JSON, bytes)."""
    out: dict[str, Any] = {}
    codecs: dict[str, str] = {}
    for key, value in attrs.items():
        if not isinstance(key, str) or not key or "/" in key or "\0" in key:
            raise CheckpointError(f"attribute name {key!r} must be a non-empty string without '/'")
        if key in RESERVED_ATTRS:
            raise CheckpointError(
                f"attribute {key!r} is reserved by the format ({', '.join(sorted(RESERVED_ATTRS))})"
            )
        if isinstance(value, str) and "\0" in value:  # fixed-length strings drop NULs
            out[key] = json.dumps(value)
            codecs[key] = "json"
        elif isinstance(value, bytes | bytearray | memoryview):
            out[key] = np.frombuffer(bytes(value), dtype=np.uint8)
            codecs[key] = "bytes"
        elif isinstance(value, str | bool | np.bool_ | np.number):
            out[key] = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            out[key] = np.int64(value)
        elif isinstance(value, float):
            out[key] = np.float64(value)
        elif isinstance(value, np.ndarray) and value.dtype.kind in _NUMERIC_KINDS:
            out[key] = value
        else:
            try:
                out[key] = json.dumps(value, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"attribute {key!r}: {type(value).__name__} is neither an HDF5 value nor "
                    f"JSON ({exc}); pass str, bytes, numbers, arrays, or JSON-able containers"
                ) from None
            codecs[key] = "json"
    return out, codecs


def decode_attrs(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Root attributes as Python values: JSON and bytes decoded, NumPy scalars unboxed."""
    codecs = json.loads(raw.get("attr_codecs", "{}"))
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "attr_codecs":
            continue
        codec = codecs.get(key)
        if codec == "json":
            value = json.loads(value)
        elif codec == "bytes":
            value = np.asarray(value, dtype=np.uint8).tobytes()
        elif isinstance(value, bytes):
            value = value.decode("utf-8")
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


# ---------------------------------------------------------------- index


@dataclass(frozen=True)
class SliceEntry:
    """One stored slice: which shard file, which dataset in it, where it sits, its CRC32."""

    shard: int
    dataset: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    crc32: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    def describe(self) -> str:
        return format_box(self.start, self.stop)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    slices: tuple[SliceEntry, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardEntry:
    file: str
    rank: int
    """The writer's rank in the saving communicator; -1 for the collectively written file."""
    nbytes: int


@dataclass(frozen=True)
class Index:
    """A parsed, checked index.h5."""

    directory: Path
    step: int
    checkpoint_id: str
    layout: str
    attrs: dict[str, Any]
    shards: tuple[ShardEntry, ...]
    tensors: dict[str, TensorEntry] = field(repr=False)

    @property
    def path(self) -> Path:
        return self.directory / INDEX_FILE

    def shard_path(self, shard: int) -> Path:
        return self.directory / self.shards[shard].file


TABLES = (
    "shards/file",
    "shards/rank",
    "shards/nbytes",
    "tensors/name",
    "tensors/dtype",
    "tensors/ndim",
    "tensors/shape",
    "slices/tensor",
    "slices/shard",
    "slices/dataset",
    "slices/start",
    "slices/stop",
    "slices/crc32",
)
"""The index's datasets (docs/formats.md)."""


def _tables(
    step: int,
    checkpoint_id: str,
    layout: str,
    shards: Sequence[ShardEntry],
    tensors: Sequence[TensorEntry],
) -> dict[str, np.ndarray]:
    ndim = max([1, *(len(t.shape) for t in tensors)])

    def padded(values: Sequence[tuple[int, ...]]) -> np.ndarray:
        out = np.zeros((len(values), ndim), dtype="<i8")
        for i, v in enumerate(values):
            out[i, : len(v)] = v
        return out

    rows = [(ti, s) for ti, t in enumerate(tensors) for s in t.slices]
    return {  # "_header" is not stored as a table, but its attributes are checksummed with them
        "shards/file": fixed_strings([s.file for s in shards]),
        "shards/rank": np.array([s.rank for s in shards], dtype="<i4"),
        "shards/nbytes": np.array([s.nbytes for s in shards], dtype="<i8"),
        "tensors/name": fixed_strings([t.name for t in tensors]),
        "tensors/dtype": fixed_strings([t.dtype.str for t in tensors]),
        "tensors/ndim": np.array([len(t.shape) for t in tensors], dtype="<i4"),
        "tensors/shape": padded([t.shape for t in tensors]),
        "slices/tensor": np.array([ti for ti, _ in rows], dtype="<i4"),
        "slices/shard": np.array([s.shard for _, s in rows], dtype="<i4"),
        "slices/dataset": fixed_strings([s.dataset for _, s in rows]),
        "slices/start": padded([s.start for _, s in rows]),
        "slices/stop": padded([s.stop for _, s in rows]),
        "slices/crc32": np.array([s.crc32 for _, s in rows], dtype="<u4"),
        "_header": fixed_strings([f"{step}\0{checkpoint_id}\0{layout}"]),
    }


def _tables_crc(tables: Mapping[str, np.ndarray]) -> int:
    value = 0
    for key in sorted(tables):
        arr = tables[key]
        if arr.dtype.kind == "S":  # as stored: checked before anything is decoded
            value = zlib.crc32(f"{key}\0{len(arr)}\0".encode() + b"\0".join(arr.tolist()), value)
        else:
            value = zlib.crc32(key.encode(), value)
            value = zlib.crc32(np.ascontiguousarray(arr).view(np.uint8), value)
    return value & 0xFFFFFFFF


def _attrs_crc(raw: Mapping[str, Any], value: int) -> int:
    """CRC32 of every root attribute but `index_crc32`, as stored (name, dtype, shape, bytes):
    the step, the optimizer step, the data position and the history live there, so they are
    under the same checksum as the tables (format version 2 on)."""
    for key in sorted(raw):
        if key == "index_crc32":
            continue
        arr = np.asarray(raw[key])
        if arr.dtype.kind == "O":  # variable-length text (not written by hpcpipe): as UTF-8
            arr = np.frombuffer(str(raw[key]).encode("utf-8"), dtype=np.uint8)
        value = zlib.crc32(f"{key}\0{arr.dtype.str}\0{arr.shape}\0".encode(), value)
        value = zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8), value)
    return value & 0xFFFFFFFF


def write_index(
    path: Path,
    *,
    step: int,
    checkpoint_id: str,
    layout: str,
    world_size: int,
    created: str,
    code_version: str,
    shards: Sequence[ShardEntry],
    tensors: Sequence[TensorEntry],
    attrs: Mapping[str, Any],
) -> None:
    """Write index.h5; one CRC32 covers the tables and every attribute, so a flipped byte or an
    edited value is caught on read."""
    encoded, codecs = encode_attrs(attrs)
    tables = _tables(step, checkpoint_id, layout, shards, tensors)
    with h5py.File(path, "w", libver=LIBVER) as f:
        header = {
            "format": FORMAT,
            "format_version": np.int64(FORMAT_VERSION),
            "step": np.int64(step),
            "checkpoint_id": checkpoint_id,
            "created": created,
            "code_version": code_version,
            "layout": layout,
            "world_size": np.int64(world_size),
            "attr_codecs": json.dumps(codecs, sort_keys=True),
        }
        for key, value in {**header, **encoded}.items():
            set_attr(f.attrs, key, value)
        for key in TABLES:
            f.create_dataset(key, data=tables[key])
        # the checksum is taken over the attributes as stored, read back
        stored = _attrs_crc(dict(f.attrs), _tables_crc(tables))
        f.attrs["index_crc32"] = np.uint32(stored)


def check_format(attrs: Mapping[str, Any], expected: str, path: Path) -> None:
    """Refuse other formats and versions from the future, with a hint."""
    fmt = attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode("utf-8", "replace")
    if fmt != expected:
        raise CheckpointError(
            f"not an hpcpipe checkpoint file (format {fmt!r}, expected {expected!r})", path=path
        )
    version = attrs.get("format_version")
    if not isinstance(version, int | np.integer):
        raise CheckpointError(f"format_version {version!r} is not an integer", path=path)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"format version {int(version)} was written by a newer hpcpipe; this hpcpipe reads "
            f"version {FORMAT_VERSION} or older: upgrade hpcpipe to load it",
            path=path,
        )
    if version < 1:
        raise CheckpointError(f"format version {int(version)} is not valid", path=path)


def read_index(directory: Path) -> Index:
    """Parse and check a step directory's index.h5 (format, version, table checksum, bounds)."""
    path = directory / INDEX_FILE
    if not path.is_file():
        raise CheckpointError(
            f"no {INDEX_FILE}: not a checkpoint directory (or an incomplete one)", path=directory
        )
    try:
        with h5py.File(path, "r") as f:
            raw = dict(f.attrs)
            check_format(raw, FORMAT, path)
            tables = {key: f[key][()] for key in TABLES}
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        what = "truncated index (a partial copy)" if "truncated" in str(exc) else "unreadable index"
        raise CheckpointError(f"{what} ({type(exc).__name__}: {exc})", path=path) from None
    try:
        step = int(raw["step"])
        checkpoint_id = _as_str(raw["checkpoint_id"])
        layout = _as_str(raw["layout"])
        stored_crc = int(raw["index_crc32"])
        attrs = decode_attrs(raw)
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"index attributes are damaged ({exc})", path=path) from None
    tables["_header"] = fixed_strings([f"{step}\0{checkpoint_id}\0{layout}"])
    computed = _tables_crc(tables)
    if int(raw["format_version"]) >= 2:  # version 1 left the other attributes unchecked
        computed = _attrs_crc(raw, computed)
    if computed != stored_crc:
        raise CheckpointError(
            "index checksum mismatch: index.h5 is corrupted or was edited (a flipped byte, a "
            "partial copy, or a changed attribute)",
            path=path,
        )
    named = step_of_name(directory.name)
    if named is not None and named != step:
        raise CheckpointError(
            f"the directory is named for step {named} but its index holds step {step}: it was "
            "renamed or copied over another step; load it by its real step's name",
            path=directory,
        )
    for key in ("shards/file", "tensors/name", "tensors/dtype", "slices/dataset"):
        tables[key] = np.array([_as_str(v) for v in tables[key]], dtype=object)
    return _build_index(directory, step, checkpoint_id, layout, attrs, tables)


def step_of_name(name: str) -> int | None:
    """The step a complete checkpoint directory's name says (`step_000100` -> 100), else None."""
    import re

    m = re.fullmatch(r"step_(\d{6,})", name)
    return int(m.group(1)) if m else None


def _as_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _build_index(
    directory: Path,
    step: int,
    checkpoint_id: str,
    layout: str,
    attrs: dict[str, Any],
    t: dict[str, np.ndarray],
) -> Index:
    path = directory / INDEX_FILE
    shards = tuple(
        ShardEntry(str(f), int(r), int(n))
        for f, r, n in zip(t["shards/file"], t["shards/rank"], t["shards/nbytes"], strict=True)
    )
    for shard in shards:
        if "/" in shard.file or shard.file in ("", ".", ".."):
            raise CheckpointError(f"shard file name {shard.file!r} is not a plain name", path=path)
    per_tensor: list[list[SliceEntry]] = [[] for _ in t["tensors/name"]]
    ndims = t["tensors/ndim"]
    for ti, shard, ds, a, b, crc in zip(
        t["slices/tensor"],
        t["slices/shard"],
        t["slices/dataset"],
        t["slices/start"],
        t["slices/stop"],
        t["slices/crc32"],
        strict=True,
    ):
        if not (0 <= ti < len(per_tensor) and 0 <= shard < len(shards)):
            raise CheckpointError("slice table refers to a missing tensor or shard", path=path)
        nd = int(ndims[ti])
        per_tensor[ti].append(
            SliceEntry(
                int(shard), str(ds), tuple(map(int, a[:nd])), tuple(map(int, b[:nd])), int(crc)
            )
        )
    tensors: dict[str, TensorEntry] = {}
    for ti, name in enumerate(t["tensors/name"]):
        shape = tuple(int(n) for n in t["tensors/shape"][ti][: int(ndims[ti])])
        dtype = np.dtype(str(t["tensors/dtype"][ti]))
        entry = TensorEntry(str(name), shape, dtype, tuple(per_tensor[ti]))
        covered = 0
        clash = first_overlap([(s.start, s.stop) for s in entry.slices])
        if clash is not None:
            a, b = (entry.slices[i].describe() for i in clash)
            raise CheckpointError(f"slices {a} and {b} overlap", path=path, tensor=name)
        for s in entry.slices:
            if not all(0 <= a <= b <= n for a, b, n in zip(s.start, s.stop, shape, strict=True)):
                raise CheckpointError(
                    f"slice {s.describe()} lies outside the shape {shape}", path=path, tensor=name
                )
            covered += box_volume(s.start, s.stop)
        if covered != math.prod(shape):
            raise CheckpointError(
                f"slices hold {covered} elements but the tensor has {math.prod(shape)}",
                path=path,
                tensor=name,
            )
        tensors[entry.name] = entry
    return Index(directory, step, checkpoint_id, layout, attrs, shards, tensors)


# ---------------------------------------------------------------- shards


class ShardReader:
    """An open shard file whose identity and size were checked against the index."""

    def __init__(self, index: Index, shard: int):
        self.index = index
        self.entry = index.shards[shard]
        self.path = index.shard_path(shard)
        expected = self.entry.nbytes
        if not self.path.is_file():
            raise CheckpointError(
                f"missing shard (written by rank {self.entry.rank}; the index lists "
                f"{len(index.shards)} shard files)",
                path=self.path,
            )
        size = self.path.stat().st_size
        try:
            self.file = h5py.File(self.path, "r")
            raw = dict(self.file.attrs)
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            if size < expected:
                raise CheckpointError(
                    f"truncated shard: {size} of {expected} bytes", path=self.path
                ) from None
            raise CheckpointError(
                f"unreadable shard ({type(exc).__name__}: {exc})", path=self.path
            ) from None
        try:
            check_format(raw, SHARD_FORMAT, self.path)
            owner = _as_str(raw.get("checkpoint_id", ""))
            if owner != index.checkpoint_id:
                raise CheckpointError(
                    f"shard belongs to checkpoint {owner or '(none)'} but {INDEX_FILE} is for "
                    f"checkpoint {index.checkpoint_id}: files from different checkpoints or runs "
                    "were mixed",
                    path=self.path,
                )
            if size < expected:
                raise CheckpointError(
                    f"truncated shard: {size} of {expected} bytes", path=self.path
                )
            if size > expected:
                raise CheckpointError(
                    f"shard has grown: {size} bytes, {expected} written", path=self.path
                )
        except CheckpointError:
            self.file.close()
            raise

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def dataset(self, tensor: TensorEntry, entry: SliceEntry) -> h5py.Dataset:
        """The slice's dataset, checked to be the one the index describes."""
        try:
            ds = self.file[entry.dataset]
            owner = _as_str(ds.attrs.get("tensor", ""))
            shape, dtype = ds.shape, ds.dtype
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise CheckpointError(
                f"slice {entry.describe()} (dataset {entry.dataset}) is unreadable "
                f"({type(exc).__name__}: {exc})",
                path=self.path,
                tensor=tensor.name,
            ) from None
        if not isinstance(ds, h5py.Dataset) or owner != tensor.name:
            raise CheckpointError(
                f"dataset {entry.dataset} holds tensor {owner!r}, not this one",
                path=self.path,
                tensor=tensor.name,
            )
        if shape != entry.shape or dtype != tensor.dtype:
            raise CheckpointError(
                f"dataset {entry.dataset} is {dtype}{list(shape)}, index says "
                f"{tensor.dtype}{list(entry.shape)}",
                path=self.path,
                tensor=tensor.name,
            )
        return ds

    def blocks(self, tensor: TensorEntry, entry: SliceEntry) -> Iterator[tuple[int, np.ndarray]]:
        """Row blocks of a slice (bounded memory); after the last one its CRC32 is checked.
        Consume it to the end: the check is what makes the blocks trustworthy."""
        ds = self.dataset(tensor, entry)
        value = 0
        try:
            for r0, block in iter_row_blocks(ds, BLOCK_BYTES):
                value = crc32(block, value)
                yield r0, block
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"slice {entry.describe()} cannot be read ({type(exc).__name__}: {exc})",
                path=self.path,
                tensor=tensor.name,
            ) from None
        self.check_crc(tensor, entry, value)

    def read_into(self, tensor: TensorEntry, entry: SliceEntry, out: np.ndarray) -> None:
        """Read a whole slice straight into `out` (no copy); the caller checks its CRC32."""
        ds = self.dataset(tensor, entry)
        try:
            if out.ndim == 0:
                out[()] = ds[()]
            elif out.size:
                ds.read_direct(out)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"slice {entry.describe()} cannot be read ({type(exc).__name__}: {exc})",
                path=self.path,
                tensor=tensor.name,
            ) from None

    def check_crc(self, tensor: TensorEntry, entry: SliceEntry, value: int) -> None:
        if value != entry.crc32:
            raise CheckpointError(
                f"CRC32 mismatch in slice {entry.describe()} (dataset {entry.dataset}): stored "
                f"{entry.crc32:#010x}, computed {value:#010x}; the shard is corrupted",
                path=self.path,
                tensor=tensor.name,
            )
