"""A slow link between two ranks, emulated for tests and benchmarks (`kind=slow,link=P`).

Messages on the link are handed to the interpreter `delay` after they arrived, so the
receiver waits as it would behind a congested or slower network path, while the sender's
compute goes on untouched. "Arrived" is when this rank's mailbox first saw the message
complete (its pokes between actions test every posted receive), or when it waited for it.
Used only when such a fault names this rank: the runtime's own mailbox stays as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hpcpipe.faults import link_delay
from hpcpipe.mpi.p2p import Mailbox

__all__ = ["SlowLinkMailbox"]


class SlowLinkMailbox(Mailbox):
    """`Mailbox` whose receives from the far end of a slow link are held back."""

    def __init__(
        self,
        *args: Any,
        specs: list[dict[str, str]],
        world_rank: int,
        world_of_peer: Any,
        step_of: Callable[[], int],
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._specs, self._me, self._world = specs, world_rank, world_of_peer
        self._step_of = step_of  # the step being run, counted from 1 (as `at=step:N`)
        self._seen: dict[int, float] = {}  # id(slot) -> when its message was seen arrived
        self.held_s = 0.0  # the time messages were held back, for tests and reports

    def progress(self) -> None:
        super().progress()
        now = time.perf_counter()
        for slot in self._order[self._n_waits : self._n_posts]:  # every receive posted
            if id(slot) in self._seen or not slot.posted:
                continue
            if slot.arrived or slot.request.Test(slot.status):
                slot.arrived = True  # its status holds the message: no Wait
                self._seen[id(slot)] = now

    def _complete(self, i: int) -> Any:
        slot = super()._complete(i)
        arrived = self._seen.pop(id(slot), None)
        peer = int(self._world[self.plan.receives[i].peer])
        delay = link_delay(self._specs, self._step_of(), self._me, peer)
        if delay > 0.0:
            left = (arrived if arrived is not None else time.perf_counter()) + delay
            left -= time.perf_counter()
            if left > 0.0:
                time.sleep(left)
                self.held_s += left
        return slot
