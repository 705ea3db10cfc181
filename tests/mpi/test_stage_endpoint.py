"""hetpipe_core._mpi.StageEndpoint under mpiexec: messages intact and in order both ways, a large
payload fully received while the sender's Python thread sleeps, every slot back, nothing lost."""

import pytest

import hetpipe_core
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"], reason="hetpipe_core._mpi not built")]


def test_round_trips_and_progress_while_python_sleeps():
    proc = run_mpi(2, "stage_endpoint.py", "200", str(32 << 20), timeout=120)
    got = {r["rank"]: r for r in results(proc)}
    assert set(got) == {0, 1}, f"{proc.stdout}\n{proc.stderr}"
    assert got[1]["ok"], got
    # The 32 MiB push was sent just before rank 0 slept for 2 s: it must have arrived well before
    # rank 0's Python woke up (mpi4py's requests would only progress after it).
    assert got[1]["arrived_at"] < got[0]["woke_at"] - 1.0, got
    for r in got.values():
        assert r["lost"] == [] and r["free"] == 8, r
