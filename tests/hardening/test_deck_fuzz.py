"""Fuzzed input decks: every mutation of a real deck either loads and passes every check made
before MPI work (`hpcpipe run --dry-run` runs the same ones), or fails with ConfigError whose
message names the key; never another exception, never a hang.

Mutations start from the shipped decks (inputs/*.toml and the built-in one) and the section
registry of hpcpipe.config (types, minimum, maximum, choices): wrong types, out-of-range, huge,
negative and non-finite numbers, empty and unicode strings, unknown keys, sections and choices,
cross-section combinations of plausible values (pp * dp vs the world, microbatches vs schedule
and batch, stages vs layers, experts vs ep, KBA blocking vs the mesh), `--set` overrides, and
broken TOML (truncated, invalid bytes). A fixed sample covering each class also goes through
the real CLI: `hpcpipe run DECK --dry-run`, and `mpiexec -n 2 hpcpipe run DECK`.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import itertools
import json
import math
import shutil
import signal
import tempfile
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcpipe.config import DEFAULT_DECK, ConfigError, _available_sections, load_config
from hpcpipe.preflight import check_deck

ROOT = Path(__file__).resolve().parents[2]
DECKS = {p.name: tomllib.loads(p.read_text()) for p in sorted((ROOT / "inputs").glob("*.toml"))}
DECKS["quickstart"] = tomllib.loads(DEFAULT_DECK.read_text())
SECTIONS = _available_sections()
FIELDS = {
    name: {f.name: (f, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls)}
    for name, cls in SECTIONS.items()
}
OPTIONS = sorted((s, k) for s, keys in FIELDS.items() for k in keys)
EXAMPLE_SECONDS = 20  # one example taking longer is a hang


# ---------------------------------------------------------------- TOML writer


def _toml_string(s: str) -> str:
    """A TOML basic string: JSON escapes are TOML escapes; DEL must be escaped too."""
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, datetime.date | datetime.time):
        return v.isoformat()
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def to_toml(deck: dict[str, Any]) -> str:
    """Top-level tables as [sections]; a non-table top-level value stays a bare key."""
    head, body = [], []
    for name, table in deck.items():
        if isinstance(table, dict):
            body.append(f"[{_toml_string(name)}]")
            body += [f"{_toml_string(k)} = {_toml_value(v)}" for k, v in table.items()]
            body.append("")
        else:
            head.append(f"{_toml_string(name)} = {_toml_value(table)}")
    return "\n".join([*head, "", *body]) + "\n"


# ---------------------------------------------------------------- strategies

HUGE = [2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63), 10**400]
WEIRD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324, 1e-300]
WEIRD_STRINGS = ["", " ", "\u00e9t\u00e9", "\U0001f680", "a\x00b", "\x7f", "x" * 5000, "ep,ep,pp"]
SCALARS = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from(HUGE),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WEIRD_FLOATS),
    st.booleans(),
    st.text(max_size=20),
    st.sampled_from(WEIRD_STRINGS),
    st.dates(),
)
ANY_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _base_item(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, type(int | None)):
        return next(a for a in args if a is not type(None))
    return tp


@st.composite
def wrong_type(draw: st.DrawFn, tp: Any) -> Any:
    """A value of another TOML type than `tp` wants (str for int, list for scalar, ...)."""
    base = _base_item(tp)
    if typing.get_origin(base) is tuple:
        return draw(
            st.one_of(
                st.text(max_size=8),
                st.booleans(),
                st.dictionaries(st.text(max_size=4), st.integers(), min_size=1, max_size=2),
            )
        )
    options = {
        int: st.one_of(
            st.text(max_size=8), st.booleans(), st.floats(), st.lists(st.integers(), max_size=2)
        ),
        float: st.one_of(st.text(max_size=8), st.booleans(), st.lists(st.floats(), max_size=2)),
        bool: st.one_of(st.integers(), st.text(max_size=8), st.sampled_from(["true", "yes"])),
        str: st.one_of(st.integers(), st.floats(), st.booleans(), st.lists(st.text(), max_size=2)),
    }[base]
    return draw(st.one_of(options, st.dictionaries(st.text(max_size=4), SCALARS, max_size=2)))


@st.composite
def bad_number(draw: st.DrawFn, field: dataclasses.Field, tp: Any) -> Any:
    """Out of range, negative, zero, huge or non-finite numbers for a numeric option."""
    lo, hi = field.metadata.get("minimum"), field.metadata.get("maximum")
    base = _base_item(tp)
    item = typing.get_args(base)[0] if typing.get_origin(base) is tuple else base
    near = [x for x in (lo, hi) if x is not None]
    edges = [lo - 1 if lo is not None else -1, hi + 1 if hi is not None else 2**63]
    if item is float:
        edges += [x - 1e-9 for x in near] + [x + 1e-9 for x in near]
    value = draw(
        st.one_of(
            st.sampled_from([*edges, 0, -1, *HUGE]),
            st.sampled_from(WEIRD_FLOATS) if item is not int else st.sampled_from(HUGE),
            st.integers(-(2**70), 2**70),
        )
    )
    if typing.get_origin(base) is tuple:
        return draw(st.sampled_from([[value], [1, value], value, []]))
    return value


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


STAGES_PER_RANK = {"zb-v": 2, "v-half": 2, "v-min": 2, "dualpipe-v": 2}


@st.composite
def coherent(draw: st.DrawFn, world: int) -> dict[str, dict[str, Any]]:
    """A deck meant to pass every check on `world` ranks: the success path runs the whole
    preflight (schedule, search, partition, data, KBA plan), where a stray exception hides."""
    workload = draw(st.sampled_from(["train", "train", "train", "sweep", "topology"]))
    pp = draw(st.sampled_from(_divisors(world)))
    dp = world // pp
    ep = draw(st.sampled_from([e for e in _divisors(dp) if e <= 4]))
    deck: dict[str, dict[str, Any]] = {
        "run": {"workload": workload, "steps": draw(st.integers(1, 3))},
        "topology": {
            "pp": pp,
            "dp": draw(st.sampled_from([0, dp])),
            "ep": ep,
            "ranks_per_node": draw(st.sampled_from([0, 1, 2, world])),
            "order": draw(st.sampled_from(["ep,dp,pp", "dp,ep,pp", "pp,dp,ep"])),
        },
    }
    if workload == "sweep":
        px = draw(st.sampled_from(_divisors(world)))
        py = world // px
        groups = draw(st.integers(1, 2))
        quad = draw(st.sampled_from(["level-symmetric", "product"]))
        order = draw(st.sampled_from([2, 4, 6, 8]))
        azimuthal = draw(st.integers(0, 3)) if quad == "product" else 0
        dirs = (
            order * (order + 2) // 8
            if quad == "level-symmetric"
            else (order // 2) * (azimuthal or max(1, order // 2))
        )
        nz = draw(st.integers(1, 6))
        deck["sweep"] = {
            "px": px,
            "py": py,
            "nx": px * draw(st.integers(1, 3)),
            "ny": py * draw(st.integers(1, 3)),
            "nz": nz,
            "groups": groups,
            "sigma_t": [[1.0] * groups],
            "sigma_s": [[[0.2] * groups for _ in range(groups)]],
            "source": [[1.0] * groups],
            "quadrature": quad,
            "order": order,
            "azimuthal": azimuthal,
            "z_block": draw(st.sampled_from([0, *_divisors(nz)])),
            "angle_block": draw(st.sampled_from([0, *_divisors(dirs)])),
            "octant_order": draw(st.sampled_from(["auto", "nearest", "yx", "xy"])),
            "max_iterations": draw(st.integers(1, 5)),
        }
        return deck
    schedule = draw(st.sampled_from([*FIELDS["pipeline"]["schedule"][0].metadata["choices"]]))
    if schedule == "csv":
        schedule = "auto"
    v = draw(st.integers(1, 3)) if schedule == "interleaved-1f1b" else None
    m = pp * draw(st.integers(1, 3)) * (2 if schedule == "dualpipe-v" else 1)
    layers = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["gpt", "gpt", "mlp"]))
    d_model = draw(st.sampled_from([4, 8, 16]))
    pipeline: dict[str, Any] = {"schedule": schedule, "microbatches": m}
    if v is not None:
        pipeline["virtual_stages"] = v
    if schedule == "auto":
        pipeline["memory_budget"] = draw(st.sampled_from([0.5, 2.0, 8.0]))
    stages = pp * (v or STAGES_PER_RANK.get(schedule, 1))
    deck["pipeline"] = pipeline
    deck["model"] = {
        "kind": kind,
        "layers": layers,
        "d_model": d_model,
        "n_heads": draw(st.sampled_from(_divisors(d_model))),
        "d_ff": draw(st.sampled_from([4, 16])),
        "vocab": draw(st.sampled_from([8, 16, 32])),
        "seq_len": draw(st.integers(2, 12)),
    }
    deck["data"] = {
        "global_batch": dp * m * draw(st.integers(1, 2)),
        "markov_order": draw(st.integers(1, 2)),
    }
    if draw(st.booleans()):
        units = layers + 2
        cuts = sorted(draw(st.lists(st.integers(1, max(1, units - 1)), max_size=stages)))
        bounds = [0, *sorted(set(cuts)), units]
        deck["train"] = {"stage_units": [b - a for a, b in itertools.pairwise(bounds)]}
    else:
        deck["train"] = {"partition": draw(st.sampled_from(["flops", "params"]))}
    if kind == "gpt" and draw(st.booleans()):
        experts = ep * draw(st.integers(1, 4))
        deck["moe"] = {
            "experts": experts,
            "top_k": draw(st.integers(1, min(2, experts))),
            "every": draw(st.integers(1, layers)),
            "dropless": draw(st.booleans()),
        }
    return deck


# (section, key, plausible values) for perturbing a coherent deck
PERTURB = [
    ("run", "workload", st.sampled_from(["train", "sweep", "topology"])),
    ("topology", "pp", st.integers(1, 8)),
    ("topology", "dp", st.integers(0, 8)),
    ("topology", "ep", st.integers(1, 4)),
    ("topology", "ranks_per_node", st.integers(0, 8)),
    ("topology", "cross_node", st.sampled_from(["warn", "error", "ignore"])),
    ("topology", "intra_node", st.sampled_from([[], ["ep"], ["ep", "dp"], ["pp"]])),
    ("pipeline", "schedule", st.sampled_from(["1f1b", "gpipe", "zb-v", "dualpipe-v", "csv"])),
    ("pipeline", "microbatches", st.integers(1, 16)),
    ("pipeline", "virtual_stages", st.integers(1, 4)),
    ("pipeline", "memory_budget", st.floats(0, 8)),
    ("pipeline", "t_f", st.lists(st.floats(0, 4), min_size=1, max_size=5)),
    ("pipeline", "activation_memory", st.lists(st.floats(0, 4), min_size=1, max_size=5)),
    ("pipeline", "comm_bandwidth", st.floats(0, 10)),
    (
        "pipeline",
        "schedule_csv",
        st.sampled_from(["README.md", "no/such.csv", "inputs", "/dev/zero"]),
    ),
    ("data", "global_batch", st.integers(1, 64)),
    ("data", "markov_order", st.integers(1, 8)),
    ("data", "kind", st.sampled_from(["synthetic", "text", "hdf5"])),
    ("data", "path", st.sampled_from(["", "README.md", "no/such/file", "inputs", "/dev/null"])),
    ("model", "kind", st.sampled_from(["gpt", "mlp"])),
    ("model", "layers", st.integers(1, 10)),
    ("model", "d_model", st.sampled_from([1, 2, 6, 8, 16])),
    ("model", "n_heads", st.integers(1, 5)),
    ("model", "vocab", st.sampled_from([2, 16, 255, 256])),
    ("model", "seq_len", st.integers(1, 16)),
    ("moe", "experts", st.integers(0, 8)),
    ("moe", "top_k", st.integers(1, 2)),
    ("moe", "every", st.integers(1, 6)),
    ("moe", "capacity_factor", st.floats(-1, 3)),
    ("train", "stage_units", st.lists(st.integers(1, 6), max_size=5)),
    ("sweep", "px", st.integers(1, 4)),
    ("sweep", "py", st.integers(1, 4)),
    ("sweep", "nx", st.integers(1, 16)),
    ("sweep", "nz", st.integers(1, 8)),
    ("sweep", "z_block", st.integers(0, 8)),
    ("sweep", "angle_block", st.integers(0, 6)),
    ("sweep", "quadrature", st.sampled_from(["level-symmetric", "product"])),
    ("sweep", "order", st.sampled_from([2, 3, 4, 6, 8, 10])),
    ("sweep", "groups", st.integers(1, 3)),
    ("sweep", "incident_faces", st.sampled_from([["x-"], ["x-", "x-"], ["q+"]])),
]


@st.composite
def combination(draw: st.DrawFn, world: int) -> dict[str, dict[str, Any]]:
    """A coherent deck for `world`, with up to three keys then set to other plausible values
    (pp * dp vs the world, microbatches vs schedule and batch, stages vs layers, ...)."""
    deck = draw(coherent(world))
    for section, key, values in draw(st.lists(st.sampled_from(PERTURB), max_size=3)):
        deck.setdefault(section, {})[key] = draw(values)
    return deck


@st.composite
def mutation(draw: st.DrawFn, world: int) -> tuple[str, dict[str, Any], list[str], bytes | None]:
    """(class, deck, --set overrides, raw bytes when the deck is not even TOML)."""
    base_name = draw(st.sampled_from(sorted(DECKS)))
    deck = json.loads(json.dumps(DECKS[base_name], default=str))  # deep copy, dates as text
    kind = draw(
        st.sampled_from(
            ["type", "number", "choice", "string", "any", "unknown", "set", "syntax"]
            + ["combo"] * 4
        )
    )
    section, key = draw(st.sampled_from(OPTIONS))
    field, tp = FIELDS[section][key]
    value: Any = None
    if kind == "number" and _base_item(tp) is str:
        kind = "type"
    if kind == "choice" and field.metadata.get("choices") is None:
        kind = "string"
    if kind == "type":
        value = draw(wrong_type(tp))
    elif kind == "number":
        value = draw(bad_number(field, tp))
    elif kind == "choice":
        value = draw(st.one_of(st.text(max_size=12), st.sampled_from(WEIRD_STRINGS)))
    elif kind == "string":
        value = draw(st.one_of(st.sampled_from(WEIRD_STRINGS), st.text(max_size=30)))
    elif kind == "any":
        value = draw(ANY_VALUE)
    elif kind == "unknown":
        name = draw(st.one_of(st.text(min_size=1, max_size=10), st.sampled_from(["ppp", "Pp"])))
        if draw(st.booleans()) and name not in SECTIONS:
            deck[name] = {"x": draw(SCALARS)} if draw(st.booleans()) else draw(SCALARS)
        elif name not in FIELDS[section]:
            deck.setdefault(section, {})[name] = draw(SCALARS)
        return kind, deck, [], None
    elif kind == "combo":
        return kind, draw(combination(world)), [], None
    elif kind == "set":
        raw = draw(st.one_of(st.builds(_toml_value, SCALARS), st.text(max_size=12)))
        target = draw(st.sampled_from([f"{section}.{key}", section, f"{section}.{key}.x", ""]))
        return kind, deck, [f"{target}={raw}" if draw(st.booleans()) else target], None
    elif kind == "syntax":
        text = to_toml(deck).encode()
        cut = draw(st.integers(0, len(text)))
        how = draw(st.sampled_from(["truncate", "bytes", "flip", "nest"]))
        if how == "truncate":
            data = text[:cut]
        elif how == "bytes":
            data = text[:cut] + draw(st.binary(min_size=1, max_size=8)) + text[cut:]
        elif how == "flip":
            data = text[:cut] + bytes([draw(st.integers(0, 255))]) + text[cut + 1 :]
        else:
            depth = draw(st.integers(100, 5000))
            data = text + b"\n[zz]\nv = " + b"[" * depth + b"]" * depth + b"\n"
        return kind, deck, [], data
    # a whole section of the wrong type, now and then
    if draw(st.integers(0, 19)) == 0:
        deck[section] = value
    else:
        deck.setdefault(section, {})
        if not isinstance(deck[section], dict):
            deck[section] = {}
        deck[section][key] = value
    return kind, deck, [], None


# ---------------------------------------------------------------- the property

WORK = Path(tempfile.mkdtemp(prefix="hpcpipe-fuzz-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang(f"one example took more than {EXAMPLE_SECONDS}s")


def names_a_key(exc: ConfigError) -> bool:
    """The message names `section.key` (or the section, or the unknown key or section)."""
    message = str(exc)
    if exc.source == "--set":  # a malformed override, quoted in the message
        return "must" in message
    if not exc.key:  # a file-level problem: it must say what is wrong with the file
        return any(
            why in message
            for why in ("not valid TOML", "not a usable TOML", "not UTF-8", "input deck")
        )
    if exc.key not in message:
        return False
    head = exc.key.split(".")[0]
    if head in ("--set", "launcher"):
        return True
    if head not in SECTIONS:
        return "is not a known section" in message
    if "." not in exc.key:
        return True
    name = exc.key.split(".", 1)[1].split("[")[0]
    return name in FIELDS[head] or "is not a known key" in message


def check_one(deck: dict[str, Any], overrides: list[str], data: bytes | None, world: int) -> str:
    """Load and check like `hpcpipe run --dry-run` on `world` ranks: "ok" or the error."""
    path = WORK / "deck.toml"
    path.write_bytes(data if data is not None else to_toml(deck).encode())
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, EXAMPLE_SECONDS)
    try:
        config = load_config(path, overrides)
        check_deck(config, world, config.topology.ranks_per_node or world)
        return "ok"
    except ConfigError as exc:
        assert names_a_key(exc), f"message does not name the key {exc.key!r}: {exc}"
        return str(exc)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_any_deck_loads_or_names_the_key(data):
    world = data.draw(st.sampled_from([1, 2, 4, 6, 8]), label="world")
    _kind, deck, overrides, raw = data.draw(mutation(world), label="case")
    check_one(deck, overrides, raw, world)


def test_every_shipped_deck_passes_on_its_world():
    """The mutations start from decks that are valid somewhere: the checks must not reject
    the shipped decks on the world each is written for."""
    worlds = {
        "topology_tiny.toml": 8,
        "sweep_tiny.toml": 1,
        "sweep_kobayashi.toml": 1,
        "sweep_kripke.toml": 1,
    }
    planning_only = {"layout_moe_gpt32.toml": 64}  # GPU-node sized: for `plan --search`
    for name, deck in DECKS.items():
        got = check_one(deck, [], None, planning_only.get(name, worlds.get(name, 4)))
        if name in planning_only:  # every check passes but this machine's memory
            assert "is too large" in got and "more than this node's" in got, (name, got)
        else:
            assert got == "ok", name


# ---------------------------------------------------------------- fixed decks through the CLI

BASE: dict[str, dict[str, Any]] = {
    "run": {"workload": "train", "steps": 1},
    "topology": {"pp": 1, "dp": 0, "ranks_per_node": 0},
    "model": {"layers": 2, "d_model": 8, "n_heads": 2, "d_ff": 16, "vocab": 16, "seq_len": 8},
    "data": {"global_batch": 8},
    "pipeline": {"schedule": "1f1b", "microbatches": 2},
}
"""A small training deck valid on 1 and 2 ranks; each case below breaks one thing."""

# (class, {section: {key: value}} merged into BASE, or raw text for broken TOML, key expected)
CLI_CASES: list[tuple[str, dict[str, dict[str, Any]] | bytes, str]] = [
    ("string for int", {"train": {"recv_lookahead": "four"}}, "train.recv_lookahead"),
    ("table for scalar", {"checkpoint": {"every": {"n": 3}}}, "checkpoint.every"),
    ("above maximum", {"moe": {"experts": 1_000_000}}, "moe.experts"),
    ("NaN", {"optim": {"weight_decay": math.nan}}, "optim.weight_decay"),
    ("64-bit overflow", {"train": {"bucket_mb": 10**20}}, "train.bucket_mb"),
    ("does not fit memory", {"model": {"d_model": 2**62}}, "model.d_model"),
    ("unknown key", {"train": {"verfy": True}}, "train.verfy"),
    ("unknown section", {"trainer": {"verify": True}}, "trainer"),
    ("unknown choice", {"device": {"dtype": "bfloat16"}}, "device.dtype"),
    ("unicode string", {"checkpoint": {"layout": "\u00e9"}}, "checkpoint.layout"),
    ("pp does not divide the world", {"topology": {"pp": 3}}, "topology.pp"),
    ("batch vs microbatches", {"data": {"global_batch": 7}}, "data.global_batch"),
    (
        "schedule vs microbatches",
        {"pipeline": {"schedule": "dualpipe-v", "microbatches": 1}},
        "pipeline.schedule",
    ),
    ("sweep nx vs px", {"sweep": {"px": 3, "nx": 8}}, "sweep.nx"),
    ("truncated TOML", b"[run]\nsteps = 1\n[optim\nlr = 0.1\n", ""),
    ("invalid bytes", b"[run]\nsteps = \xff\xfe1\n", ""),
]


def _cli_deck(tmp_path: Path, change: dict[str, dict[str, Any]] | bytes) -> Path:
    path = tmp_path / "deck.toml"
    if isinstance(change, bytes):
        path.write_bytes(change)
        return path
    deck = json.loads(json.dumps(BASE))
    deck["run"]["output"] = (tmp_path / "out").as_posix()
    for section, values in change.items():
        deck.setdefault(section, {}).update(values)
    path.write_text(to_toml(deck), encoding="utf-8")
    return path


@pytest.mark.mpi
@pytest.mark.parametrize(("label", "change", "key"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_deck_through_the_cli(cli, mpirun, tmp_path, label, change, key):
    deck = _cli_deck(tmp_path, change)
    for r in (
        cli(["run", str(deck), "--dry-run", "--world", "1"], timeout=60),  # as a 1-rank job
        mpirun(2, ["run", str(deck)], timeout=60),
    ):
        assert r.returncode == 2, r.output
        assert "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("ERROR:") == 1, r.stderr
        assert str(deck) in r.stderr
        if key:
            assert f"{key} " in r.stderr, r.stderr
        else:
            assert "TOML" in r.stderr or "UTF-8" in r.stderr, r.stderr
        assert not (tmp_path / "out").exists(), "bad input must stop before the run directory"


def test_base_deck_of_the_cli_cases_is_valid(tmp_path):
    deck = _cli_deck(tmp_path, {})
    for world in (1, 2):
        assert check_one(tomllib.loads(deck.read_text()), [], None, world) == "ok"
