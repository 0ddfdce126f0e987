"""The bytes a pipeline rank holds, measured on its arrays as the step runs.

Every array the interpreter keeps between actions is registered under a holder: a
microbatch's saved forward context (until B), what W still needs (until W), a received message
waiting for its consumer, an output waiting for its send, and the mailbox's receive buffers for
the whole run. The live total counts each underlying buffer once, however many holders and
views share it, so a context that keeps its input (a receive buffer) adds nothing for it. It is
sampled at the end of each hold, i.e. at action boundaries: working memory an action frees
before it ends (matmul results, softmax) is not in it, which is the part no schedule controls.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hpcpipe.model.layers import buffers

__all__ = ["LiveArrays"]


class LiveArrays:
    """Reference-counted buffers by holder; `live` and `peak` are bytes."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._arrays: dict[int, Any] = {}  # keeps each counted buffer alive until dropped
        self._holders: dict[Hashable, tuple[int, ...]] = {}
        self.live = 0
        self.peak = 0

    def hold(self, key: Hashable, tree: Any) -> dict[int, Any]:
        """Count the buffers of `tree` as held by `key` (replacing what `key` held); returns
        them by id."""
        if key in self._holders:
            self.drop(key)
        found = buffers(tree)
        self._holders[key] = tuple(found)
        count, arrays = self._count, self._arrays
        for i, array in found.items():
            n = count.get(i, 0)
            if not n:
                arrays[i] = array
                self.live += int(array.nbytes)
            count[i] = n + 1
        if self.live > self.peak:
            self.peak = self.live
        return found

    def drop(self, key: Hashable) -> None:
        """`key` holds nothing any more (no-op when it held nothing)."""
        count = self._count
        for i in self._holders.pop(key, ()):
            n = count[i] - 1
            if n:
                count[i] = n
            else:
                del count[i]
                self.live -= int(self._arrays.pop(i).nbytes)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (at the start of a step)."""
        self.peak = self.live

    def holders(self) -> list[Hashable]:
        """What holds memory now (at the end of a step: the run-long buffers only)."""
        return list(self._holders)
