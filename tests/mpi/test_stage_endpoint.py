"""hetpipe_core._mpi.StageEndpoint under mpiexec: messages intact and in order both ways, a large
payload fully received while the sender's Python thread sleeps, every slot back, nothing lost."""

import pytest

import hetpipe_core
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"], reason="hetpipe_core._mpi not built")]


def test_round_trips_and_progress_while_python_sleeps(tmp_path):
    proc = run_mpi(2, "stage_endpoint.py", "200", str(32 << 20), str(tmp_path), timeout=180)
    got = {r["rank"]: r for r in results(proc)}
    assert set(got) == {0, 1}, f"{proc.stdout}\n{proc.stderr}"
    assert got[1]["ok"], got
    # Rank 0 sent the 32 MiB push, then slept in Python with no MPI call until rank 1 said (through a
    # file) that it had arrived whole: only the core's thread can have moved it (mpi4py's requests
    # would progress only inside an MPI call).
    assert got[0]["arrived_while_asleep"], got
    for r in got.values():
        assert r["lost"] == [] and r["free"] == 8, r


def test_chunked_payloads_arrive_whole_between_both_endpoints():
    """A 24 MiB payload of odd size cut at 1 MiB + 7 (mpi4py) and 3 MiB + 1 (core), in each direction
    between the two endpoints, reassembled bitwise; on the wire, the chunk word and message lengths."""
    big, py_chunk, core_chunk = (24 << 20) + 13, (1 << 20) + 7, (3 << 20) + 1
    proc = run_mpi(2, "chunked_payloads.py", str(big), str(py_chunk), str(core_chunk), timeout=180)
    got = {r["rank"]: r for r in results(proc)}
    assert set(got) == {0, 1}, f"{proc.stdout}\n{proc.stderr}"
    assert got[1]["equal"] == {"python->python": True, "core->core": True, "python->core": True,
                               "core->python": True}, got[1]
    for key, chunk, n in (("python_wire", py_chunk, 5 * py_chunk + 3), ("core_wire", core_chunk, 4 * core_chunk + 1)):
        wire = got[1][key]
        assert wire["equal"] and wire["cut"] == chunk, wire
        assert wire["lengths"] == [chunk] * (n // chunk) + [n % chunk], wire
    for r in got.values():
        assert r["lost"] == [] and r["free"] == 8, r


def test_an_mpi_error_of_the_progress_thread_is_reported_as_a_transfer_failure_in_one_line():
    """The progress thread's MPI_Isend to a rank outside the communicator fails: the endpoint says
    'mpi', the transport raises MPITransferError naming the call, and the report has no traceback."""
    proc = run_mpi(1, "endpoint_mpi_error.py", timeout=120)
    got = results(proc)
    assert len(got) == 1, f"{proc.stdout}\n{proc.stderr}"
    r = got[0]
    assert r["kind_before"] == "" and r["kind_after"] == "mpi", r
    assert r["raised"] == "MPITransferError" and "MPI_Isend (header) failed" in r["message"], r
    assert r["transport_failure"], r
    assert r["report"].startswith("hetpipe: rank 0 (vw 0 stage 0) failed: an MPI transfer failed"), r
    assert "Traceback" not in r["report"] and 'File "' not in r["report"], r     # MPI's own text may span lines
