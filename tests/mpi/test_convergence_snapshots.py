"""bench/convergence's workers under mpiexec, whose recorded weights the virtual clock is checked against.
hetpipe's: the weights it records per wave are the PS's global weights, checked at the last wave against
the single-process replay of the same plan (D = 0 is reproducible), and the next-to-last against a
replay one wave shorter; each snapshot names its version and the run writes its record. DDP's with
unequal shares: the weights at each snapshot are those of a one-process loop over the global batch for
as many steps as the snapshot names."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH / "convergence"), str(BENCH / "e2e")]

import snapshots  # noqa: E402
from hetpipe.plan.cluster import load_cluster  # noqa: E402
from hetpipe.plan import make_plan  # noqa: E402
from hetpipe.model.measure import profile_model  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.run.config import PSRule  # noqa: E402
from devices import DeviceModel  # noqa: E402
from hetpipe.run.record import RunRecord  # noqa: E402
from job import Job, save_jobs  # noqa: E402
from launch import run_worker  # noqa: E402
from task import MinibatchStream, TaskSpec, build_layers, corpus, loss_fn, optimizer  # noqa: E402

TINY = TaskSpec(context=16, width=16, heads=2, blocks=2, minibatch=4, train_bytes=1 << 18, val_windows=8)


def replay_weights(plan, text, minibatches: int, lr: float) -> dict:
    data = MinibatchStream(text, TINY, seed=5, count=minibatches)
    trainer = Trainer(build_layers(TINY, 5), loss_fn, lambda p: optimizer(p, lr), data, plan=plan,
                      ps=PSRule(aggregate="sum"))
    return trainer.replay().weights


@pytest.mark.slow
def test_recorded_weights_are_the_global_weights_of_each_wave(tmp_path):
    torch.set_num_threads(1)
    text, _, _ = corpus(TINY)
    x, y = MinibatchStream(text, TINY, seed=5, count=1)[0]
    cluster = load_cluster("cpu-emulated")
    prof = profile_model(torch.nn.Sequential(*build_layers(TINY, 5)), x, cluster, loss_fn=lambda o: loss_fn(o, y),
                         repeats=1)
    plan = dataclasses.replace(make_plan(cluster, prof, nm=2, d=0, minibatch_size=TINY.minibatch), d=0)
    plan.save(tmp_path / "plan.json")
    per_wave = len(plan.virtual_workers) * plan.nm
    job = Job(system="hetpipe", task=TINY, seed=5, lr=3e-3, budget_s=1.0, snapshot_every_s=0.0,
              device_model="", snapshots=str(tmp_path / "snaps.npz"), plan=str(tmp_path / "plan.json"), d=0,
              minibatches=3 * per_wave, snapshot_waves=1, timeout_s=60, record=str(tmp_path / "record.json"))
    save_jobs(tmp_path / "jobs.json", [job])
    res = run_worker(BENCH / "convergence" / "train_hetpipe.py", plan.num_ranks, tmp_path / "jobs.json",
                     tmp_path / "result.json", timeout_s=240)
    assert res["runs"][0]["samples"] == 3 * per_wave * TINY.minibatch
    assert res["runs"][0]["snapshot_versions"] == [0, 1, 2, 3]
    record = RunRecord.load(tmp_path / "record.json")
    # Every stage pulls from each shard that owns some of its layers, before each wave but the first; at
    # D = 0 the pull for wave w waits for W_w, the global weights with every VW's waves before it (w - g = 0).
    pairs = sum(1 for sh in plan.ps_shards for v in plan.virtual_workers for st in v.stages
                if any(st.start <= layer < st.stop for layer in sh.layers))
    assert record.staleness() == {0: 2 * pairs}
    snaps = snapshots.load(tmp_path / "snaps.npz")
    times = [t for t, _ in snaps]
    assert len(snaps) == 4 and times == sorted(times) and times[0] == 0.0   # W_0 .. W_3
    layers = build_layers(TINY, 5)
    first = {i: torch.cat([p.detach().reshape(-1) for p in l.parameters()]).numpy() for i, l in enumerate(layers)}
    for i, w in snaps[0][1].items():
        assert np.array_equal(w, first[i])
    for waves, (_, got) in ((3, snaps[3]), (2, snaps[2])):
        want = replay_weights(plan, text, waves * per_wave, 3e-3)
        assert sorted(got) == sorted(want)
        for layer in want:
            np.testing.assert_allclose(got[layer], want[layer], rtol=0, atol=1e-6,
                                       err_msg=f"layer {layer} after wave {waves}")


@pytest.mark.slow
def test_ddp_snapshots_are_the_one_process_update_after_the_steps_they_name(tmp_path):
    torch.set_num_threads(1)
    text, _, _ = corpus(TINY)
    n = len(build_layers(TINY, 5))
    # 30 ms per minibatch: about 25 steps in the budget, few enough for the bound below.
    DeviceModel([("d0", "t"), ("d1", "t")], {"t": [0.01 / n] * n}, {"t": [0.02 / n] * n}, TINY.minibatch,
                "30 ms per minibatch").save(tmp_path / "devices.json")
    windows = [3, 5]
    job = Job(system="hetero-dp", task=TINY, seed=5, lr=3e-3, budget_s=1.0, snapshot_every_s=0.15,
              device_model=str(tmp_path / "devices.json"), snapshots=str(tmp_path / "snaps.npz"), micro=2,
              windows=windows)
    save_jobs(tmp_path / "jobs.json", [job])
    run = run_worker(BENCH / "convergence" / "train_ddp.py", 2, tmp_path / "jobs.json", tmp_path / "result.json",
                     timeout_s=240)["runs"][0]
    steps = run["snapshot_steps"]
    snaps = snapshots.load(tmp_path / "snaps.npz")
    assert len(steps) == len(snaps) >= 3 and steps[0] == 0 and steps == sorted(set(steps))
    assert steps[-1] == run["steps"] and run["samples"] == run["steps"] * sum(windows)
    # The reference: one process, the mean loss over each step's 8 windows, the same stream and Adam,
    # its weights kept after every step. The all-reduce sums in another order, and Adam's division by
    # sqrt(v) blows the last-bit differences of tiny gradients up to lr-sized steps in a few weights
    # within tens of steps, so the weights are not compared elementwise: each snapshot must lie far
    # closer to the reference after the step it names than the reference moves in one step, which an
    # off-by-one step count or a different update fails.
    layers = build_layers(TINY, 5)
    model = torch.nn.Sequential(*layers)
    opt = optimizer(model.parameters(), 3e-3)
    stream = MinibatchStream(text, TINY, 5, count=0)
    ref = []
    for k in range(steps[-1] + 2):
        ref.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        x, y = stream.windows(k * sum(windows), sum(windows))
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    for k, (_, got) in zip(steps, snaps):
        flat = torch.cat([torch.from_numpy(got[i]) for i in range(n)])
        if k == 0:
            assert torch.equal(flat, ref[0])
            continue
        near = float((flat - ref[k]).norm())
        moved = min(float((ref[k] - ref[k - 1]).norm()), float((ref[k + 1] - ref[k]).norm()))
        assert near < 0.1 * moved, (k, near, moved)
