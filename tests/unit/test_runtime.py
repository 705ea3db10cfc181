"""Runtime pieces in one process: headers, loopback transport, PS shard logic, replay determinism."""

import numpy as np
import pytest
import torch

from hetpipe.job.roles import LaunchError, resolve_device
from hetpipe.plan.types import StagePlan
from hetpipe.ps.shard import ShardState, WSPViolation
from hetpipe.transport.protocol import ACT, ANY, Header
from hetpipe.transport.loopback import LoopbackHub
from hetpipe.run.config import Planning


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
    s.pull(None, 0, 0, 1)
    assert [q[3] for q in s.ready_pulls()] == [1]   # wave 1 - D = 0 <= global 0
    s.pull(None, 0, 0, 2)
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


def test_a_push_beyond_the_staleness_window_names_its_sender():
    s = _shard(1)
    assert s.stage_ranks == {(0, 0): 0, (1, 0): 1, (1, 1): 2}      # plan order: VW by VW, stage by stage
    with pytest.raises(WSPViolation, match=r"PS shard 0: push of wave 3 from VW 1 stage 0 \(rank 1\) is beyond VW 1's "
                                           r"clock 0 \+ D \+ 1 = 2") as e:
        s.push(1, 0, 3, np.ones(3, np.float32), src=1)
    assert e.value.sender == 1
    s.push(1, 0, 2, np.ones(3, np.float32), src=1)     # the window's last wave is taken


def test_a_forged_header_is_blamed_on_its_transport_source():
    """Rank 2 (VW 1 stage 1) sends a push and a pull claiming VW 0 stage 0 (rank 0): the shard names rank 2,
    never the innocent rank 0, and takes nothing from it."""
    s = _shard(1)
    with pytest.raises(WSPViolation, match=r"rank 2 sent a push of wave 0 claiming VW 0 stage 0, which is rank 0") as e:
        s.push(0, 0, 0, np.ones(5, np.float32), src=2)
    assert e.value.sender == 2 and not s.seen and not s.pending
    with pytest.raises(WSPViolation, match=r"rank 2 sent a pull of wave 1 claiming VW 0 stage 0, which is rank 0") as e:
        s.pull(2, 0, 0, 1)
    assert e.value.sender == 2 and not s.queued
    with pytest.raises(WSPViolation, match=r"rank 2 sent a push of wave 0 claiming VW 5 stage 0, which the plan does "
                                           r"not have") as e:
        s.push(5, 0, 0, np.ones(5, np.float32), src=2)
    assert e.value.sender == 2
    s.push(0, 0, 0, np.ones(5, np.float32), src=0)     # the true sender is taken


def test_a_pull_beyond_the_staleness_window_names_its_sender():
    """A stage pulls wave w only after its pull of w - 1 was answered (the global clock at w - 1 - D): a pull
    of a later wave is refused at once, naming its sender, instead of waiting forever for a clock that the
    protocol never reaches."""
    s = _shard(1)
    s.pull(0, 0, 0, 2)                                  # wave 2 = clock 0 + D + 1: the window's last
    with pytest.raises(WSPViolation, match=r"pull of wave 3 from VW 0 stage 0 \(rank 0\) is beyond VW 0's clock 0 "
                                           r"\+ D \+ 1 = 2") as e:
        s.pull(0, 0, 0, 3)
    assert e.value.sender == 0


def test_missing_cuda_device_is_a_launch_error():
    st = StagePlan("cuda:3", "gpu", 0, 1, 0.0, 0.0)
    with pytest.raises(LaunchError, match="the plan asks for cuda:3 but this host has no CUDA device"):
        resolve_device(st, emulate=None, cuda_count=0)
    dev, emulated = resolve_device(StagePlan("n0.g1", "titan_v", 0, 1, 0.0, 0.0), emulate=None, cuda_count=0)
    assert dev == torch.device("cpu") and emulated


def test_missing_mpi4py_is_a_clear_error(monkeypatch):
    import sys

    from hetpipe.job.world import MPIUnavailable, world
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(MPIUnavailable, match="mpi4py is not importable"):
        world()


