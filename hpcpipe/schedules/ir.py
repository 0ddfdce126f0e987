"""The schedule representation: `Action`, `Schedule`, their string forms and the CSV form.

A schedule is frozen data. Every consumer (runtime, validator, simulator, plots) reads the same
object, so a plan for thousands of ranks can be built and checked without MPI. Actions are
stored as three flat integer arrays (kind, stage, microbatch) grouped by rank with an offsets
array, because p=1024, m=4096 means tens of millions of actions: Python objects per action would
be too slow and too big. `Schedule.actions` gives the per-rank tuples of `Action` on demand.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "Kind",
    "Schedule",
    "from_csv",
    "read_csv",
    "to_csv",
    "write_csv",
]


class Kind(IntEnum):
    """What an action does. B is the backward for inputs only, W the backward for weights."""

    F = 0
    B = 1
    W = 2
    BW = 3
    SEND_F = 4
    RECV_F = 5
    SEND_B = 6
    RECV_B = 7

    def __str__(self) -> str:
        return self.name


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)
COMM_KINDS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
_KIND_BY_NAME = {k.name: k for k in Kind}
_ACTION_RE = re.compile(r"(\d+)([A-Z_]+)(\d+)")


class Action(NamedTuple):
    """One step of one rank: `Action(2, Kind.F, 0)` prints as `2F0` and parses back.

    For SEND_F/SEND_B the stage is the sending stage; for RECV_F/RECV_B it is the receiving
    stage. So `1SEND_F4` (stage 1 sends the output of microbatch 4) matches `2RECV_F4`, and
    `2SEND_B4` matches `1RECV_B4`.
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.name}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """`'5W3'` -> `Action(5, Kind.W, 3)`; raises ValueError naming the bad text."""
        match = _ACTION_RE.fullmatch(text.strip())
        kind = _KIND_BY_NAME.get(match.group(2)) if match else None
        if kind is None:
            kinds = ", ".join(_KIND_BY_NAME)
            raise ValueError(
                f"{text!r} is not an action: expected STAGE KIND MICROBATCH such as '2F0', "
                f"'5W3' or '1SEND_F4' (kinds: {kinds})"
            )
        return cls(int(match.group(1)), kind, int(match.group(3)))


def _frozen(a: Any, dtype: Any) -> np.ndarray:
    """A read-only 1-D array; writeable inputs are copied so the caller cannot mutate it."""
    out = np.asarray(a, dtype=dtype)
    if out.flags.writeable:
        out = np.array(out, dtype=dtype, order="C")
        out.flags.writeable = False
    if out.ndim != 1:
        raise ValueError("action arrays must be one-dimensional")
    return out


