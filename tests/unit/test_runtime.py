"""Runtime pieces in one process: headers, loopback transport, PS shard logic, replay determinism."""

import numpy as np
import pytest
import torch

from hetpipe.launch.roles import LaunchError, resolve_device
from hetpipe.plan.types import StagePlan
from hetpipe.runtime.ps import ShardState, WSPViolation
from hetpipe.runtime.transport import ACT, ANY, Header, LoopbackHub


def test_header_round_trip():
    h = Header(ACT, 1, 2, 7, 3, "float32", (16, 3, 4), 16 * 12 * 4)
    assert Header.decode(h.encode()) == h


def test_loopback_is_fifo_per_sender_and_kind():
    hub = LoopbackHub()
    a, b = hub.endpoint(0, None), hub.endpoint(1, None)
    a.send(1, Header(ACT, 0, 0, 0))
    a.send(1, Header(ACT, 0, 0, 1))
    assert b.try_recv(0, ACT + 1) is None
    assert b.try_recv(ANY, ACT).header.mb == 0
    assert b.try_recv(0, ACT).header.mb == 1
    assert b.try_recv(0, ACT) is None


def _shard(d):
    w = {0: np.zeros(3, np.float32), 1: np.zeros(2, np.float32)}
    # two VWs: VW 0 puts both layers in stage 0; VW 1 splits them over two stages
    return ShardState(0, w, [[(0, 2)], [(0, 1), (1, 2)]], d)


def test_shard_applies_a_wave_when_the_global_clock_passes_it():
    s = _shard(0)
    s.push(0, 0, 0, np.ones(5, np.float32))
    assert s.global_clock == 0 and not s.W[0].any()
    s.push(1, 0, 0, np.full(3, 2, np.float32))
    assert s.global_clock == 0                      # VW 1's stage 1 has not pushed wave 0
    s.push(1, 1, 0, np.full(2, 3, np.float32))
    assert s.global_clock == 1
    assert s.W[0].tolist() == [3, 3, 3] and s.W[1].tolist() == [4, 4]
    assert s.log.clocks[-1] == (1, 1, 1)


def test_pulls_wait_for_the_staleness_bound():
    s = _shard(1)
    s.pull(9, 0, 0, 1)
    assert [q[3] for q in s.ready_pulls()] == [1]   # wave 1 - D = 0 <= global 0
    s.pull(9, 0, 0, 2)
    assert s.ready_pulls() == []
    s.push(0, 0, 0, np.ones(5, np.float32))
    s.push(1, 0, 0, np.ones(3, np.float32))
    s.push(1, 1, 0, np.ones(2, np.float32))
    assert [q[3] for q in s.ready_pulls()] == [2]


def test_duplicate_push_and_clock_bound_are_enforced():
    s = _shard(0)
    s.push(0, 0, 0, np.ones(5, np.float32))
    with pytest.raises(WSPViolation, match="duplicate push of wave 0 from VW 0 stage 0"):
        s.push(0, 0, 0, np.ones(5, np.float32))
    with pytest.raises(WSPViolation, match="breaks 0 <= clock - global <= D \\+ 1"):
        s.push(0, 0, 1, np.ones(5, np.float32))     # VW 0 two waves ahead of VW 1 with D = 0


def test_missing_cuda_device_is_a_launch_error():
    st = StagePlan("cuda:3", "gpu", 0, 1, 0.0, 0.0)
    with pytest.raises(LaunchError, match="the plan asks for cuda:3 but this host has no CUDA device"):
        resolve_device(st, emulate=None, cuda_count=0)
    dev, emulated = resolve_device(StagePlan("n0.g1", "titan_v", 0, 1, 0.0, 0.0), emulate=None, cuda_count=0)
    assert dev == torch.device("cpu") and emulated


def test_missing_mpi4py_is_a_clear_error(monkeypatch):
    import sys

    from hetpipe.launch.mpi import MPIUnavailable, world
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(MPIUnavailable, match="mpi4py is not importable"):
        world()


def test_replay_is_deterministic_and_trains():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    from common import cross_entropy, mlp, sgd, synthetic, two_vw_plan

    from hetpipe.runtime.trainer import Trainer
    plan = two_vw_plan(([3], [2]), (0.0, 0.0), nm=2, d=0)
    a = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan).replay()
    b = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan).replay()
    assert a.losses == b.losses
    assert all(np.array_equal(a.weights[l], b.weights[l]) for l in a.weights)
    first, last = list(a.losses[0].values())[0], list(a.losses[0].values())[-1]
    assert np.isfinite(last) and a.shard_logs[0].clocks[-1][2] == -(-len(a.losses[0]) // 2)
    assert first != last