def _common():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    import common
    return common


def _same(a, b) -> bool:
    return a.losses == b.losses and sorted(a.weights) == sorted(b.weights) and all(
        np.array_equal(a.weights[l], b.weights[l]) for l in a.weights)


def test_stage_segments():
    from hetpipe.stage.params import segments
    assert segments(0, 5, (1, 2)) == [(False, range(0, 1)), (True, range(1, 3)), (False, range(3, 5))]
    assert segments(3, 6, ()) == [(False, range(0, 3))]
    assert segments(3, 6, (3, 4, 5)) == [(True, range(0, 3))]
    assert segments(3, 6, (5,)) == [(False, range(0, 2)), (True, range(2, 3))]


@pytest.mark.parametrize("cuts,recompute", [
    ([3], [(1,), (4, 5)]),             # a middle layer; the last stage's tail (its loss waits for Recompute)
    ([3], [(0, 1, 2), (3,)]),          # a whole stage; the head of the last stage
    ([2, 4], [(0,), (), (5,)]),        # a stage that recomputes nothing runs Recompute as a no-op
    ([2, 4], [(), (2, 3), (4,)]),
])
def test_per_layer_recompute_equals_no_recompute(cuts, recompute):
    c = _common()
    from hetpipe.run.trainer import Trainer
    plan = c.one_vw_plan(cuts, nm=2, d=0)
    ref = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan, epochs=2).replay()
    rec_plan = c.with_recompute(plan, recompute)
    trainer = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=rec_plan, epochs=2)
    from hetpipe.schedule import Recompute
    assert any(isinstance(i, Recompute) for i in trainer.spec(rec_plan).schedules[0].streams[0])
    got = trainer.replay()
    assert _same(got, ref)
    assert list(ref.losses[0].values())[0] != list(ref.losses[0].values())[-1]


def test_recompute_outside_the_stage_is_an_error():
    from hetpipe.stage.params import StageModel
    c = _common()
    with pytest.raises(ValueError, match=r"stage layers \[0, 3\) cannot recompute layers \[4\]"):
        StageModel(list(c.mlp()), 0, 3, nm=1, shard_layers={}, optimizer_factory=c.sgd(),
                   device=torch.device("cpu"), recompute=(1, 4))


def test_forward_keeps_only_the_inputs_of_recomputed_segments():
    from hetpipe.stage.params import StageModel
    c = _common()
    m = StageModel(list(c.mlp()), 0, 6, nm=1, shard_layers={}, optimizer_factory=c.sgd(),
                   device=torch.device("cpu"), recompute=(2, 3, 4, 5))
    out = m.forward(0, torch.randn(4, 64), needs_input_grad=False)
    assert m.recomputes_output and not out.requires_grad
    assert m.saved[0][1][1] is None and m.saved[0][0][1] is not None
    with pytest.raises(RuntimeError, match=r"Recompute\(0\) must precede Bwd\(0\)"):
        m.output_of(0)
    again = m.recompute_forward(0)
    assert again.requires_grad and torch.equal(again, out)


@pytest.mark.parametrize("cuts,nm,d,split", [([3], 2, 0, 2), ([2, 4], 3, 0, 4), ([2, 4], 2, 1, 3), ([], 1, 0, 1)])
def test_split_startup_trains_like_the_unsplit_schedule(cuts, nm, d, split):
    c = _common()
    from hetpipe.run.trainer import Trainer
    plan = c.one_vw_plan(cuts, nm=nm, d=d)
    ref = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan, epochs=2).replay()
    trainer = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan, epochs=2,
                      planning=Planning(split_startup=split))
    assert trainer.spec(plan).schedules[0].split == split
    got = trainer.replay()
    assert sorted(got.losses[0]) == sorted(ref.losses[0])
    assert max(abs(got.losses[0][p] - ref.losses[0][p]) for p in ref.losses[0]) <= 1e-6
    assert sorted(got.weights) == sorted(ref.weights)
    assert max(float(np.abs(got.weights[l] - ref.weights[l]).max(initial=0)) for l in ref.weights) <= 1e-6
    assert not _same(got, ref)          # the halves really ran: float sums differ in the last bits


