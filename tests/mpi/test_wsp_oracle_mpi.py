"""Live mpiexec runs with D = 1 and D = 2 (tests/wsp_case.py, emulated stage times: one VW runs ahead
to the staleness bound) against WSP written from its specification (tests/wsp_oracle.py), given the
versions their records say each pull got: every minibatch's loss and the final global weights."""

import json
from pathlib import Path

import numpy as np
import pytest

import wsp_case
from hetpipe.run.record import RunRecord
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    proc = run_mpi(5, "wsp_oracle_run.py", str(tmp_path_factory.mktemp("runs")), *sorted(wsp_case.CONFIGS),
                   timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["name"]: r["dir"] for r in results(proc)}


@pytest.mark.parametrize("name", sorted(wsp_case.CONFIGS))
def test_mpiexec_run_equals_the_spec_given_its_record(runs, name):
    assert name in runs, runs
    where = Path(runs[name])
    record = RunRecord.load(where / "record.json")
    with np.load(where / "weights.npz") as npz:
        weights = {int(layer): npz[layer] for layer in npz.files}
    losses = {int(v): {int(p): loss for p, loss in per.items()}
              for v, per in json.loads((where / "losses.json").read_text()).items()}
    got = wsp_case.versions((k, p) for k, shard in record.shards.items() for p in shard.pulls)
    wsp_case.check_against_spec(name, losses, weights, got, staleness=1)
