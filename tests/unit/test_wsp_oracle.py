"""What stages compute from stale pulls (D = 1 and D = 2), end to end, against WSP written from its
specification in plain torch (tests/wsp_oracle.py: no hetpipe code computes an expected number).

The runtime under test is the single-process replay of the case in tests/wsp_case.py (two VWs of two
stages and one, Nm = 1, SGD): once under its own loop's timing, once following the record of an mpiexec
run of the same case (tests/unit/golden/wsp_record_<name>.json). The versions the pulls got are read
from what the runtime reports (its shard logs; the record); the oracle computes from them every
minibatch's loss and the final global weights. tests/mpi/test_wsp_oracle_mpi.py checks live mpiexec
runs the same way.

The golden records come from ``mpiexec -n 5 python tests/mpi/scripts/wsp_oracle_run.py OUT d1 d2``
(OUT/<name>/record.json); a record names the run it belongs to (plan, data, seed, initial weights), so a
change of the case needs new ones.
"""

from pathlib import Path

import pytest
import torch

import wsp_case
from hetpipe.ps.client import PULL_AHEAD_ENV
from hetpipe.run.record import RunRecord

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(autouse=True)
def one_thread():
    """The replay computes with one thread; the oracle does too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replay(name: str, record=None):
    cfg = wsp_case.CONFIGS[name]
    plan = wsp_case.plan(cfg["d"], cfg["shards"], cfg["aggregate"])
    return wsp_case.trainer(wsp_case.model(), wsp_case.batches(), plan, cfg["momentum"], emulate=False).replay(record)


@pytest.mark.parametrize("name", sorted(wsp_case.CONFIGS))
def test_replay_equals_the_spec_given_the_versions_its_pulls_got(name, monkeypatch):
    """With each pull requested at its Pull instruction, the replay's loop lets one VW run ahead to
    the staleness bound."""
    monkeypatch.setenv(PULL_AHEAD_ENV, "0")
    result = replay(name)
    got = wsp_case.versions((k, p) for k, log in result.shard_logs.items() for p in log.pulls)
    wsp_case.check_against_spec(name, result.losses, result.weights, got, staleness=wsp_case.CONFIGS[name]["d"])


@pytest.mark.parametrize("name", sorted(wsp_case.CONFIGS))
def test_replay_with_early_pulls_equals_the_spec_given_the_versions_its_pulls_got(name, monkeypatch):
    """With pulls requested early (the default), no VW of the replay's loop waits for a reply in
    flight, so none runs ahead of the others: the versions are one wave old, yet the spec's given them."""
    monkeypatch.setenv(PULL_AHEAD_ENV, "1")
    result = replay(name)
    got = wsp_case.versions((k, p) for k, log in result.shard_logs.items() for p in log.pulls)
    wsp_case.check_against_spec(name, result.losses, result.weights, got, staleness=1)


@pytest.mark.parametrize("name", sorted(wsp_case.CONFIGS))
def test_replay_of_an_mpiexec_runs_record_equals_the_spec(name):
    path = GOLDEN / f"wsp_record_{name}.json"
    record = RunRecord.load(path)
    result = replay(name, path)
    got = wsp_case.versions((k, p) for k, shard in record.shards.items() for p in shard.pulls)
    # The replay answered every pull at its recorded version.
    assert wsp_case.versions((k, p) for k, log in result.shard_logs.items() for p in log.pulls) == got
    wsp_case.check_against_spec(name, result.losses, result.weights, got, staleness=wsp_case.CONFIGS[name]["d"])