@dataclass(frozen=True, eq=False, repr=False)
class Schedule:
    """Placement plus the ordered actions of every rank.

    `stages_of_rank[r]` lists the stages rank r holds (one for GPipe/1F1B, v for interleaved,
    two for the V shapes). Rank r's actions are `kinds/stages/microbatches[offsets[r]:offsets[r+1]]`
    in execution order. `params` records how the schedule was built (p, m, v, memory caps).
    """

    name: str
    stages_of_rank: tuple[tuple[int, ...], ...]
    num_microbatches: int
    offsets: np.ndarray
    kinds: np.ndarray
    stages: np.ndarray
    microbatches: np.ndarray
    params: tuple[tuple[str, Any], ...] = field(default=())
    pairs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Positions of the F halves of overlapped pairs (`F&B`): the action right after each is
    the B or BW it runs together with, the forward of one microbatch beside the backward of
    another, each one's communication hidden behind the other's compute (see
    `simulate.durations`)."""

    def __post_init__(self) -> None:
        placement = tuple(tuple(int(s) for s in row) for row in self.stages_of_rank)
        object.__setattr__(self, "stages_of_rank", placement)
        object.__setattr__(self, "params", tuple((str(k), v) for k, v in self.params))
        for name, dtype in (
            ("offsets", np.int64),
            ("kinds", np.int8),
            ("stages", np.int32),
            ("microbatches", np.int32),
        ):
            object.__setattr__(self, name, _frozen(getattr(self, name), dtype))
        p = len(placement)
        if p < 1 or any(len(row) == 0 for row in placement):
            raise ValueError("every rank must hold at least one stage")
        flat = sorted(s for row in placement for s in row)
        if flat != list(range(len(flat))):
            raise ValueError(
                f"stages_of_rank must place each stage 0..S-1 on exactly one rank, got {placement}"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        n = self.kinds.size
        if self.stages.size != n or self.microbatches.size != n:
            raise ValueError("kinds, stages and microbatches must have the same length")
        off = self.offsets
        if off.size != p + 1 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 0):
            raise ValueError("offsets must rise from 0 to the number of actions, one per rank + 1")
        if n:
            if self.kinds.min() < 0 or self.kinds.max() >= len(Kind):
                raise ValueError("unknown action kind code")
            if self.stages.min() < 0 or self.stages.max() >= len(flat):
                raise ValueError(f"action stage out of range 0..{len(flat) - 1}")
            if self.microbatches.min() < 0 or self.microbatches.max() >= self.num_microbatches:
                raise ValueError(f"action microbatch out of range 0..{self.num_microbatches - 1}")
        pairs = np.array(self.pairs, dtype=np.int64)  # a copy the caller cannot change
        if pairs.size > 1 and not np.all(pairs[1:] > pairs[:-1]):
            pairs = np.unique(pairs)  # (builders give them sorted: no hashing of millions)
        pairs.flags.writeable = False
        object.__setattr__(self, "pairs", pairs)
        if pairs.size:
            self._check_pairs()

    def _check_pairs(self) -> None:
        pairs = self.pairs
        n = self.kinds.size
        if pairs[0] < 0 or pairs[-1] + 1 >= n:
            raise ValueError("a pair position lies outside the actions")
        rank = np.searchsorted(self.offsets, pairs, side="right") - 1
        ok = (
            (self.kinds[pairs] == Kind.F)
            & np.isin(self.kinds[pairs + 1], (Kind.B, Kind.BW))
            & (pairs + 1 < self.offsets[rank + 1])
        )
        ok[1:] &= np.diff(pairs) > 1  # an action is in one pair at most
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            i, r = int(pairs[bad]), int(rank[bad])
            got = " ".join(str(self._action_at(j)) for j in range(i, min(i + 2, n)))
            raise ValueError(
                f"rank {r}: a pair is an F followed by the B or BW of another microbatch or "
                f"stage on the same rank, as 'sFi&tBj' (got {got!r})"
            )

    # ------------------------------------------------------------ shape

    @property
    def num_ranks(self) -> int:
        return len(self.stages_of_rank)

    @property
    def num_stages(self) -> int:
        return sum(len(row) for row in self.stages_of_rank)

    @property
    def num_actions(self) -> int:
        return int(self.kinds.size)

    @cached_property
    def rank_of_stage(self) -> np.ndarray:
        """Stage -> rank that holds it (read-only array)."""
        out = np.empty(self.num_stages, dtype=np.int64)
        for r, row in enumerate(self.stages_of_rank):
            out[list(row)] = r
        out.flags.writeable = False
        return out

    @cached_property
    def is_lowered(self) -> bool:
        """True when explicit SEND/RECV actions are present (see `lower`)."""
        return bool(np.any(self.kinds >= Kind.SEND_F))

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def _action_at(self, i: int) -> Action:
        return Action(int(self.stages[i]), Kind(int(self.kinds[i])), int(self.microbatches[i]))

    def rank_pairs(self, rank: int) -> frozenset[int]:
        """Positions within `rank_actions(rank)` of the F halves of its pairs."""
        lo, hi = int(self.offsets[rank]), int(self.offsets[rank + 1])
        mine = self.pairs[(self.pairs >= lo) & (self.pairs < hi)]
        return frozenset(int(i) - lo for i in mine)

    def unpaired(self) -> Schedule:
        """The same actions in the same order, each run on its own (no overlapped pairs)."""
        if not self.pairs.size:
            return self
        return dataclasses.replace(self, pairs=np.zeros(0, dtype=np.int64))

    # ------------------------------------------------------------ actions

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        """The ordered actions of one rank (what that rank's interpreter walks)."""
        lo, hi = int(self.offsets[rank]), int(self.offsets[rank + 1])
        kinds = [Kind(k) for k in range(len(Kind))]
        return tuple(
            Action(s, kinds[k], mb)
            for k, s, mb in zip(
                self.kinds[lo:hi].tolist(),
                self.stages[lo:hi].tolist(),
                self.microbatches[lo:hi].tolist(),
                strict=True,
            )
        )

    @cached_property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """Per-rank tuples of `Action` (built on first use; costly for huge schedules)."""
        return tuple(self.rank_actions(r) for r in range(self.num_ranks))

    def rank_strings(self, rank: int) -> list[str]:
        return [str(a) for a in self.rank_actions(rank)]

    # ------------------------------------------------------------ construction

    @classmethod
    def from_actions(
        cls,
        actions: Sequence[Iterable[Action | str]],
        *,
        name: str = "custom",
        stages_of_rank: Sequence[Sequence[int]] | None = None,
        num_microbatches: int | None = None,
        params: Iterable[tuple[str, Any]] = (),
    ) -> Schedule:
        """Build from per-rank action lists (Actions or strings such as '2F0').

        Without `stages_of_rank` the placement is read off the actions: the stages each rank's
        actions name. Without `num_microbatches` it is the largest microbatch + 1.
        """
        kinds: list[int] = []
        stages: list[int] = []
        mbs: list[int] = []
        offsets = [0]
        seen: list[list[int]] = []
        pairs: list[int] = []
        for row in actions:
            row_stages: list[int] = []
            for item in row:
                if isinstance(item, str) and "&" in item:
                    halves = item.split("&")
                    if len(halves) != 2:
                        raise ValueError(f"{item!r}: a pair joins exactly two actions, 'sFi&tBj'")
                    pairs.append(len(kinds))
                    parsed = [Action.parse(h) for h in halves]
                else:
                    parsed = [Action.parse(item) if isinstance(item, str) else item]
                for a in parsed:
                    kinds.append(int(a.kind))
                    stages.append(int(a.stage))
                    mbs.append(int(a.microbatch))
                    if a.stage not in row_stages:
                        row_stages.append(int(a.stage))
            offsets.append(len(kinds))
            seen.append(sorted(row_stages))
        if stages_of_rank is None:
            stages_of_rank = seen
        if num_microbatches is None:
            num_microbatches = max(mbs) + 1 if mbs else 1
        return cls(
            name=name,
            stages_of_rank=tuple(tuple(r) for r in stages_of_rank),
            num_microbatches=num_microbatches,
            offsets=np.asarray(offsets, dtype=np.int64),
            kinds=np.asarray(kinds, dtype=np.int8),
            stages=np.asarray(stages, dtype=np.int32),
            microbatches=np.asarray(mbs, dtype=np.int32),
            params=tuple(params),
            pairs=np.asarray(pairs, dtype=np.int64),
        )

    @classmethod
    def from_arrays(
        cls,
        name: str,
        stages_of_rank: Sequence[Sequence[int]],
        num_microbatches: int,
        per_rank: Sequence[tuple[np.ndarray, ...]],
        params: Iterable[tuple[str, Any]] = (),
    ) -> Schedule:
        """Build from per-rank (kinds, stages, microbatches) arrays: what generators use; a
        fourth array of booleans, where given, marks the F halves of overlapped pairs."""
        sizes = [len(t[0]) for t in per_rank]
        offsets = np.zeros(len(per_rank) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])

        def cat(i: int, dtype: Any) -> np.ndarray:
            parts = [np.asarray(t[i], dtype=dtype) for t in per_rank]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        return cls(
            name=name,
            stages_of_rank=tuple(tuple(r) for r in stages_of_rank),
            num_microbatches=num_microbatches,
            offsets=offsets,
            kinds=cat(0, np.int8),
            stages=cat(1, np.int32),
            microbatches=cat(2, np.int32),
            params=tuple(params),
            pairs=np.concatenate(
                [
                    np.flatnonzero(np.asarray(t[3], dtype=bool)) + offsets[r]
                    for r, t in enumerate(per_rank)
                    if len(t) > 3
                ]
                or [np.zeros(0, dtype=np.int64)]
            ),
        )

    def replace_actions(
        self,
        offsets: np.ndarray,
        kinds: np.ndarray,
        stages: np.ndarray,
        mbs: np.ndarray,
        pairs: np.ndarray | None = None,
    ) -> Schedule:
        """Same placement, name and params, new action arrays (lowering, stripping) and the
        pairs' positions in them."""
        return Schedule(
            name=self.name,
            stages_of_rank=self.stages_of_rank,
            num_microbatches=self.num_microbatches,
            offsets=offsets,
            kinds=kinds,
            stages=stages,
            microbatches=mbs,
            params=self.params,
            pairs=np.zeros(0, dtype=np.int64) if pairs is None else pairs,
        )

    # ------------------------------------------------------------ equality and display

    def _key(self) -> tuple:
        return (
            self.name,
            self.stages_of_rank,
            self.num_microbatches,
            self.params,
            self.offsets.tobytes(),
            self.kinds.tobytes(),
            self.stages.tobytes(),
            self.microbatches.tobytes(),
            self.pairs.tobytes(),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def fingerprint(self) -> str:
        """A short digest of the actions and placement (not the name): ranks of one job
        compare theirs once at start, so a rank that read another deck or schedule file fails
        before it sends a message the others do not expect."""
        digest = hashlib.sha256(repr((self.stages_of_rank, self.num_microbatches)).encode())
        for arr in (self.offsets, self.kinds, self.stages, self.microbatches):
            digest.update(np.ascontiguousarray(arr).tobytes())
        if self.pairs.size:  # (unpaired schedules keep the digest they always had)
            digest.update(b"pairs" + np.ascontiguousarray(self.pairs).tobytes())
        return digest.hexdigest()[:16]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params)
        return (
            f"Schedule({self.name!r}, ranks={self.num_ranks}, stages={self.num_stages}, "
            f"microbatches={self.num_microbatches}, actions={self.num_actions}"
            + (f", {args}" if args else "")
            + (f", pairs={self.pairs.size}" if self.pairs.size else "")
            + ")"
        )


