"""Run records in one process: a PS shard following a record's versions and apply order (against
hand-computed values), the record file, and records that do not fit the run."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hetpipe.ps.shard import ShardState
from hetpipe.run.record import RecordMismatch, RunRecord, ShardRecord, ShardScript, run_identity


def _shard(w0: float, d: int = 1) -> ShardState:
    # one layer of one weight; two VWs, each one stage holding it
    return ShardState(0, {0: np.full(1, w0, np.float32)}, [[(0, 1)], [(0, 1)]], d)


def _script(s: ShardState, applied, pulls) -> ShardScript:
    return ShardScript(ShardRecord(0, applied, [(*p, 0) for p in pulls]), s, "record r.json")


def test_shard_answers_a_pull_at_its_recorded_version_holding_the_wave_back():
    s = _shard(0.0)
    s.gate = _script(s, [[(0, 0), (1, 0)]], [(0, 0, 1, 0)])     # VW 0's pull of wave 1 got version 0
    s.push(0, 0, 0, np.full(1, 1, np.float32))
    s.push(1, 0, 0, np.full(1, 2, np.float32))
    assert s.global_clock == 1 and s.applied == 0 and s.W[0].tolist() == [0.0]   # wave 0 held back
    s.pull(None, 0, 0, 1)
    ready = s.ready_pulls()
    out = np.empty(1, np.float32)
    s.snapshot_into(0, 0, out)
    assert [q[1:] for q in ready] == [(0, 0, 1)] and out.tolist() == [0.0]
    s.answered(ready)
    assert s.applied == 1 and s.W[0].tolist() == [3.0]
    assert s.log.pulls == [(0, 0, 1, 0)]
    s.gate.check_done(s)


def test_without_a_record_the_same_pull_gets_the_newest_version():
    s = _shard(0.0)
    s.push(0, 0, 0, np.full(1, 1, np.float32))
    s.push(1, 0, 0, np.full(1, 2, np.float32))
    s.pull(None, 0, 0, 1)
    assert [q[1:] for q in s.ready_pulls()] == [(0, 0, 1)] and s.log.pulls == [(0, 0, 1, 1)]


@pytest.mark.parametrize("order, expected", [([(0, 0), (1, 0)], 0.0), ([(1, 0), (0, 0)], 2.0 ** -30)])
def test_shard_applies_a_wave_in_the_recorded_order(order, expected):
    # float32: (1 + 2^-30) - 1 = 0, but (1 - 1) + 2^-30 = 2^-30
    s = _shard(1.0)
    s.gate = _script(s, [order], [])
    s.push(0, 0, 0, np.full(1, 2.0 ** -30, np.float32))
    s.push(1, 0, 0, np.full(1, -1.0, np.float32))
    assert s.W[0].tolist() == [expected]
    assert s.log.applied == [(vw, st, 0) for vw, st in order]


def test_a_record_the_shard_cannot_follow_is_named():
    s = _shard(0.0)
    with pytest.raises(RecordMismatch, match=r"record r.json: PS shard 0 wave 0 applied pushes \[\(0, 0\)\]"):
        _script(s, [[(0, 0)]], [])
    s.gate = _script(s, [[(0, 0), (1, 0)]], [])
    s.pull(None, 1, 0, 1)
    with pytest.raises(RecordMismatch, match="never answered a pull of wave 1 by VW 1 stage 0"):
        s.ready_pulls()
    s = _shard(0.0)
    s.gate = _script(s, [[(0, 0), (1, 0)]], [(0, 0, 1, 0)])
    with pytest.raises(RecordMismatch, match=r"answered pulls in the recorded run that the replay never made"):
        s.gate.check_done(s)


def _spec(d: int):
    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    from common import cross_entropy, mlp, sgd, synthetic, two_vw_plan

    from hetpipe.run.trainer import Trainer
    plan = two_vw_plan(([3], [2]), (0.0, 0.0), nm=2, d=d)
    return Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan).spec(plan)


def test_record_file_round_trips_and_belongs_to_one_run(tmp_path):
    spec = _spec(1)
    rec = RunRecord(run_identity(spec), {0: ShardRecord(0, [[(0, 0), (1, 0)]], [(0, 0, 1, 0, 1)], [(0, 1, 0)])},
                    {"weights_crc32": 1, "losses_crc32": 2})
    rec.save(tmp_path / "r.json")
    back = RunRecord.load(tmp_path / "r.json")
    assert (back.run, back.shards, back.outcome) == (rec.run, rec.shards, rec.outcome)
    back.check(spec)
    with pytest.raises(RecordMismatch, match=r"is of another run: field 'run.d': the record has 1, this run 3"):
        back.check(_spec(3))
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(RecordMismatch, match="not a hetpipe WSP record"):
        RunRecord.load(tmp_path / "bad.json")
