"""The NumPy front end's checks on its input (no messages are sent): one line naming the culprit."""

import numpy as np
import pytest
from mpi4py import MPI

from hetpipe.numpy import WSPWorker
from hetpipe.plan.manual import manual_plan


def _plan(cuts=((),)):
    return manual_plan(2, [list(c) for c in cuts], nm=2, d=0, shards=1)


def test_a_dtype_the_ps_does_not_hold_names_the_layer():
    with pytest.raises(ValueError, match=r"layer 1's weights are float64; the parameter servers hold float32"):
        WSPWorker(MPI.COMM_SELF, _plan(), [np.zeros(3, np.float32), np.zeros(2)])


def test_a_step_of_the_wrong_shape_or_in_place_names_the_worker():
    worker = WSPWorker(MPI.COMM_SELF, _plan(), [np.zeros(3, np.float32), np.ones(2, np.float32)])
    with pytest.raises(ValueError, match=r"VW 0 stage 0 \(rank 0\): a step gave float32\[4\], the weights are "
                                         r"float32\[5\]"):
        worker.step(0, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="must be a new array"):
        worker.step(0, worker.weights)
    worker.step(0, worker.weights + 1)
    np.testing.assert_array_equal(worker.ledger.deltas[0], np.ones(5, np.float32))
    np.testing.assert_array_equal(worker.layer(1), [2, 2])
    with pytest.raises(ValueError, match="pushed wave 1; the next wave to push is 0"):
        worker.push(1)


def test_pipelined_vws_and_ps_ranks_are_refused():
    with pytest.raises(ValueError, match="one-stage virtual workers; VW 0 has 2 stages"):
        WSPWorker(MPI.COMM_SELF, _plan(((1,),)), [np.zeros(3, np.float32), np.zeros(2, np.float32)])
