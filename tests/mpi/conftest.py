"""Tests under tests/mpi skip where no mpiexec can be found."""

import pytest

from mpirun import mpiexec


@pytest.fixture(autouse=True)
def _needs_mpiexec():
    if mpiexec() is None:
        pytest.skip("no mpiexec beside this Python nor on PATH")
