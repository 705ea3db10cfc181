"""The transport backends under real mpiexec: torch-p2p (gloo between CPU stages) equals mpi-host and
the single-process replay bitwise at D = 0; a forced backend that cannot serve a rank ends the job
naming the rank, its device and why."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from mpirun import SCRIPTS, results, run_mpi

pytestmark = pytest.mark.mpi

# A 2-VW run through the copy stream (pushes and pulls on the core's CPU stream), a tied model (tied
# gradients on the channels) and a pytree boundary (several leaves packed in one payload).
CONFIGS = [{"model": "mlp", "cuts": [3], "nm": 2, "vws": 2, "copy_stream": True},
           {"model": "tied", "cuts": [2], "nm": 2},
           {"model": "pytree", "cuts": [2], "nm": 2}]


@pytest.fixture(scope="module")
def transport_runs():
    with tempfile.TemporaryDirectory() as run_dir:
        proc = run_mpi(5, "transport_equal.py", run_dir, json.dumps(CONFIGS), timeout=600)
    return proc, {r["model"]: r for r in results(proc)}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['model']}-{c.get('vws', 1)}vw")
def test_torch_p2p_over_gloo_equals_mpi_host_and_the_replay(transport_runs, cfg):
    proc, got = transport_runs
    r = got.get(cfg["model"])
    assert r is not None, f"no result for {cfg}:\n{proc.stdout}\n{proc.stderr}"
    assert r["transports"] == {"torch-p2p": "mpi-host+torch-p2p", "mpi-host": "mpi-host"}, r
    assert r["p2p_equals_replay"] and r["p2p_equals_mpi_host"], r
    summary = r["summary"]
    assert summary["transport"] == "mpi-host+torch-p2p", summary
    assert summary["transport_reason"].startswith("torch-p2p: gloo point-to-point"), summary
    assert "(forced)" in summary["transport_reason"] and "PS traffic over pinned-host MPI" in summary["transport_reason"]


def test_forcing_a_backend_that_cannot_serve_a_rank_ends_the_job_naming_it():
    with tempfile.TemporaryDirectory() as run_dir:
        proc = subprocess.run([sys.executable, "-m", "hetpipe.cli", "launch", "-n", "3", "--run-dir", run_dir,
                               "--transport", "loopback", str(SCRIPTS / "failing.py"), "none", "0"],
                              capture_output=True, text=True, timeout=300, cwd=SCRIPTS,
                              env={**os.environ, "HETPIPE_TIMEOUT": "30"})
    assert proc.returncode != 0
    assert "FINISHED" not in proc.stdout
    for rank in (0, 1):
        assert (f"rank {rank} (vw 0 stage {rank}) on cpu: the forced transport 'loopback' cannot serve it: "
                "loopback: only the single-process replay") in proc.stderr, proc.stderr


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


def test_torch_p2p_on_one_host_listens_on_loopback_alone():
    """On one host the store is a file in a directory of the user's alone and gloo binds loopback: the
    channels add no listener on any other address (MPI's own, there before, are MPI's). The control,
    the same channels opened as across hosts (a TCP store at the host's name, gloo on its interface),
    adds listeners beyond loopback: the check can fail."""
    runs = {}
    for mode in ("one-host", "several-hosts"):
        proc = run_mpi(2, "listeners.py", mode, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[mode] = results(proc)
        assert len(runs[mode]) == 2 and all(r["moved"] for r in runs[mode]), runs[mode]
    for r in runs["one-host"]:
        assert all(_loopback(a) for a in r["listening"]), r
    assert any(not _loopback(a) for r in runs["several-hosts"] for a in r["listening"]), runs["several-hosts"]
