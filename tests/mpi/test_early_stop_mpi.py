"""Evaluation points and an early stop under real ranks (tests/mpi/scripts/early_stop.py), through the
core PS plane and the Python one: every VW trains the same waves, up to the stop + D + 1, the PS
clocks end there, and every process ends."""

import pytest

from mpirun import results, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("plane", ["core", "python"])
def test_an_early_stop_ends_every_vw_after_the_same_wave(plane):
    proc = run_mpi(5, "early_stop.py", timeout=300, env={"HETPIPE_PS_PLANE": plane})
    assert proc.returncode == 0, proc.stderr
    (r,) = results(proc)
    assert r["ps_plane"] == plane
    assert r["stopped"] == {"after_wave": 3, "asked_by": "StopAtFirstEval.on_eval at wave 1"}, r
    assert r["losses"] == {"0": list(range(8)), "1": list(range(8))}, r      # 4 waves of Nm = 2, of 20
    assert [e["wave"] for e in r["evals"]] == [1] and r["evals"][0]["samples"] == 128
    assert all(c[1:] == [4, 4] for c in r["clocks"]), r                     # both VWs, global clock 4
