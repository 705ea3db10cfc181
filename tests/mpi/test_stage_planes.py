"""Stage ranks over the core's StageEndpoint equal the single-process replay bitwise at D = 0, as the
mpi4py plane does: a 2-VW run through the copy stream, a tied model (tied gradients between stages)
and a pytree boundary; each run's metrics summary names the plane that moved its messages."""

import json
import tempfile

import pytest

import hetpipe_core
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"], reason="hetpipe_core._mpi not built")]

CONFIGS = [{"model": "mlp", "cuts": [3], "nm": 2, "vws": 2, "copy_stream": True},
           {"model": "tied", "cuts": [2], "nm": 2},
           {"model": "pytree", "cuts": [2], "nm": 2}]


@pytest.fixture(scope="module")
def plane_runs():
    with tempfile.TemporaryDirectory() as run_dir:
        proc = run_mpi(5, "stage_planes.py", run_dir, json.dumps(CONFIGS), timeout=600)
    return proc, {r["model"]: r for r in results(proc)}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['model']}-{c.get('vws', 1)}vw")
def test_core_endpoint_equals_the_replay(plane_runs, cfg):
    proc, got = plane_runs
    r = got.get(cfg["model"])
    assert r is not None, f"no result for {cfg}:\n{proc.stdout}\n{proc.stderr}"
    assert r["core_equals_replay"] and r["python_equals_replay"], r
    assert "the core's progress thread moves the stage's messages" in r["reasons"]["core"], r
    assert "mpi4py requests" in r["reasons"]["python"], r