def test_split_feed_halves_each_minibatch_once():
    from hetpipe.stage.feed import MinibatchFeed
    from hetpipe.stage.executor import StageError
    from hetpipe.schedule import hetpipe_schedule
    layout = hetpipe_schedule(1, 3, 1, 0, split_startup=1)
    feed = MinibatchFeed(iter([torch.arange(5), torch.arange(4), torch.arange(2)]), layout)
    assert feed.get(0).tolist() == [0, 1, 2] and feed.share(0) == 0.6
    assert feed.get(1).tolist() == [3, 4] and feed.share(1) == 0.4
    assert feed.get(2).tolist() == [0, 1, 2, 3] and feed.share(2) == 1.0
    with pytest.raises(StageError, match="minibatch 1 requested out of order"):
        MinibatchFeed(iter([]), layout).get(2)


def test_copy_stream_path_equals_inline_copies():
    c = _common()
    from hetpipe.run.replay import replay_run
    from hetpipe.run.trainer import Trainer
    plan = c.one_vw_plan([2, 4], nm=3, d=0)
    ref = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan, epochs=2).replay()
    spec = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan, epochs=2).spec(plan)
    spec.copy_stream = True
    assert _same(replay_run(spec), ref)


def test_copy_stager_sends_in_order_and_returns_slots():
    import hetpipe_core
    from hetpipe.transport.device_copy import CopyStager
    from hetpipe.transport.protocol import Message
    pool = hetpipe_core.PinnedBufferPool(4, 1 << 16)
    stager = CopyStager(pool, torch.device("cpu"))
    stager.out_stream.enqueue_sleep(0.05)       # the copies queue behind this
    ts = [torch.full((1000,), float(i)) for i in range(3)]
    for i, t in enumerate(ts):
        stager.copy_out(t, 1, Header(ACT, 0, 0, i, -1, "float32", (1000,), 4000))
    got = []
    while len(got) < 3:
        got.extend(stager.ready_sends())
        if len(got) < 3:
            stager.wait()
    assert [h.mb for _, h, _ in got] == [0, 1, 2] and stager.pending() == 0
    for (_, h, slot), t in zip(got, ts):
        assert torch.equal(torch.from_numpy(slot.numpy("float32", 1000)), t)
        back = stager.copy_in(Message(0, h, slot.numpy("uint8", 4000), slot), torch.float32)
        assert torch.equal(back.reshape(-1), t)
    stager.wait()
    stager.poll()
    assert stager.pending() == 0 and pool.available() == 4
    stager.close()


def test_a_received_payload_does_not_wait_behind_outgoing_copies():
    # One copy stream per direction: a payload copied in completes while the outgoing stream is still
    # busy (held here by a 3 s sleep, as a large push would hold it). On one shared stream copy_in,
    # which on the CPU waits for its copy, would return only after the sleep and the outgoing copy
    # behind it, which would then be ready to send.
    import hetpipe_core
    from hetpipe.transport.device_copy import CopyStager
    from hetpipe.transport.protocol import Message
    pool = hetpipe_core.PinnedBufferPool(4, 1 << 16)
    stager = CopyStager(pool, torch.device("cpu"))
    stager.out_stream.enqueue_sleep(3.0)
    assert stager.copy_out(torch.ones(1000), 2, Header(ACT, 0, 0, 0, -1, "float32", (1000,), 4000))
    slot = pool.acquire(4000)
    slot.numpy("float32", 1000)[:] = 7.0
    h = Header(ACT, 0, 0, 1, -1, "float32", (1000,), 4000)
    back = stager.copy_in(Message(0, h, slot.numpy("uint8", 4000), slot), torch.float32)
    assert torch.equal(back, torch.full((1000,), 7.0))
    assert list(stager.ready_sends()) == []             # the outgoing copy is still behind the sleep
    stager.poll()
    assert stager.pending() == 1 and pool.available() == 3     # the received slot came back
    stager.close()
    assert pool.available() == 4


