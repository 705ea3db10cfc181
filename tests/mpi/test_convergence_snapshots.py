"""bench/convergence's hetpipe worker under mpiexec: the weights it records per wave are the PS's global
weights, checked at the last wave against the single-process replay of the same plan (D = 0 is
reproducible), and the next-to-last against a replay one wave shorter."""

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
              minibatches=3 * per_wave, snapshot_waves=1, timeout_s=60)
    save_jobs(tmp_path / "jobs.json", [job])
    res = run_worker(BENCH / "convergence" / "train_hetpipe.py", plan.num_ranks, tmp_path / "jobs.json",
                     tmp_path / "result.json", timeout_s=240)
    assert res["runs"][0]["samples"] == 3 * per_wave * TINY.minibatch
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
