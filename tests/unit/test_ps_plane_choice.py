"""Which data plane a PS shard rank runs: HETPIPE_PS_PLANE and the conditions of the core plane."""

import pytest

from hetpipe.ps.core_plane import PLANE_ENV, choose_plane
from hetpipe.transport.loopback import LoopbackHub
from hetpipe.transport.registry import LoopbackPort


def test_replay_runs_the_python_plane(monkeypatch):
    monkeypatch.delenv(PLANE_ENV, raising=False)
    plane, reason = choose_plane(LoopbackPort(LoopbackHub(), 0))
    assert plane == "python" and reason == "python: the run is not over MPI (single-process replay)"


def test_forced_python_plane(monkeypatch):
    monkeypatch.setenv(PLANE_ENV, "python")
    assert choose_plane(object()) == ("python", f"python: {PLANE_ENV}=python")


def test_forced_core_plane_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv(PLANE_ENV, "core")
    with pytest.raises(ValueError, match=rf"{PLANE_ENV}=core, but the run is not over MPI"):
        choose_plane(LoopbackPort(LoopbackHub(), 0))


def test_unknown_plane_names_the_variable(monkeypatch):
    monkeypatch.setenv(PLANE_ENV, "gpu")
    with pytest.raises(ValueError, match=rf"{PLANE_ENV} must be one of auto, core, python, got 'gpu'"):
        choose_plane(object())
