"""Nested parameter trees: a unit's parameters, gradients and optimizer slots are dicts of
arrays (tuples where a slot holds several), walked here the one way everyone needs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["leaves", "tree_map"]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """`fn` over the arrays of `tree` (and the arrays at the same places in `rest`), keeping
    its nesting of dicts and tuples."""
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, v, *(r[j] for r in rest)) for j, v in enumerate(tree))
    return fn(tree, *rest)


def leaves(tree: Any) -> Iterator[Any]:
    """The arrays of `tree`, depth first in its order."""
    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from leaves(v)
    elif isinstance(tree, tuple):
        for v in tree:
            yield from leaves(v)
    else:
        yield tree
