"""The PS's outer optimizer on real mpiexec runs (the compiled core's shard plane): nesterov at D = 0
equals the single-process replay (Python shards) bitwise; nesterov with the inverse staleness scale, and
delayed nesterov with the sqrt staleness decay and the sqrt gain, at D = 2, where pulls really lag, equal
the replay of the run's record bitwise. All differ from the plain rule, and the record refuses a replay
under another outer optimizer. Waves of unequal length, weighed by their samples, equal the replay the same
way, and differ from the same plan with equal waves."""

import json

import pytest

import hetpipe_core
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"], reason="hetpipe_core was built without MPI")]

NESTEROV = {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
# 2 VWs (2 stages and 1), 2 PS shards: 5 ranks. "slow": per VW, the largest random sleep (s) per layer.
CONFIGS = [
    {"name": "nesterov-d0", "d": 0, "cuts": [[3], []], "shards": 2, "slow": [0.0, 0.0], "aggregate": "mean",
     "outer": NESTEROV},
    {"name": "nesterov-inverse-d2", "d": 2, "cuts": [[3], []], "shards": 2, "slow": [0.004, 0.03], "aggregate": "sum",
     "outer": {**NESTEROV, "outer_lr": 0.4, "outer_staleness": "inverse"}},
    # A momentum step every 3 pushes of a layer (2 VWs: the windows straddle waves).
    {"name": "delayed-sqrt-d2", "d": 2, "cuts": [[3], []], "shards": 2, "slow": [0.004, 0.03], "aggregate": "sum",
     "outer": {**NESTEROV, "outer": "delayed-nesterov", "outer_lr": 0.5, "outer_staleness": "sqrt",
               "outer_gain": "sqrt", "outer_delay": 3}},
    # Waves of unequal length (VW 0 trains 3 minibatches per wave, VW 1 2): the mean weighs the deltas by
    # their samples, in the core plane as in the Python shards. The "plain" replay is the same plan with
    # equal waves, which must differ.
    {"name": "waves-3-2-d0", "d": 0, "cuts": [[3], []], "shards": 2, "slow": [0.0, 0.0], "aggregate": "mean",
     "waves": [3, 2], "n": 320, "outer": {}},
    {"name": "waves-3-2-d2", "d": 2, "cuts": [[3], []], "shards": 2, "slow": [0.004, 0.03], "aggregate": "mean",
     "waves": [3, 2], "n": 320, "outer": {}},
]


@pytest.fixture(scope="module")
def outer_runs(tmp_path_factory):
    proc = run_mpi(5, "outer_runs.py", str(tmp_path_factory.mktemp("runs")), json.dumps(CONFIGS), timeout=400)
    return proc, {r["name"]: r for r in results(proc)}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_outer_optimizer_run_equals_the_replay(outer_runs, cfg):
    proc, got = outer_runs
    r = got.get(cfg["name"])
    assert r is not None, f"no result for {cfg['name']}:\n{proc.stdout}\n{proc.stderr}"
    assert r["ps_plane"] == "core", r
    assert r["equal"] and r["plain_differs"], r
    if "waves" in cfg:
        # The record keeps the VWs' waves; a replay with equal waves is refused naming them.
        assert r["record_waves"] == cfg["waves"], r
        if cfg["d"]:
            assert r["max_pull_staleness"] >= 1 and r["reproduced"], r
            assert "field 'run.waves'" in r["plain_refused"], r
        assert proc.returncode == 0, proc.stderr
        return
    # The record keeps the options; outer_gain and outer_delay only when not their defaults.
    assert r["record_outer"] == {"outer_staleness": "none", **cfg["outer"]}, r
    if cfg["d"]:
        # Pulls lagged, so the staleness decay acted; the replay followed the record.
        assert r["max_pull_staleness"] >= 1 and r["reproduced"], r
        assert "field 'run.outer'" in r["plain_refused"], r
    assert proc.returncode == 0, proc.stderr
