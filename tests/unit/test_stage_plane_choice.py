"""transport.core.choose_stage_plane: the core endpoint where every rank of the host can have two cores,
mpi4py otherwise, HETPIPE_STAGE_PLANE forcing either; a forced core that cannot run is an error."""

import pytest

from hetpipe.transport.core import STAGE_PLANE_ENV, choose_stage_plane
from hetpipe.transport.registry import LoopbackPort


@pytest.fixture
def comm():
    mpi = pytest.importorskip("mpi4py.MPI")
    return mpi.COMM_WORLD


def test_auto_needs_two_cores_per_rank(comm, monkeypatch):
    monkeypatch.delenv(STAGE_PLANE_ENV, raising=False)
    plane, why = choose_stage_plane(comm, ranks_here=3, cores=6)
    if "does not load" in why or "thread level" in why or "built without MPI" in why:
        pytest.skip(why)
    assert plane == "core", why
    plane, why = choose_stage_plane(comm, ranks_here=3, cores=5)
    assert plane == "python" and "5 cores for 3 ranks" in why, why


def test_forced(comm, monkeypatch):
    monkeypatch.setenv(STAGE_PLANE_ENV, "python")
    assert choose_stage_plane(comm, ranks_here=1, cores=64)[0] == "python"
    monkeypatch.setenv(STAGE_PLANE_ENV, "core")
    assert choose_stage_plane(comm, ranks_here=8, cores=2)[0] == "core"     # forced past the core count
    with pytest.raises(ValueError, match="single-process replay"):
        choose_stage_plane(LoopbackPort(None, 0))
    monkeypatch.setenv(STAGE_PLANE_ENV, "fast")
    with pytest.raises(ValueError, match="must be one of auto, core, python"):
        choose_stage_plane(comm)
