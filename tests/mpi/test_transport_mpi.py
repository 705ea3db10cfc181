"""MPITransport under mpiexec: closing with receives in progress."""

import pytest

from mpirun import results, run_mpi

pytestmark = pytest.mark.mpi


def test_close_cancels_a_pending_payload_before_releasing_its_slot():
    proc = run_mpi(1, "close_pending.py", timeout=120)
    got = results(proc)
    assert got, f"{proc.stdout}\n{proc.stderr}"
    r = got[0]
    assert r["error"] is not None
    assert "rank 0 closed with unfinished receive(s) that had consumed a message" in r["error"], r
    assert "activation message" in r["error"] and "mb=3" in r["error"], r
    assert r["available"] == 2 and r["late_unclaimed"] and r["slot_untouched"], r
