"""Input decks: TOML files parsed into frozen dataclasses, one per section.

Each component owns a small section dataclass (declared next to the component, built with
`option`) and reads only that section. This module holds the shared machinery: type and range
checks that name the file and the dotted key, `--set section.key=value` overrides, and the
composed `Config` that the CLI hands to a workload.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import stat
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "Config",
    "ConfigError",
    "DeviceConfig",
    "RunConfig",
    "TopologyConfig",
    "dump_toml",
    "load_config",
    "option",
]

DEFAULT_DECK = Path(__file__).parent / "defaults" / "quickstart.toml"


class ConfigError(ValueError):
    """Bad input: the message names the file, the dotted key, what was given and what is allowed."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where} {message}" if key else f"{where}: {message}")

    def __reduce__(self):  # picklable, so one rank can broadcast the error to the others
        return (type(self), (self.source, self.key, self.message))


def option(
    default: Any,
    doc: str,
    *,
    choices: Iterable[Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """A deck setting: default, one-line doc, and the allowed values checked at load time."""
    meta = {
        "doc": doc,
        "choices": tuple(choices) if choices is not None else None,
        "minimum": minimum,
        "maximum": maximum,
    }
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return {
            "str": "a string",
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
        }.get(tp.__name__, tp.__name__)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("nothing" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        item = _type_name(args[0]).removeprefix("a ").removeprefix("an ")
        if item.startswith("list of "):  # "a list of lists of numbers", not "...numberss"
            return f"a list of lists{item.removeprefix('list')}"
        return f"a list of {item}s"
    return str(tp)


INT_LIMIT = 2**63
"""TOML integers are 64-bit; larger ones (which Python's parser accepts) are rejected."""


def _show(value: Any, limit: int = 60) -> str:
    """`repr(value)` for a message, shortened: a fuzzed megabyte string must not flood stderr."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long for str(): Python caps them at 4300 digits
        return "(an integer of more than 4300 digits)"
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def _coerce(value: Any, tp: Any, source: str, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, source, key)
            except ConfigError:
                continue
        raise ConfigError(source, key, f"= {_show(value)} must be {_type_name(tp)}")
    if origin is tuple:
        (item_tp, *_) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and item_tp in (int, float)
            ):
                value = [value]  # a bare number where a list of numbers is expected
            else:
                raise ConfigError(source, key, f"= {_show(value)} must be {_type_name(tp)}")
        return tuple(_coerce(v, item_tp, source, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"= {_show(value)} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, f"= {_show(value)} must be an integer")
        if not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(source, key, f"= {_show(value)} is out of range (64-bit integers)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(source, key, f"= {_show(value)} must be a number")
        if isinstance(value, int) and not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(source, key, f"= {_show(value)} is out of range (64-bit integers)")
        if not math.isfinite(value):
            raise ConfigError(source, key, f"= {_show(value)} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(source, key, f"= {_show(value)} must be a string")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def parse_section(cls: type, table: Mapping[str, Any], source: str, section: str) -> Any:
    """Build the frozen dataclass `cls` from a TOML table, rejecting unknown keys and bad values."""
    if not isinstance(table, Mapping):
        raise ConfigError(source, section, f"= {_show(table)} must be a table ([{section}])")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        key = f"{section}.{unknown[0]}"
        raise ConfigError(
            source, key, f"is not a known key; [{section}] accepts: " + ", ".join(sorted(known))
        )
    values = {}
    for name, f in known.items():
        key = f"{section}.{name}"
        if name not in table:
            continue
        value = _coerce(table[name], hints[name], source, key)
        meta = f.metadata
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if meta.get("choices") is not None and item not in meta["choices"]:
                allowed = ", ".join(repr(c) for c in meta["choices"])
                raise ConfigError(source, key, f"= {_show(item)} is not one of {allowed}")
            if meta.get("minimum") is not None and item is not None and item < meta["minimum"]:
                raise ConfigError(source, key, f"= {_show(item)} must be >= {meta['minimum']}")
            if meta.get("maximum") is not None and item is not None and item > meta["maximum"]:
                raise ConfigError(source, key, f"= {_show(item)} must be <= {meta['maximum']}")
        values[name] = value
    try:
        obj = cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:  # cross-field checks in __post_init__ raise ValueError("key: why")
        key, _, why = str(exc).partition(": ")
        raise ConfigError(source, f"{section}.{key}", why) from exc
    return obj


# ---------------------------------------------------------------- core sections


@dataclass(frozen=True)
class RunConfig:
    """[run]: what to run and where its outputs go."""

    workload: str = option(
        "topology",
        "which workload runs: topology check, train, or sweep",
        choices=("topology", "train", "sweep"),
    )
    steps: int = option(
        1, "optimizer steps (train); the sweep iterates to sweep.tolerance", minimum=1
    )
    seed: int = option(1234, "seed for every random stream (init, data, routing)", minimum=0)
    output: str = option("runs/default", "run directory: config.toml, metrics.h5, trace.h5, ...")
    log_every: int = option(1, "rank-0 progress line every N steps", minimum=1)
    watchdog_s: float = option(
        600.0,
        "seconds one step, sweep iteration or checkpoint may take before the job is declared "
        "hung: every rank reports its current action and the job aborts; 0 = off",
        minimum=0.0,
    )


@dataclass(frozen=True)
class TopologyConfig:
    """[topology]: parallel degrees and how they map onto nodes."""

    pp: int = option(1, "pipeline-parallel degree (stages across ranks)", minimum=1)
    dp: int = option(0, "data-parallel degree; 0 = whatever is left of the world size", minimum=0)
    ep: int = option(
        1, "expert-parallel degree; divides dp (expert groups live in a dp replica)", minimum=1
    )
    order: str = option("ep,dp,pp", "dims innermost first; the innermost gets consecutive ranks")
    ranks_per_node: int = option(
        0, "0 = discover nodes from MPI; N = virtual nodes of N ranks", minimum=0
    )
    intra_node: tuple[str, ...] = option(("ep",), "dims whose groups should stay inside a node")
    cross_node: str = option(
        "warn",
        "what to do when an intra_node group crosses nodes",
        choices=("warn", "error", "ignore"),
    )

    def __post_init__(self) -> None:
        from hpcpipe.topology import DIMS

        dims = [d.strip() for d in self.order.split(",")]
        if sorted(dims) != sorted(DIMS):
            raise ValueError(
                f"order: = {self.order!r} must list each of {','.join(DIMS)} once "
                "(innermost first), e.g. 'ep,dp,pp'"
            )
        for d in self.intra_node:
            if d not in DIMS:
                raise ValueError(f"intra_node: = {d!r} is not one of {', '.join(DIMS)}")
        if self.dp and self.dp % self.ep:
            raise ValueError(
                f"ep: = {self.ep} must divide dp = {self.dp} "
                "(expert groups live inside data-parallel replicas)"
            )


@dataclass(frozen=True)
class DeviceConfig:
    """[device]: where arrays live and how device buffers reach MPI."""

    kind: str = option(
        "cpu", "cpu (NumPy) or cuda (CuPy, one GPU per local rank)", choices=("cpu", "cuda")
    )
    cuda_aware: str = option(
        "auto",
        "pass device buffers to MPI directly: auto-detect, on, off",
        choices=("auto", "on", "off"),
    )
    dtype: str = option(
        "float32",
        "floating-point type of parameters and activations",
        choices=("float32", "float64"),
    )
    synthetic_us_per_row: float = option(
        0.0,
        "0: units take as long as their arithmetic. > 0: a synthetic device for timing "
        "pipelines of more ranks than cores: each unit's F, B and W last at least this many "
        "us per row of the microbatch for the heaviest unit (a block; others in proportion to "
        "their FLOPs), sleeping after the real arithmetic, which runs unchanged",
        minimum=0.0,
    )


# Sections owned by later components are registered by dotted path and imported lazily, so a
# component's module can use `option` without an import cycle.
_SECTIONS: dict[str, str | type] = {
    "run": RunConfig,
    "topology": TopologyConfig,
    "device": DeviceConfig,
    "pipeline": "hpcpipe.schedules.config:PipelineConfig",
    "model": "hpcpipe.model.config:ModelConfig",
    "data": "hpcpipe.train.data:DataConfig",
    "optim": "hpcpipe.train.optim:OptimConfig",
    "sweep": "hpcpipe.sweep.config:SweepConfig",
    "train": "hpcpipe.train.settings:TrainConfig",
    "replan": "hpcpipe.train.replan:ReplanConfig",
    "async": "hpcpipe.train.async_config:AsyncConfig",
    "moe": "hpcpipe.moe.config:MoEConfig",
    "checkpoint": "hpcpipe.io.ckpt_config:CheckpointConfig",
    "trace": "hpcpipe.io.trace_config:TraceConfig",
    "machine": "hpcpipe.layout.machine:MachineConfig",
}


def _section_class(name: str) -> type:
    target = _SECTIONS[name]
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        target = getattr(importlib.import_module(module), cls)
        _SECTIONS[name] = target
    return target


def _available_sections() -> dict[str, type]:
    out = {}
    for name in list(_SECTIONS):
        try:
            out[name] = _section_class(name)
        except ModuleNotFoundError as exc:  # a component not present in this build
            if not (exc.name and str(_SECTIONS[name]).startswith(exc.name)):
                raise
            continue
    return out


@dataclass(frozen=True)
class Config:
    """The resolved deck: one frozen section object per known section."""

    source: str
    sections: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["sections"][name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(sec) for name, sec in self.sections.items()}


def _parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value`, value in TOML syntax; bare words are taken as strings."""
    if "=" not in item:
        raise ConfigError("--set", item, "must look like section.key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError("--set", key, "must be section.key (e.g. topology.pp=4)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except (ValueError, RecursionError):  # TOMLDecodeError, or a > 4300-digit integer
        value = raw.strip()
    return parts, value


MAX_DECK_BYTES = 16 << 20
"""Decks are hand-written text; a bigger file is a wrong path (a dataset, a checkpoint)."""


def _read_deck(deck: Path, source: str) -> str:
    """The deck's text, or ConfigError: missing, a directory, not a regular file (a FIFO would
    block the read forever), unreadable, too large or not UTF-8."""
    try:
        info = deck.stat()
    except FileNotFoundError:
        raise ConfigError(source, "", "no such input deck; see inputs/ for examples") from None
    except NotADirectoryError:
        raise ConfigError(
            source, "", "no such input deck (a parent in the path is a file, not a directory)"
        ) from None
    except OSError as exc:
        raise ConfigError(source, "", f"cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(source, "", "is a directory, expected a TOML input deck")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            source, "", "is not a regular file (a FIFO, socket or device); expected a TOML deck"
        )
    if info.st_size > MAX_DECK_BYTES:
        raise ConfigError(
            source, "", f"is {info.st_size} bytes, too large for an input deck (a wrong path?)"
        )
    try:
        return deck.read_bytes().decode("utf-8")
    except PermissionError:
        raise ConfigError(source, "", "cannot be read (permission denied)") from None
    except OSError as exc:
        raise ConfigError(source, "", f"cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(source, "", "is not UTF-8 text; expected a TOML input deck") from None


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Read a deck (or the built-in quick-start deck), apply `--set` overrides, validate."""
    deck = Path(path) if path is not None else DEFAULT_DECK
    source = str(path) if path is not None else "<built-in quickstart deck>"
    text = _read_deck(deck, source)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise ConfigError(source, "", "is not a usable TOML deck: nested too deeply") from None
    except ValueError as exc:  # tomllib lets int() refuse literals of more than 4300 digits
        why = "an integer has more than 4300 digits" if "digits" in str(exc) else str(exc)
        raise ConfigError(source, "", f"is not a usable TOML deck: {why}") from None

    overrides = list(overrides)
    for item in overrides:
        (section, key), value = _parse_override(item)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError("--set", section, "is not a table in the deck")
        table[key] = value
    where = source if not overrides else f"{source} (with --set)"

    known = _available_sections()
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(
            where,
            unknown[0],
            "is not a known section; sections: " + ", ".join(f"[{s}]" for s in known),
        )
    sections = {
        name: parse_section(cls, raw.get(name, {}), where, name) for name, cls in known.items()
    }
    return Config(source=source, sections=types.MappingProxyType(sections))


def _toml_string(text: str) -> str:
    """A TOML basic string that reads back as `text`, control characters included (written
    raw, a newline or an escape byte would make the saved config.toml unreadable)."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        return '""'
    return repr(v)


def dump_toml(config: Config) -> str:
    """The resolved deck as TOML (every key, defaults included): stored with every output."""
    source = "".join(ch if ch.isprintable() else "?" for ch in str(config.source))
    lines = [f"# resolved from {source}"]
    for name, values in config.as_dict().items():
        lines.append(f"\n[{name}]")
        for key, value in values.items():
            if value is None:  # TOML has no null: an absent key means "default"
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
