"""`LiveArrays`: bytes held between actions, each buffer once, released with its last holder."""

from __future__ import annotations

import numpy as np

from hpcpipe.train.memory import LiveArrays


def test_shared_buffers_count_once_and_leave_with_their_last_holder():
    live = LiveArrays()
    recv = np.zeros(100)  # 800 B: a receive buffer held for the whole run
    live.hold("receive buffers", [recv])
    ctx = [recv[10:], np.ones(50)]  # a context keeping a view of its input and 400 B more
    live.hold(("ctx", 0, 0), ctx)
    assert live.live == 800 + 400
    wctx = {"x": recv, "dy": ctx[1].reshape(5, 10)}  # W keeps the same two buffers
    live.drop(("ctx", 0, 0))
    live.hold(("wctx", 0, 0), wctx)
    assert live.live == 1200 and live.peak == 1200
    live.hold(("out", 0, 1), np.empty(25))  # an output waiting for its send: 200 B
    assert (live.live, live.peak) == (1400, 1400)
    live.drop(("out", 0, 1))
    live.drop(("wctx", 0, 0))
    live.drop(("never held", 0, 0))  # harmless
    assert live.live == 800 and live.holders() == ["receive buffers"]
    live.reset_peak()
    assert live.peak == 800
    live.hold(("ctx", 0, 1), [np.ones(10)])
    live.hold(("ctx", 0, 1), [np.ones(20)])  # holding again replaces what the key held
    assert live.live == 800 + 160