# ---------------------------------------------------------------- CSV form

_HEADER = "# hpcpipe schedule"


def _placement_text(stages_of_rank: tuple[tuple[int, ...], ...]) -> str:
    return ";".join("+".join(str(s) for s in row) for row in stages_of_rank)


def to_csv(schedule: Schedule) -> str:
    """One row per rank, one action string per cell; '#' lines carry name and placement.

    Example (1F1B, p=2, m=2)::

        # hpcpipe schedule name=1f1b microbatches=2 placement=0;1
        0F0,0F1,0BW0,0BW1
        1F0,1BW0,1F1,1BW1
    """
    head = (
        f"{_HEADER} name={schedule.name} microbatches={schedule.num_microbatches} "
        f"placement={_placement_text(schedule.stages_of_rank)}"
    )
    out = io.StringIO()
    out.write(head + "\n")
    writer = csv.writer(out, lineterminator="\n")
    for r in range(schedule.num_ranks):
        cells, pairs = schedule.rank_strings(r), schedule.rank_pairs(r)
        for i in sorted(pairs, reverse=True):  # 'F&B' in one cell
            cells[i : i + 2] = [f"{cells[i]}&{cells[i + 1]}"]
        writer.writerow(cells)
    return out.getvalue()


def from_csv(text: str, *, name: str | None = None, source: str = "<csv>") -> Schedule:
    """Parse the CSV form. Lines starting with '#' are comments; the header comment written by
    `to_csv` (name=, microbatches=, placement=) is optional: without it the placement is read
    off the actions. Errors name the line and cell."""
    meta: dict[str, str] = {}
    rows: list[list[str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            if stripped.startswith(_HEADER):
                for token in stripped[len(_HEADER) :].split():
                    key, sep, value = token.partition("=")
                    if sep:
                        meta[key] = value
            continue
        cells = next(csv.reader([line]))
        row = []
        for col, cell in enumerate(cells, start=1):
            if not cell.strip():
                continue
            try:
                if cell.count("&") > 1:
                    raise ValueError(f"{cell!r}: a pair joins exactly two actions, 'sFi&tBj'")
                for half in cell.split("&"):
                    Action.parse(half)
            except ValueError as exc:
                raise ValueError(f"{source}: line {lineno}, cell {col}: {exc}") from None
            row.append(cell.strip())
        rows.append(row)
    if not rows:
        raise ValueError(f"{source}: no ranks (expected one row of actions per rank)")
    placement = None
    if "placement" in meta:
        try:
            placement = [[int(s) for s in part.split("+")] for part in meta["placement"].split(";")]
        except ValueError:
            raise ValueError(
                f"{source}: placement={meta['placement']!r} must look like '0+7;1+6' "
                "(stages of each rank, ranks separated by ';')"
            ) from None
        if len(placement) != len(rows):
            raise ValueError(
                f"{source}: placement names {len(placement)} ranks but there are "
                f"{len(rows)} rows of actions"
            )
    m = int(meta["microbatches"]) if "microbatches" in meta else None
    try:
        return Schedule.from_actions(
            rows,
            name=name or meta.get("name", "csv"),
            stages_of_rank=placement,
            num_microbatches=m,
            params=(("source", source),),
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def write_csv(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(to_csv(schedule), encoding="utf-8")


def read_csv(path: str | Path, *, name: str | None = None) -> Schedule:
    """Load a hand-written or exported schedule (see `to_csv` for the format)."""
    return from_csv(Path(path).read_text(encoding="utf-8"), name=name, source=str(path))
