"""The one door to matplotlib: every picture hpcpipe draws comes through `pyplot()`.

matplotlib is a default dependency, but a cluster install made with `pip install --no-deps` (or
a site Python without it) may lack it. Every plotting path then ends the same way: exit 2 with
one message naming what asked for the picture and how to get it, before any work is done.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.config import ConfigError

__all__ = ["have_matplotlib", "pyplot", "require_matplotlib"]

INSTALL_HINT = (
    "pip install 'matplotlib>=3.6' (a dependency of hpcpipe: was it installed with --no-deps?)"
)


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(source: str, key: str) -> None:
    """Raise the plotting ConfigError (exit 2) naming `source`/`key` unless matplotlib is here;
    called by each picture's requester before it does any work."""
    if not have_matplotlib():
        raise ConfigError(
            source,
            key,
            f"asks for a picture, which needs matplotlib, and it is not installed: {INSTALL_HINT}",
        )


def pyplot(source: str = "plot", key: str = "") -> Any:
    """matplotlib.pyplot on a file-only backend (no display is ever needed)."""
    require_matplotlib(source, key)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