def test_overriding_nm_or_d_clears_the_prediction_and_refuses_a_larger_nm_that_may_not_fit():
    import dataclasses
    from hetpipe.run.trainer import Trainer
    c = _common()
    plan = dataclasses.replace(c.one_vw_plan([3], nm=2, d=0), throughput=5.0)
    got = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan,
                  planning=Planning(nm=1, d=1)).resolve_plan()
    assert (got.nm, got.d, got.throughput) == (1, 1, 0.0)
    assert "nm 2 -> 1, d 0 -> 1" in got.meta["prediction"]
    same = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan,
                   planning=Planning(nm=2, d=0)).resolve_plan()
    assert same.throughput == 5.0 and "prediction" not in same.meta
    vw = plan.virtual_workers[0]
    sized = dataclasses.replace(plan, virtual_workers=(dataclasses.replace(vw, stages=tuple(
        dataclasses.replace(st, memory_bytes=900, memory_capacity=1000) for st in vw.stages)),))
    assert Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=sized,
                   planning=Planning(nm=1)).resolve_plan().nm == 1
    with pytest.raises(LaunchError, match=r"nm = 3 exceeds the plan's nm = 2, for which VW 0 stage 0 on cpu was "
                                          r"sized to 900 of its 1000 bytes.*re-plan"):
        Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=sized, planning=Planning(nm=3)).resolve_plan()
    assert Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan,
                   planning=Planning(nm=3)).resolve_plan().nm == 3


@pytest.mark.parametrize("copy_stream", [False, True])
def test_a_full_slot_pool_blocks_the_stage_instead_of_waiting_for_itself(copy_stream):
    import threading

    import hetpipe_core
    from hetpipe.transport.drive import PeerTimeout, drive
    from hetpipe.run.build import build_stage
    from hetpipe.run.trainer import Trainer
    c = _common()
    plan = c.one_vw_plan([3], nm=2, d=0)
    spec = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan).spec(plan)
    spec.copy_stream = copy_stream
    pool = hetpipe_core.PinnedBufferPool(2, 1 << 16)
    held = [pool.acquire(16), pool.acquire(16)]
    # Frees the slots late, so that a stage blocking inside acquire() fails the asserts instead of hanging.
    rescue = threading.Timer(30.0, lambda: [pool.release(s) for s in held])
    rescue.start()
    try:
        ex = build_stage(spec, 0, 0, LoopbackHub().endpoint(0, pool), pool)
        with pytest.raises(PeerTimeout, match=r"VW 0 stage 0 \(rank 0\) waited 0.2 s for a free pinned slot "
                                              r"\(2 of 2 in use\) to send the activation of minibatch 0"):
            drive(ex, 0.2, "VW 0 stage 0 (rank 0)")
    finally:
        rescue.cancel()
        rescue.join()
    assert ex.pc == 1 and pool.available() == 0
    for s in held:
        pool.release(s)
    assert ex.step() and ex.pc > 2


def test_a_minibatch_larger_than_the_first_is_a_clear_error():
    from hetpipe.stage.executor import StageError
    from hetpipe.run.trainer import Trainer
    c = _common()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in (16, 16, 1024, 16)]
    plan = c.one_vw_plan([3], nm=2, d=0)
    with pytest.raises(StageError, match=r"VW 0 stage 0 \(rank 0\): the activation of minibatch 2 of VW 0 is "
                                         r"\[1024, 32\] \(131072 bytes\) .* minibatches must not exceed the first"):
        Trainer(c.mlp(), c.cross_entropy, c.sgd(), data, plan=plan).replay()


