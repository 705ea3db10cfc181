"""Checkpoint files, data positions, optimizer state and replanning, each against an independent
reference: a writer process killed at random moments, brute-force enumeration of the data, the
optimizer that was never saved, and the plan's own VW list."""

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
from common import Tagged  # noqa: E402
from hetpipe.checkpoint import format as ckfmt  # noqa: E402
from hetpipe.checkpoint import state as ckpt  # noqa: E402
from hetpipe.loader import StreamSource  # noqa: E402


WRITER = """
import sys, torch
from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
w = ckpt.Checkpointer(sys.argv[1], 1, 0, lambda c: {"format": ckfmt.FORMAT, "clock": c, "parts": ["rank-00000"],
                                                    "plan": {}})
clock = 0
while True:
    clock += 1
    w.boundary(clock, lambda: ({"w/0": torch.full((1 << 20,), float(clock))}, {"role": "ps"}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
def test_a_writer_killed_mid_write_leaves_a_complete_checkpoint(tmp_path, trial):
    """A process writing a 4 MiB checkpoint (filled with its clock) at every clock, SIGKILLed at a random
    moment: the latest complete checkpoint reads back whole and self-consistent."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while ckfmt.latest(tmp_path) is None:
            assert proc.poll() is None, "the writer exited"
            assert time.monotonic() < deadline, "the writer wrote no checkpoint within 120 s"
            time.sleep(0.01)
        time.sleep(random.Random(trial).uniform(0.0, 0.3))
    finally:
        proc.kill()
        proc.wait()
    found = ckpt.Checkpoint.find(tmp_path)
    assert found.parts[0]["clock"] == found.clock
    t = found.tensors[0]["w/0"]
    assert t.numel() == 1 << 20 and bool((t == float(found.clock)).all())


def test_an_incomplete_checkpoint_is_skipped(tmp_path):
    w = ckpt.Checkpointer(tmp_path, 2, 0, lambda c: {"format": ckfmt.FORMAT, "clock": c, "parts": ["rank-00000", "rank-00001"],
                                                     "plan": {}})
    for clock in (1, 2):
        w.boundary(clock, lambda: ({"w/0": torch.ones(3)}, {"role": "ps"}))
    w.close()
    assert ckfmt.latest(tmp_path) is None        # rank 1 never wrote its part
    with pytest.raises(ckfmt.CheckpointError, match="no complete checkpoint"):
        ckpt.Checkpoint.find(tmp_path)


def _two_rank_writers(tmp_path):
    manifest = lambda c: {"format": ckfmt.FORMAT, "clock": c, "parts": ["rank-00000", "rank-00001"], "plan": {}}
    every = 1000                                      # nothing due: only the SIGTERM path writes
    return [ckpt.Checkpointer(tmp_path, every, r, manifest) for r in (0, 1)]


def test_sigterm_checkpoint_waits_for_the_peers_part(tmp_path):
    """A rank that wrote its SIGTERM part returns only once the slower peer's part of the same clock is
    on disk (mpiexec would otherwise end the peer halfway), and as soon as it is: with a bound on the
    wait that the test never reaches, only the peer's part can end it."""
    fast, slow = _two_rank_writers(tmp_path)
    for w in (fast, slow):
        w.boundary(1, lambda: ({"w/0": torch.ones(3)}, {"role": "ps"}))
    complete_when_returned = []

    def fast_rank():
        fast.on_signal(3600.0)
        complete_when_returned.append(ckfmt.is_complete(ckfmt.clock_dir(tmp_path, 1)))

    t = threading.Thread(target=fast_rank)
    t.start()
    own = ckfmt.clock_dir(tmp_path, 1) / "rank-00000.safetensors"
    deadline = time.monotonic() + 60                       # a hang guard, not a bound under test
    while not own.exists():
        assert time.monotonic() < deadline, "the SIGTERM path wrote no part of its own within 60 s"
        time.sleep(0.01)
    time.sleep(0.5)                                        # room for a rank that would not wait to return
    assert t.is_alive() and not complete_when_returned, "returned before the peer's part was on disk"
    slow.on_signal(5.0)
    t.join(timeout=60)
    assert not t.is_alive(), "still waiting 60 s after the peer's part was written"
    assert complete_when_returned == [True]
    for w in (fast, slow):
        w.close()


