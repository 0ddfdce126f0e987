"""FaceChannel's recycled face arrays (one process, COMM_SELF): a received or boundary face goes
back to the free list only when the sweep is done with it, a sent one only once its send has
completed, and what comes back out is that same memory (zeroed when asked)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpcpipe.mpi.faces import FaceChannel


def test_a_sent_face_is_recycled_only_after_its_send_completes():
    channel = FaceChannel(MPI.COMM_SELF, max_tag=10)
    try:
        shape = (4, 3, 2)
        face = channel.take(shape)
        face[...] = 7.0
        posted = channel.post(0, 1, shape, sync=True)
        channel.send(face, 0, 1)
        assert channel.take(shape) is not face  # in flight: never handed out again
        got, nbytes = channel.wait(posted)
        assert nbytes == face.nbytes and np.array_equal(got, face)
        channel.drain()  # the send is complete: its buffer is free
        again = channel.take(shape, zero=True)
        assert again is face and not again.any()
        channel.give_back(again[1:])  # a view is never kept: its base may still be in use
        assert channel.take(shape) is not again
    finally:
        channel.free()


def test_given_back_faces_are_reused_by_shape():
    channel = FaceChannel(MPI.COMM_SELF, max_tag=10)
    try:
        a, b = channel.take((2, 2)), channel.take((3, 2))
        channel.give_back(a)
        channel.give_back(b)
        assert channel.take((3, 2)) is b and channel.take((2, 2)) is a
        assert channel.take((2, 2)) is not a  # the list is empty again: a fresh one
    finally:
        channel.free()