def test_pushes_are_float32_whatever_the_default_dtype(monkeypatch):
    """A replay under a float64 default dtype; the PS rejects any push that is not float32 of its size."""
    import dataclasses

    from hetpipe.run.replay import replay_run
    from hetpipe.run.trainer import Trainer
    from hetpipe.transport.protocol import PUSH
    from hetpipe.transport.loopback import LoopbackTransport
    from hetpipe.schedule import Apply
    c = _common()
    plan = c.one_vw_plan([3], nm=2, d=0)
    spec = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(), plan=plan).spec(plan)
    # Without Apply every wave's delta is the zero vector the stage makes itself.
    sched = spec.schedules[0]
    spec.schedules = [dataclasses.replace(sched, streams=tuple(
        tuple(i for i in stream if not isinstance(i, Apply)) for stream in sched.streams))]
    pushes = []
    send = LoopbackTransport.send

    def recording_send(self, dest, h, slot=None):
        if h.kind == PUSH:
            pushes.append(h)
        send(self, dest, h, slot)

    monkeypatch.setattr(LoopbackTransport, "send", recording_send)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        result = replay_run(spec)
    finally:
        torch.set_default_dtype(default)
    assert pushes and all(h.dtype == "float32" and h.nbytes == 4 * h.shape[0] for h in pushes)
    start = [p.detach().reshape(-1) for p in c.mlp().parameters()]
    assert np.array_equal(np.concatenate([result.weights[l] for l in sorted(result.weights)]), torch.cat(start).numpy())


def test_the_shard_rejects_a_push_of_the_wrong_dtype_or_size():
    import hetpipe_core
    from hetpipe.ps.server import ShardServer
    from hetpipe.transport.protocol import PUSH
    hub = LoopbackHub()
    pool = hetpipe_core.PinnedBufferPool(4, 4096)
    server = ShardServer(_shard(0), hub.endpoint(9, pool), pool, 3)
    stage = hub.endpoint(0, pool)
    slot = pool.acquire(40)
    stage.send(9, Header(PUSH, 0, 0, -1, 0, "float64", (5,), 40), slot)
    with pytest.raises(WSPViolation, match=r"push from VW 0 stage 0 wave 0 \(rank 0\) is float64\[5\] \(40 bytes\), "
                                           r"expected float32\[5\] \(20 bytes\)"):
        server.step()
    hub.endpoint(2, pool).send(9, Header(PUSH, 1, 1, -1, 0, "float32", (3,), 12), pool.acquire(12))
    with pytest.raises(WSPViolation, match=r"VW 1 stage 1 wave 0 \(rank 2\) is float32\[3\] \(12 bytes\), "
                                           r"expected float32\[2\]"):
        server.step()


def test_an_apply_after_its_waves_push_is_an_error():
    import dataclasses

    from hetpipe.run.replay import replay_run
    from hetpipe.run.trainer import Trainer
    from hetpipe.schedule import Apply, Push
    c = _common()
    plan = c.one_vw_plan([], nm=2, d=0)
    spec = Trainer(c.mlp(), c.cross_entropy, c.sgd(), c.synthetic(n=64), plan=plan).spec(plan)
    sched = spec.schedules[0]
    stream = list(sched.streams[0])
    # Hand-written order (validate() rejects it): Apply(1) moved after Push(0).
    stream.remove(Apply(1))
    stream.insert(stream.index(Push(0)) + 1, Apply(1))
    spec.schedules = [dataclasses.replace(sched, streams=(tuple(stream),))]
    with pytest.raises(RuntimeError, match=r"Apply of micro-batch\(es\) \[1\] after Push\(0\): wave 0's delta "
                                           r"was already sent"):
        replay_run(spec)


def test_initial_weights_are_keyed_by_model_layer_index():
    from hetpipe.model.weights import initial_weights
    layers = list(_common().mlp())
    got = initial_weights(layers[2:4], 2)
    assert sorted(got) == [2, 3] and got[3].size == 0
    assert np.array_equal(got[2], torch.cat([layers[2].weight.reshape(-1), layers[2].bias]).detach().numpy())


