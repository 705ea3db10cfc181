"""A stage rank's pinned pool: slot classes sized by kind (values by the largest activation or tied-gradient
message, PS payloads by each shard's part of the stage) and counted by what is in flight (Nm, D); every
message of a real replay fits the class of its kind exactly; a CUDA stage's pool that is not page-locked is
reported in one line, or refused when HETPIPE_REQUIRE_PINNED=1."""

import sys
from pathlib import Path

import pytest

import hetpipe_core
from hetpipe.run import build, replay
from hetpipe.run.trainer import Trainer
from hetpipe.transport import link as link_module
from hetpipe.transport import slots
from hetpipe.transport.protocol import ACT, EVAL, GRAD, TIED

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
import real_models as rm  # noqa: E402
from common import one_vw_plan, sgd, synthetic  # noqa: E402

VALUES = (ACT, GRAD, TIED, EVAL)


def test_counts_follow_nm_and_d_and_sizes_follow_each_kind():
    mib = 1 << 20
    assert slots.stage_slot_classes(4, 1, 25 * mib, [250 * mib, 0, 100 * mib]) == [
        (2 * 4 + 2 * 2, 25 * mib), (1 + 3, 250 * mib), (1 + 3, 100 * mib)]
    # A tied peer adds Nm outgoing tied gradients and one more peer's incoming payloads.
    assert slots.stage_slot_classes(2, 0, 100, [5000], value_peers=2, tied_peers=1) == [
        (2 * 2 + 2 + 2 * 2, 4096), (3, 8192)]


def _traffic(monkeypatch, spec):
    """Replay ``spec``; per stage pool, the largest value payload and per PS rank the largest PS payload
    it moved (sent or received), and the pools themselves."""
    pools, seen = {}, {}

    def recording_pool(spec_, vw, s, _real=build.stage_pool):
        pool = _real(spec_, vw, s)
        pools[(vw, s)] = pool
        return pool

    def note(link, peer, header):
        if header.nbytes:
            key = "values" if header.kind in VALUES else peer
            mine = seen.setdefault(id(link.pool), {})
            mine[key] = max(mine.get(key, 0), header.nbytes)

    real_send, real_recv = link_module.StageLink.send, link_module.StageLink.try_recv

    def send(self, dest, header, t):
        sent = real_send(self, dest, header, t)
        if sent:
            note(self, dest, header)
        return sent

    def try_recv(self, src, kind, **options):
        got = real_recv(self, src, kind, **options)
        if got is not None:
            note(self, src, got[0])
        return got

    monkeypatch.setattr(replay, "stage_pool", recording_pool)
    monkeypatch.setattr(link_module.StageLink, "send", send)
    monkeypatch.setattr(link_module.StageLink, "try_recv", try_recv)
    replay.replay_run(spec)
    return pools, seen


@pytest.mark.parametrize("cuts", [[2], [1, 4]])
def test_every_message_of_a_replay_fits_its_kind_exactly(monkeypatch, cuts):
    """The tied model (layer 0's weight is layer 4's output matrix) on two PS shards: the stage holding
    layer 4 without layer 0 exchanges tied gradients (32 x 64 floats, larger than its activations) and
    pulls that replica from its owner's shard."""
    nm, d = 2, 1
    plan = one_vw_plan(cuts, nm=nm, d=d, num_layers=5, shards=2)
    spec = Trainer(rm.tied_mlp(), rm.tied_loss, sgd(), synthetic(n=64), plan=plan, epochs=1).spec(plan)
    pools, seen = _traffic(monkeypatch, spec)
    assert set(pools) == {(0, s) for s in range(len(cuts) + 1)}
    for (vw, s), pool in pools.items():
        moved = seen[id(pool)]
        shards = {plan.ps_rank(sh.index): sh.index for sh in plan.ps_shards}
        ps = [r for r in shards if r in moved]
        # Each class is as large as its kind's largest message, no larger (classes of one size merge);
        # Nm, D, the neighbours and tied peers count the slots.
        assert {b for _, b in pool.classes} == {slots.round_slot(moved[k]) for k in ["values", *ps]}, (s, moved)
        tied = len(build.tied_message_bytes(plan, spec.layout, vw, s))
        neighbours = (s > 0) + (s < len(cuts))
        assert pool.num_slots == 2 * nm + nm * tied + 2 * (neighbours + tied) + (d + 3) * len(ps)
        # The old pool: 2 Nm + 2 shards + 8 slots, each as large as the stage's activations and weights together.
        params = max(moved[r] for r in shards if r in moved)
        old = (2 * nm + 2 * len(shards) + 8) * slots.round_slot(max(moved["values"], params))
        assert pool.total_bytes < old


def test_an_unpinned_pool_for_a_cuda_stage_is_reported_or_refused(monkeypatch, capfd):
    monkeypatch.delenv(slots.REQUIRE_PINNED_ENV, raising=False)
    pool = slots.stage_pool([(3, 4096), (2, 8192)], 0, "VW 0 stage 1 (rank 1)")
    err = capfd.readouterr().err
    if hetpipe_core.build_info()["cuda_available"]:
        assert pool.pinned and err == ""
        return
    assert not pool.pinned
    assert err.count("\n") == 1 and err.startswith("hetpipe: VW 0 stage 1 (rank 1): its 5 pool slots (28672 bytes)")
    assert pool.pin_error in err and "HETPIPE_REQUIRE_PINNED=1" in err
    monkeypatch.setenv(slots.REQUIRE_PINNED_ENV, "1")
    with pytest.raises(slots.PinningError) as refused:
        slots.stage_pool([(3, 4096), (2, 8192)], 0, "VW 0 stage 1 (rank 1)")
    assert "(28672 bytes)" in str(refused.value) and f"pageable memory: {pool.pin_error}" in str(refused.value)
    # Host memory asked for (a CPU stage, device -1) is what it should be: nothing to say.
    slots.stage_pool([(1, 4096)], -1)
    assert capfd.readouterr().err == ""