def test_sigterm_checkpoint_wait_is_bounded(tmp_path):
    """With no peer writing, the wait ends once ``wait_s`` has passed (not before); the rank's own part is
    on disk."""
    alone, _ = _two_rank_writers(tmp_path)
    alone.boundary(1, lambda: ({"w/0": torch.ones(3)}, {"role": "ps"}))
    started = time.monotonic()
    alone.on_signal(0.5)
    assert time.monotonic() - started >= 0.5              # a lower bound: no load can break it
    assert (ckfmt.clock_dir(tmp_path, 1) / "rank-00000.safetensors").exists()
    assert not ckfmt.is_complete(ckfmt.clock_dir(tmp_path, 1))
    alone.close()


@pytest.mark.parametrize("seed", range(40))
def test_data_position_continues_without_repeating_or_skipping(seed):
    rng = random.Random(seed)
    n, old, new, epochs = rng.randint(4, 13), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3)
    per = n // old
    if per == 0 or n // new == 0:
        return
    q = rng.randint(0, per * epochs - 1)
    data = Tagged(n)
    runs = [list(StreamSource(data).vw_stream(v, old, epochs)) for v in range(old)]
    consumed = {b for r in runs for b, _ in r[:q]}
    pos = ckfmt.DataPosition().advance(q, n, old)
    rest = [[b for b, _ in StreamSource(data).vw_stream(v, new, epochs, pos.epoch, pos.index)] for v in range(new)]
    assert all(len(r) == pos.per_vw(n, new, epochs) for r in rest)
    seen = [b for r in rest for b in r]
    assert len(seen) == len(set(seen)) and not consumed & set(seen)
    if new == old:                                  # the same VWs go on exactly where they stopped
        assert rest == [[b for b, _ in r[q:]] for r in runs]
    if n % old == 0 and n % new == 0:
        # Every minibatch is trained once, but for fewer than `new` of the cut's epoch, which the new
        # VWs cannot share evenly (each VW trains as many minibatches).
        missing = {(e, i) for e in range(epochs) for i in range(n)} - consumed - set(seen)
        assert len(missing) < new and all(e == pos.epoch for e, _ in missing)
        if new == 1 or new == old:
            assert not missing


def test_optimizer_state_round_trips_through_safetensors_and_json(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95))
    for _ in range(3):
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    keys = ["0.weight", "0.bias"]
    tensors, part = ckpt.optimizer_snapshot(opt, params, keys)
    ckpt.write_tensors(tmp_path / "t.safetensors", tensors)
    ckfmt.write_json(tmp_path / "p.json", part)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.Adam(twins, lr=1.0)
    import json
    saved = json.loads((tmp_path / "p.json").read_text())
    restored = ckpt.restore_optimizer(fresh, twins, keys, saved["groups"], saved["scalars"],
                                      ckpt.read_tensors(tmp_path / "t.safetensors"))
    assert restored == 2 and fresh.param_groups[0]["lr"] == 0.01
    for ps, o in ((params, opt), (twins, fresh)):
        sum((p ** 2).sum() for p in ps).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))


def test_optimizer_state_that_is_not_json_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["note"] = object()
    with pytest.raises(ckfmt.CheckpointError, match="'note' of 0.w"):
        ckpt.optimizer_snapshot(opt, [p], ["0.w"])


def test_plan_without_drops_the_vw_of_the_device():
    from hetpipe.launch.restart import device_of, plan_without
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    vws = tuple(VirtualWorkerPlan(v, tuple(StagePlan(f"n{v}.g{k}", "t", 3 * k, 3 * k + 3, 0.0, 0.0) for k in range(2)))
                for v in range(3))
    plan = Plan(6, 2, 0, "manual", vws, (ShardPlan(0, "n0", tuple(range(6))),))
    assert device_of(plan, 3) == "n1.g1" and device_of(plan, 6) is None
    # a renumbered world (discovery): the failed world rank is mapped to its plan rank first
    world_ranks = [6, 0, 1, 2, 3, 4, 5]
    assert device_of(plan, 6, world_ranks) == "n0.g0" and device_of(plan, 0, world_ranks) == "n0.g1"
    assert device_of(plan, 5, world_ranks) is None          # plan rank 6: the PS shard
    left = plan_without(plan, ["n1.g1"])
    assert [vw.devices for vw in left.virtual_workers] == [("n0.g0", "n0.g1"), ("n2.g0", "n2.g1")]
    assert [vw.index for vw in left.virtual_workers] == [0, 1] and left.num_ranks == 5
    with pytest.raises(ValueError, match=r"\['n9.g0'\] are not in the plan"):
        plan_without(plan, ["n9.g0"])
    with pytest.raises(ValueError, match="no virtual worker"):
        plan_without(plan, ["n0.g0", "n1.g0", "n2.g1"])