def test_the_shard_names_a_push_from_a_stage_without_its_layers():
    import hetpipe_core
    from hetpipe.ps.server import ShardServer
    from hetpipe.transport.protocol import PUSH
    hub = LoopbackHub()
    pool = hetpipe_core.PinnedBufferPool(4, 4096)
    server = ShardServer(_shard(0), hub.endpoint(9, pool), pool, 3)
    hub.endpoint(0, pool).send(9, Header(PUSH, 0, 1, -1, 0, "float32", (2,), 8), pool.acquire(8))
    with pytest.raises(WSPViolation, match="rank 0 sent a push of wave 0 claiming VW 0 stage 1, which the plan does "
                                           "not have"):
        server.step()
    # A stage the plan has, holding none of this shard's layers: a shard of layer 0 only, VW 1 stage 1 (rank 2).
    server = ShardServer(ShardState(0, {0: np.zeros(3, np.float32)}, [[(0, 2)], [(0, 1), (1, 2)]], 0),
                         hub.endpoint(8, pool), pool, 3)
    hub.endpoint(2, pool).send(8, Header(PUSH, 1, 1, -1, 0, "float32", (2,), 8), pool.acquire(8))
    with pytest.raises(WSPViolation, match=r"VW 1 stage 1 \(rank 2\) holds none of its layers but pushed"):
        server.step()


def test_pull_replies_wait_for_a_free_slot_without_blocking_the_shard():
    import threading

    import hetpipe_core
    from hetpipe.ps.server import ShardServer
    from hetpipe.transport.protocol import PULL, WEIGHTS
    hub = LoopbackHub()
    pool = hetpipe_core.PinnedBufferPool(1, 4096)
    server = ShardServer(_shard(0), hub.endpoint(9, pool), pool, 3)
    stage, other = hub.endpoint(0, None), hub.endpoint(1, None)
    stage.send(9, Header(PULL, 0, 0, -1, 0))
    other.send(9, Header(PULL, 1, 0, -1, 0))
    held = pool.acquire(16)
    # Frees the slot late, so that a shard blocking inside acquire() fails the asserts instead of hanging.
    rescue = threading.Timer(30.0, pool.release, (held,))
    rescue.start()
    try:
        assert server.step()                        # takes both pulls in, answers none
    finally:
        rescue.cancel()
        rescue.join()
    assert stage.try_recv(9, WEIGHTS) is None and len(server.state.queued) == 2
    assert "blocked on a free pinned slot (1 of 1 in use) for pull replies" in server.blocked_on
    pool.release(held)
    server.step()                                   # one slot: one reply now, the other stays queued
    assert stage.try_recv(9, WEIGHTS).header.vw == 0 and len(server.state.queued) == 1
    server.step()
    assert other.try_recv(9, WEIGHTS).header.vw == 1 and not server.state.queued


def test_each_step_adds_after_minus_before_whether_or_not_the_newest_stash_is_current():
    """A step adds (weights after - weights before) to its wave's delta. Its "before" is the newest
    stash where that stash copied the current weights (F3 then B3, A3), else a copy: after another
    step (B1, A1 follow A0 with F1's stash the newest) or a pull merge (F2, merge, A2). Reference: the
    live weights read by hand around every step, float32 as torch computes it."""
    from hetpipe.stage.params import StageModel
    c = _common()
    m = StageModel(list(c.mlp()), 0, 6, nm=4, shard_layers={0: range(6)}, optimizer_factory=c.sgd(),
                   device=torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 64, generator=g) for _ in range(4)]
    ys = [torch.randint(0, 10, (4,), generator=g) for _ in range(4)]
    weights = lambda: torch.cat([p.detach().reshape(-1) for p in m.params])  # noqa: E731
    expected = torch.zeros_like(weights())
    outs = {}

    def fwd(mb):
        outs[mb] = m.forward(mb, xs[mb], needs_input_grad=False)

    def bwd_apply(mb):
        m.backward(mb, torch.nn.functional.cross_entropy(outs.pop(mb), ys[mb]), None)
        m.gather([mb], 0)
        before = weights().clone()
        m.step(0)
        expected.add_(weights() - before)
        assert torch.equal(m.ledger.deltas[0], expected), f"the delta after Apply({mb})"

    fwd(0), fwd(1), bwd_apply(0), bwd_apply(1)
    fwd(2)
    n = weights().numel()
    m.ledger.merge_pull({0: (0, torch.linspace(-1, 1, n))})
    bwd_apply(2)
    fwd(3), bwd_apply(3)
