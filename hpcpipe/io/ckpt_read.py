"""Reading checkpoints: resharded loads, verification, inspection, consolidated export.

Every byte handed back has passed its slice's CRC32; every problem is a CheckpointError that
names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcpipe import __version__
from hpcpipe.io.ckpt_format import (
    LIBVER,
    CheckpointError,
    Index,
    ShardReader,
    ShardSpec,
    SliceEntry,
    TensorEntry,
    crc32,
    format_box,
    read_index,
    set_attr,
)
from hpcpipe.io.ckpt_store import resolve_checkpoint

__all__ = [
    "EXPORT_FORMAT",
    "convert_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_attrs",
    "verify_checkpoint",
]

EXPORT_FORMAT = "hpcpipe-checkpoint-export"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scatter(
    out: np.ndarray, spec: ShardSpec, block: np.ndarray, block_start: tuple[int, ...]
) -> None:
    """Copy the part of a stored block that `spec` asks for into `out` (any positive steps)."""
    src, dst = [], []
    for want, a, m in zip(spec.index, block_start, block.shape, strict=True):
        s, t, n = want.start, want.step, len(range(want.start, want.stop, want.step))
        k_lo = max(0, _ceil_div(a - s, t))
        k_hi = min(n, _ceil_div(a + m - s, t))
        if k_lo >= k_hi:
            return
        first = s + t * k_lo - a
        src.append(slice(first, first + t * (k_hi - k_lo - 1) + 1, t))
        dst.append(slice(k_lo, k_hi))
    out[tuple(dst)] = block[tuple(src)]


def _touches(spec: ShardSpec, entry: SliceEntry) -> bool:
    for want, a, b in zip(spec.index, entry.start, entry.stop, strict=True):
        s, t = want.start, want.step
        n = len(range(s, want.stop, t))
        if max(0, _ceil_div(a - s, t)) >= min(n, _ceil_div(b - s, t)):
            return False
    return True


def _names_hint(index: Index, limit: int = 8) -> str:
    names = sorted(index.tensors)
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"it holds {len(names)} tensors: {shown}" if names else "it holds no tensors"


def _check_request(index: Index, key: str, spec: Any) -> TensorEntry:
    if not isinstance(spec, ShardSpec):
        raise CheckpointError(f"wanted[{key!r}] is a {type(spec).__name__}, not a ShardSpec")
    tensor = index.tensors.get(spec.name)
    if tensor is None:
        raise CheckpointError(
            f"not in this checkpoint ({_names_hint(index)})", path=index.path, tensor=spec.name
        )
    if spec.dtype != tensor.dtype:
        raise CheckpointError(
            f"stored as {tensor.dtype}, asked for {spec.dtype} (nothing is cast on load)",
            path=index.path,
            tensor=spec.name,
        )
    if spec.global_shape != tensor.shape:
        raise CheckpointError(
            f"stored with global shape {tensor.shape}, asked for {spec.global_shape}",
            path=index.path,
            tensor=spec.name,
        )
    return tensor


def load_checkpoint(
    path_or_root: Path | str, wanted: Mapping[str, ShardSpec]
) -> dict[str, np.ndarray]:
    """Read exactly the requested slices: `{key: array of spec.shape}` for `{key: spec}`.

    `path_or_root` is a step, checkpoints or run directory (the latter two: the latest
    complete checkpoint). Any slicing of a global tensor works, whatever layout saved it;
    each stored slice touched is read once and its CRC32 checked before anything is returned.
    """
    index = read_index(resolve_checkpoint(path_or_root))
    outputs: dict[str, np.ndarray] = {}
    # shard -> (tensor name, slice number) -> [(key, spec)]
    plan: dict[int, dict[tuple[str, int], list[tuple[str, ShardSpec]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for key, spec in wanted.items():
        tensor = _check_request(index, key, spec)
        outputs[key] = np.empty(spec.shape, dtype=tensor.dtype)
        for number, entry in enumerate(tensor.slices):
            if _touches(spec, entry):
                plan[entry.shard][(tensor.name, number)].append((key, spec))
    # A slice wanted exactly as stored (a restart on the same layout) is read straight into
    # its output and checksummed on a helper thread while the next one is read; any other
    # overlap streams the slice in bounded blocks and scatters the wanted parts.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc32") as pool:
        pending = []
        for shard in sorted(plan):
            with ShardReader(index, shard) as reader:
                for (name, number), targets in plan[shard].items():
                    tensor = index.tensors[name]
                    entry = tensor.slices[number]
                    (key, spec), *others = targets
                    as_stored = spec.is_box and (spec.start, spec.stop) == (entry.start, entry.stop)
                    if as_stored and not others:
                        reader.read_into(tensor, entry, outputs[key])
                        pending.append((reader, tensor, entry, pool.submit(crc32, outputs[key])))
                        continue
                    for r0, block in reader.blocks(tensor, entry):
                        start = (entry.start[0] + r0, *entry.start[1:]) if entry.start else ()
                        for key, spec in targets:
                            _scatter(outputs[key], spec, block, start)
        for reader, tensor, entry, value in pending:
            reader.check_crc(tensor, entry, value.result())
    return outputs


def read_attrs(path: Path | str) -> dict[str, Any]:
    """The index's root attributes: format, step, checkpoint_id, ... and the caller's attrs."""
    return dict(read_index(resolve_checkpoint(path)).attrs)


def _by_shard(index: Index) -> dict[int, list[tuple[TensorEntry, SliceEntry]]]:
    out: dict[int, list[tuple[TensorEntry, SliceEntry]]] = defaultdict(list)
    for tensor in index.tensors.values():
        for entry in tensor.slices:
            out[entry.shard].append((tensor, entry))
    return out


def verify_checkpoint(path: Path | str) -> list[str]:
    """Recompute every checksum; all problems found (empty: the checkpoint is sound).

    Raises CheckpointError when there is nothing to check against: no checkpoint at `path`,
    or an unreadable or corrupted index.
    """
    index = read_index(resolve_checkpoint(path))
    problems = []
    for shard, entries in sorted(_by_shard(index).items()):
        try:
            reader = ShardReader(index, shard)
        except CheckpointError as exc:
            names = sorted({t.name for t, _ in entries})
            listed = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            problems.append(f"{exc} (holds slices of {listed})")
            continue
        with reader:
            for tensor, entry in entries:
                try:
                    for _ in reader.blocks(tensor, entry):
                        pass
                except CheckpointError as exc:
                    problems.append(str(exc))
    return problems


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _short(value: Any, width: int = 60) -> str:
    if isinstance(value, bytes):
        text = f"<{len(value)} bytes>"
    elif isinstance(value, np.ndarray):
        text = f"<{value.dtype}{list(value.shape)}>"
    else:
        text = repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def inspect_checkpoint(path: Path | str, *, slices: bool = False) -> str:
    """A readable summary: step, layout, files and sizes, attributes, and the tensor table."""
    index = read_index(resolve_checkpoint(path))
    a = index.attrs
    on_disk = sum(s.nbytes for s in index.shards)
    tensor_bytes = sum(t.nbytes for t in index.tensors.values())
    nslices = sum(len(t.slices) for t in index.tensors.values())
    lines = [
        f"checkpoint {index.directory}",
        f"  format      {a['format']} v{a['format_version']} (hpcpipe {a['code_version']})",
        f"  step        {index.step}",
        f"  id          {index.checkpoint_id}  created {a['created']}",
        f"  layout      {index.layout}: {len(index.shards)} file(s), {_human(on_disk)} "
        f"on disk; saved by {a['world_size']} rank(s)",
        f"  tensors     {len(index.tensors)} ({_human(tensor_bytes)}) in {nslices} slice(s)",
    ]
    reserved = {"format", "format_version", "step", "checkpoint_id", "created", "code_version"}
    reserved |= {"layout", "world_size", "index_crc32"}
    extra = {k: v for k, v in a.items() if k not in reserved}
    if extra:
        lines.append("  attributes")
        width = max(len(k) for k in extra)
        lines += [f"    {k:<{width}}  {_short(v)}" for k, v in sorted(extra.items())]
    if index.tensors:
        tensors = sorted(index.tensors.values(), key=lambda t: t.name)
        rows = [
            (
                t.name,
                "x".join(map(str, t.shape)) or "scalar",
                str(t.dtype),
                str(len(t.slices)),
                _human(t.nbytes),
            )
            for t in tensors
        ]
        head = ("tensor", "shape", "dtype", "slices", "size")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines.append("")

        def line(cells: tuple[str, ...]) -> str:
            return "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        lines.append(line(head))
        for row, tensor in zip(rows, tensors, strict=True):
            lines.append(line(row))
            if slices:
                for entry in tensor.slices:
                    shard = index.shards[entry.shard]
                    lines.append(
                        f"      {format_box(entry.start, entry.stop)} in {shard.file}:"
                        f"{entry.dataset} crc32={entry.crc32:#010x}"
                    )
    return "\n".join(lines)


def _export_names(names: Iterable[str]) -> None:
    """Tensor names become HDF5 paths in the export: refuse ones that cannot coexist."""
    ordered = sorted(names)
    for name in ordered:
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise CheckpointError(
                "cannot become an HDF5 dataset path in the export (empty, '.' or '..' parts)",
                tensor=name,
            )
    for a, b in itertools.pairwise(ordered):
        if b.startswith(a + "/"):
            raise CheckpointError(
                f"is both a tensor and a group of {b!r}; the export needs distinct paths",
                tensor=a,
            )


def convert_checkpoint(path: Path | str, out: Path | str, *, overwrite: bool = False) -> Path:
    """Write one HDF5 file with one dataset per global tensor (checked on the way); the root
    attributes are the checkpoint's. For users and tools that do not want the sharded layout."""
    index = read_index(resolve_checkpoint(path))
    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError("already exists (pass overwrite=True / --force)", path=out)
    _export_names(index.tensors)
    partial = out.with_name(out.name + ".partial")
    try:
        with h5py.File(index.path, "r") as src, h5py.File(partial, "w", libver=LIBVER) as f:
            for key, value in src.attrs.items():
                if key != "index_crc32":
                    f.attrs[key] = value
            set_attr(f.attrs, "format", EXPORT_FORMAT)
            f.attrs["source_format_version"] = src.attrs["format_version"]
            f.attrs["format_version"] = np.int64(1)
            set_attr(f.attrs, "exported_by", __version__)
            datasets = {
                t.name: f.create_dataset(t.name, shape=t.shape, dtype=t.dtype)
                for t in index.tensors.values()
            }
            for shard, entries in sorted(_by_shard(index).items()):
                with ShardReader(index, shard) as reader:
                    for tensor, entry in entries:
                        ds = datasets[tensor.name]
                        for r0, block in reader.blocks(tensor, entry):
                            if block.size == 0:
                                continue
                            if not entry.start:
                                ds[()] = block
                                continue
                            rows = slice(entry.start[0] + r0, entry.start[0] + r0 + len(block))
                            rest = tuple(
                                slice(a, b)
                                for a, b in zip(entry.start[1:], entry.stop[1:], strict=True)
                            )
                            ds[(rows, *rest)] = block
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out


def describe_totals(path: Path | str) -> tuple[int, int, int, int]:
    """(step, tensors, slices, bytes) of a checkpoint, for one-line reports."""
    index = read_index(resolve_checkpoint(path))
    nslices = sum(len(t.slices) for t in index.tensors.values())
    nbytes = sum(t.nbytes for t in index.tensors.values())
    return index.step, len(index.tensors), nslices, nbytes
