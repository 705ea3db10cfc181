"""Checkpoints and restarts on real `hetpipe launch` runs under mpiexec, against independent references:
an uninterrupted run (bitwise, D = 0), and single-process replays of the plans before and after a
restart chained through the weights at the cut."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpirun import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 300.0


def _launch(*args: str, cwd=SCRIPTS) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hetpipe.cli", "launch", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)     # the launcher ends its run's processes itself
        out, err = proc.communicate()
        pytest.fail(f"the launch did not finish within {RUN_TIMEOUT_S} s:\n{err}")
    return proc.returncode, err


def _wait_for_waves(proc: subprocess.Popen, metrics: Path, wave: int) -> None:
    """Wait until the run's metrics file holds ``wave`` lines (VW 0 finished that many waves)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= wave):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1] if proc.poll() else ""
        time.sleep(0.01)


def _kill_at_wave(proc: subprocess.Popen, metrics: Path, ckpt_dir: Path, run_dir: Path, wave: int, rank: int) -> int:
    """SIGKILL ``rank`` once VW 0 finished ``wave`` waves and a complete checkpoint exists; returns its pid."""
    from hetpipe.checkpoint.format import latest

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        done = metrics.read_text().count("\n") if metrics.exists() else 0
        if done >= wave and latest(ckpt_dir) is not None:
            pid = int((run_dir / "attempt-0" / f"rank-{rank}.txt").read_text().split()[0])
            os.kill(pid, signal.SIGKILL)
            return pid
        if proc.poll() is not None:
            pytest.fail(f"the run ended before wave {wave}:\n{proc.communicate()[1]}")
        time.sleep(0.01)
    pytest.fail(f"the run did not reach wave {wave} within {START_TIMEOUT_S} s")


def _killed_run(tmp_path: Path, cfg: dict, seed: int, first_wave: int) -> tuple:
    """A 3-rank run checkpointing every 2 waves into ``tmp_path/ckpt``, whose random rank is SIGKILLed at
    a random wave (from ``first_wave`` to 10, drawn from ``seed``); returns (ckpt, victim, rc, stderr).
    ``cfg`` gets the metrics file the kill watches unless it names one."""
    rng = random.Random(seed)
    wave, victim = rng.randint(first_wave, 10), rng.randint(0, 2)
    cfg = {"metrics": str(tmp_path / "metrics.jsonl"), **cfg}
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    killed = _launch("-n", "3", "--run-dir", str(run), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                     "ckpt_run.py", str(tmp_path / "killed"), json.dumps(cfg))
    _kill_at_wave(killed, Path(cfg["metrics"]), ckpt, run, wave, victim)
    rc, err = _finish(killed)
    return ckpt, victim, rc, err


def _result(out: Path):
    res = json.loads((out / "result.json").read_text())
    with np.load(out / "weights.npz", allow_pickle=False) as z:
        weights = {int(k): z[k] for k in z.files}
    return res, weights


# AdamW with two parameter groups (weight decay on the weights only: group order is not the stages' flat
# order) and a OneCycleLR, whose nested state a resume must restore (a fresh one would step the rate and
# AdamW's beta1 differently).
CFG = {"nm": 2, "d": 0, "epochs": 2, "minibatches": 16, "cuts": [3], "time": 0.01, "groups": True, "one_cycle": True}


@pytest.fixture(scope="module")
def uninterrupted_out(tmp_path_factory):
    """The reference: the same run, never interrupted (its metrics and TensorBoard logs in its folder)."""
    out = tmp_path_factory.mktemp("ref")
    logs = {"metrics": str(out / "metrics.jsonl"), "tensorboard": str(out / "tb")}
    rc, err = _finish(_launch("-n", "3", "ckpt_run.py", str(out), json.dumps({**CFG, **logs})))
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_out):
    return _result(uninterrupted_out)


def _resume_and_compare(tmp_path, ckpt: Path, uninterrupted, cfg=CFG) -> int:
    """Resume from ``ckpt`` with `--resume`; the result must be the uninterrupted run's, bitwise.
    Returns the clock it resumed from."""
    rc, err = _finish(_launch("-n", "3", "--resume", str(ckpt), "--run-dir", str(tmp_path / "run2"),
                              "ckpt_run.py", str(tmp_path / "resumed"), json.dumps(cfg)))
    assert rc == 0, err
    (want, w_want), (got, w_got) = uninterrupted, _result(tmp_path / "resumed")
    clock = got["resumed"]["clock"]
    assert got["resumed"]["same_plan"] and 1 <= clock < 16
    assert sorted(w_got) == sorted(w_want)
    assert all(np.array_equal(w_got[l], w_want[l]) for l in w_want), "weights differ from the uninterrupted run"
    assert got["losses"] == want["losses"]          # before the cut from the checkpoint, after it from the resume
    assert len(want["losses"]["0"]) == 32
    # The resumed run trained only what was left after the cut.
    assert got["samples"] == 16 * (32 - clock * 2)
    return clock


def test_run_killed_at_a_random_wave_resumes_bitwise_at_d0(tmp_path, uninterrupted):
    """D = 0, 1 VW of 2 stages + a PS shard, grouped AdamW and OneCycleLR: killed (SIGKILL of a random
    rank at a random wave) and resumed with `--resume`, the run ends with the uninterrupted run's weights
    and losses, bitwise."""
    ckpt, victim, rc, err = _killed_run(tmp_path, CFG, 11, 3)
    assert rc != 0 and f"rank {victim}" in err, err
    assert _resume_and_compare(tmp_path, ckpt, uninterrupted) % 2 == 0


def _records(metrics: Path) -> list:
    """The wave and evaluation records of a metrics file, without what timing decides (clocks, rates)."""
    out = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r["event"] in ("wave", "eval"):
            out.append((r["event"], r["wave"], r["loss"], r.get("lr")))
    return out


def _scalars(tb: Path) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_a_resumed_run_continues_the_killed_runs_metrics_and_tensorboard(tmp_path, uninterrupted_out, uninterrupted):
    """Killed at a random wave and resumed into the same metrics file and TensorBoard folder: the file
    holds the uninterrupted run's wave records (the killed run's beyond the cut dropped, the rest
    appended), and TensorBoard shows the uninterrupted run's steps and losses (D = 0: bitwise). The
    callbacks of the resumed run are told the same waves, clocks and steps as the metrics file."""
    metrics, tb, told = tmp_path / "metrics.jsonl", tmp_path / "tb", tmp_path / "waves.jsonl"
    cfg = {**CFG, "metrics": str(metrics), "tensorboard": str(tb)}
    ckpt, victim, rc, err = _killed_run(tmp_path, cfg, 12, 4)
    assert rc != 0, err
    clock = _resume_and_compare(tmp_path, ckpt, uninterrupted, {**cfg, "waves_log": str(told)})
    want = _records(uninterrupted_out / "metrics.jsonl")
    assert len(want) == 16 and _records(metrics) == want
    waves = [json.loads(line) for line in told.read_text().splitlines()]
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(w["wave"], w["global_clock"], w["step"]) for w in waves] == \
        [(r["wave"], r["global_clock"], 2 * (r["wave"] + 1)) for r in logged if r["event"] == "wave"][clock:]
    steps = _scalars(tb)
    assert [s for s, _ in steps] == [2 * (w + 1) for w in range(16)]
    assert steps == _scalars(uninterrupted_out / "tb")


def test_run_resumed_into_another_plan_continues_its_optimizer_state_and_schedule(tmp_path, uninterrupted):
    """Killed at a random wave (2 stages cut at layer 3) and resumed with `--resume` into 3 stages cut
    at layers 2 and 4: each stage finds the grouped AdamW state of its parameters by their names in the
    old stages' parts, its groups' options, and OneCycleLR's state; the run ends within float tolerance
    of the uninterrupted one (a fresh optimizer state or schedule after the cut ends far from it)."""
    ckpt, victim, rc, err = _killed_run(tmp_path, CFG, 15, 3)
    assert rc != 0 and f"rank {victim}" in err, err
    rc, err = _finish(_launch("-n", "4", "--resume", str(ckpt), "--run-dir", str(tmp_path / "run2"), "ckpt_run.py",
                              str(tmp_path / "resumed"), json.dumps({**CFG, "cuts": [2, 4]})))
    assert rc == 0, err
    (want, w_want), (got, w_got) = uninterrupted, _result(tmp_path / "resumed")
    clock = got["resumed"]["clock"]
    assert not got["resumed"]["same_plan"] and 2 <= clock < 16 and clock % 2 == 0
    assert got["samples"] == 16 * (32 - clock * 2)
    assert sorted(w_got) == sorted(w_want)
    for l in w_want:
        np.testing.assert_allclose(w_got[l], w_want[l], rtol=1e-5, atol=1e-6, err_msg=f"layer {l}")
    in_order = lambda losses: [v for _, v in sorted((int(p), v) for p, v in losses["0"].items())]  # noqa: E731
    np.testing.assert_allclose(in_order(got["losses"]), in_order(want["losses"])[2 * clock:], rtol=1e-5)


# The PS's outer optimizers with state, which the PS part of each checkpoint holds: nesterov's momentum
# buffer; delayed nesterov's momentum, buffer and count, with a momentum step every 7 pushes (1 VW: every 7
# waves, twice in the run's 16), so that every cut a kill can leave (an even clock from 2 to 10) falls inside a
# window, its buffer non-zero.
OUTERS = {
    "nesterov": {**CFG, "outer": {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}},
    "delayed-nesterov": {**CFG, "outer": {"outer": "delayed-nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                                          "outer_delay": 7}},
}


@pytest.mark.parametrize("outer, seed", [("nesterov", 14), ("delayed-nesterov", 16)])
def test_outer_momentum_resumes_bitwise(tmp_path, outer, seed):
    """D = 0 with an outer optimizer keeping state: a run killed at a random wave and resumed from its
    checkpoint ends with the uninterrupted run's weights and losses, bitwise (the PS's momentum buffer,
    and delayed nesterov's buffer and count, came back too)."""
    cfg = OUTERS[outer]
    rc, err = _finish(_launch("-n", "3", "ckpt_run.py", str(tmp_path / "ref"), json.dumps(cfg)))
    assert rc == 0, err
    reference = _result(tmp_path / "ref")
    rc, err = _finish(_launch("-n", "3", "ckpt_run.py", str(tmp_path / "plain"), json.dumps(CFG)))
    assert rc == 0, err
    plain = _result(tmp_path / "plain")[1]
    assert not all(np.array_equal(plain[l], reference[1][l]) for l in plain), f"{outer} changed nothing"
    ckpt, victim, rc, err = _killed_run(tmp_path, cfg, seed, 3)
    assert rc != 0 and f"rank {victim}" in err, err
    if outer == "delayed-nesterov":
        from hetpipe.checkpoint.state import Checkpoint

        found = Checkpoint.find(ckpt)
        buffers, counts = found.global_delayed()
        assert set(counts.values()) == {found.clock % 7} and all(b.any() for b in buffers.values()), counts
    assert _resume_and_compare(tmp_path, ckpt, reference, cfg) % 2 == 0


def test_unequal_waves_resume_bitwise(tmp_path):
    """D = 0, 2 one-stage VWs whose waves are 3 and 2 minibatches long (the epoch dealt in rounds of 5,
    the PS weighing each VW's delta by its samples): killed at a random wave and resumed from its
    checkpoint, the run ends with the uninterrupted run's weights and losses, bitwise, having trained only
    what was left after the cut. The same plan with equal waves ends elsewhere."""
    cfg = {"vws": 2, "cuts": [], "nm": 2, "d": 0, "epochs": 2, "minibatches": 30, "time": 0.01, "waves": [3, 2]}
    rc, err = _finish(_launch("-n", "3", "ckpt_run.py", str(tmp_path / "ref"), json.dumps(cfg)))
    assert rc == 0, err
    want, w_want = _result(tmp_path / "ref")
    assert len(want["losses"]["0"]) == 36 and len(want["losses"]["1"]) == 24       # 12 waves of 3 and of 2
    rc, err = _finish(_launch("-n", "3", "ckpt_run.py", str(tmp_path / "equal"), json.dumps({**cfg, "waves": [0, 0]})))
    assert rc == 0, err
    w_equal = _result(tmp_path / "equal")[1]
    assert not all(np.array_equal(w_equal[l], w_want[l]) for l in w_want), "the waves changed nothing"
    ckpt, victim, rc, err = _killed_run(tmp_path, cfg, 17, 3)
    assert rc != 0 and f"rank {victim}" in err, err
    rc, err = _finish(_launch("-n", "3", "--resume", str(ckpt), "--run-dir", str(tmp_path / "run2"),
                              "ckpt_run.py", str(tmp_path / "resumed"), json.dumps(cfg)))
    assert rc == 0, err
    got, w_got = _result(tmp_path / "resumed")
    clock = got["resumed"]["clock"]
    assert got["resumed"]["same_plan"] and 1 <= clock < 12
    assert all(np.array_equal(w_got[l], w_want[l]) for l in w_want), "weights differ from the uninterrupted run"
    assert got["losses"] == want["losses"]
    assert got["samples"] == 16 * (60 - 5 * clock)


def test_sigterm_writes_a_checkpoint_to_resume_from(tmp_path, uninterrupted):
    """SIGTERM to `hetpipe launch` at a random wave, with no periodic checkpoint due (every 1000 waves):
    the ranks write the newest clock they all hold on SIGTERM, and the resumed run is bitwise the
    uninterrupted one."""
    from hetpipe.checkpoint.format import latest

    wave = random.Random(13).randint(2, 10)
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    proc = _launch("-n", "3", "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(ckpt),
                   "--checkpoint-every", "1000", "ckpt_run.py", str(tmp_path / "stopped"),
                   json.dumps({**CFG, "metrics": str(metrics)}))
    _wait_for_waves(proc, metrics, wave)
    os.kill(proc.pid, signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 128 + signal.SIGTERM and "interrupted by SIGTERM at wave" in err, err
    assert latest(ckpt) is not None and f"last complete checkpoint: {latest(ckpt)}" in err, err
    assert _resume_and_compare(tmp_path, ckpt, uninterrupted) >= wave - 1


def test_a_rank_stopped_by_sigterm_is_restarted_with_its_devices(tmp_path, uninterrupted):
    """One rank (not the launcher) gets SIGTERM at a random wave, as a preempting scheduler sends it: it
    writes the checkpoint it holds and ends; `--max-restarts 1` restarts the run with the same devices
    from the latest complete checkpoint, and the run ends with the uninterrupted run's weights and
    losses, bitwise (D = 0). Before, the rank's end read as a death: its device was left out, and with
    it the only VW, so nothing was restarted."""
    rng = random.Random(16)
    wave, victim = rng.randint(3, 10), rng.randint(0, 2)
    metrics, ckpt, run, out = tmp_path / "metrics.jsonl", tmp_path / "ckpt", tmp_path / "run", tmp_path / "out"
    proc = _launch("-n", "3", "--max-restarts", "1", "--run-dir", str(run), "--checkpoint-dir", str(ckpt),
                   "--checkpoint-every", "2", "ckpt_run.py", str(out), json.dumps({**CFG, "metrics": str(metrics)}))
    _wait_for_waves(proc, metrics, wave)
    os.kill(int((run / "attempt-0" / f"rank-{victim}.txt").read_text().split()[0]), signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 0, err
    assert f"restart 1 of 1: rank {victim} " in err and "was ended by a SIGTERM from outside the run" in err, err
    assert "restarting with the same devices; 1 VW(s) on 3 ranks; resuming from the checkpoint at clock" in err, err
    assert "Traceback" not in err, err
    (want, w_want), (got, w_got) = uninterrupted, _result(out)
    assert got["resumed"]["same_plan"] and got["resumed"]["clock"] >= 2
    assert all(np.array_equal(w_got[l], w_want[l]) for l in w_want), "weights differ from the uninterrupted run"
    assert got["losses"] == want["losses"]


def test_a_resume_into_more_vws_trains_what_they_can_share_and_names_the_rest(tmp_path):
    """2 VWs of one stage each, nm = 1, one epoch of 40 minibatches: the launcher is interrupted at a random
    wave (the ranks write the newest clock they share), and the run is resumed into 3 VWs. The 40 − 2c
    minibatches left after clock c are dealt to the 3 VWs from the cut: all are trained but the
    (40 − 2c) mod 3 they cannot share, which the start-up line names. Before, the deal stopped at the
    multiple of 3 counted from minibatch 0 (resumed at clock 5: 27 of the 30 left were trained)."""
    cfg = {"vws": 2, "nm": 1, "d": 0, "epochs": 1, "minibatches": 40, "time": 0.01}
    wave = random.Random(17).randint(3, 12)
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    proc = _launch("-n", "3", "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(ckpt),
                   "--checkpoint-every", "1000", "ckpt_run.py", str(tmp_path / "stopped"),
                   json.dumps({**cfg, "metrics": str(metrics)}))
    _wait_for_waves(proc, metrics, wave)
    os.kill(proc.pid, signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 128 + signal.SIGTERM, err
    rc, err = _finish(_launch("-n", "4", "--resume", str(ckpt), "--run-dir", str(tmp_path / "run2"), "ckpt_run.py",
                              str(tmp_path / "resumed"), json.dumps({**cfg, "vws": 3})))
    assert rc == 0, err
    res, _ = _result(tmp_path / "resumed")
    left = 40 - 2 * res["resumed"]["clock"]
    trained = sum(len(per) for per in res["losses"].values())
    assert res["vws"] == 3 and not res["resumed"]["same_plan"] and res["resumed"]["clock"] >= wave - 1
    assert trained == left - left % 3 and res["samples"] == 16 * trained
    lines = [line for line in err.splitlines() if "are trained and" in line]
    if left % 3:
        tail = "minibatch 39 of epoch 0" if left % 3 == 1 else "minibatches 38..39 of epoch 0"
        assert len(lines) == 1 and f"{trained} are trained and {left % 3} dropped ({tail})" in lines[0], err
    else:
        assert not lines, err


def test_max_restarts_goes_on_without_the_killed_device(tmp_path):
    """2 VWs, D = 0: the stage rank of VW 1 is SIGKILLed mid-run; `--max-restarts 1` restarts the job
    without its device (1 VW, 2 ranks) from the last checkpoint. Every minibatch of the epoch is trained
    once, and the final weights equal a replay of the 2-VW plan up to the cut followed by a replay of
    the 1-VW plan from those weights over the rest of the data (plain SGD: no optimizer state)."""
    import torch

    from ckpt_run import data_of, plan_of
    from common import cross_entropy, mlp, sgd
    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer

    rng = random.Random(12)
    wave = rng.randint(2, 5)
    cfg = {"vws": 2, "nm": 2, "d": 0, "epochs": 1, "minibatches": 32, "shuffle": False, "momentum": 0.0,
           "time": 0.02}
    metrics, ckpt, run, out = tmp_path / "metrics.jsonl", tmp_path / "ckpt", tmp_path / "run", tmp_path / "out"
    proc = _launch("-n", "3", "--max-restarts", "1", "--timeout", "20", "--run-dir", str(run), "--checkpoint-dir",
                   str(ckpt), "ckpt_run.py", str(out), json.dumps({**cfg, "metrics": str(metrics)}))
    _kill_at_wave(proc, metrics, ckpt, run, wave, 1)
    rc, err = _finish(proc)
    assert rc == 0, err
    assert "restart 1 of 1: rank 1 (vw 1 stage 0) failed: it died" in err, err
    assert "device n1.g0 of rank 1 (vw 1 stage 0) is left out; 1 VW(s) on 2 ranks" in err, err
    assert "is lost" in err, err
    res, weights = _result(out)
    clock = res["resumed"]["clock"]
    assert res["vws"] == 1 and not res["resumed"]["same_plan"] and clock >= 1
    before = sum(len(per) for per in res["resumed"]["losses"].values())
    assert before == 2 * 2 * clock                  # 2 VWs, nm = 2, up to the cut
    assert before + len(res["losses"]["0"]) == 32   # the epoch, every minibatch once

    full = data_of(cfg)
    cut = before * 16
    model = mlp()
    Trainer(model, cross_entropy, sgd(momentum=0.0), Batches(full.x[:cut], full.y[:cut], 16, shuffle=False),
            plan=plan_of(cfg), epochs=1).replay()
    ref = Trainer(model, cross_entropy, sgd(momentum=0.0), Batches(full.x[cut:], full.y[cut:], 16, shuffle=False),
                  plan=plan_of({**cfg, "vws": 1}), epochs=1).replay()
    assert all(np.array_equal(weights[l], ref.weights[l]) for l in ref.weights), "weights differ from the replays"
    assert [v for _, v in sorted((int(p), v) for p, v in res["losses"]["0"].items())] == \
        [v for _, v in sorted(ref.losses[0].items())]
    assert torch.is_tensor(full.x)


def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(tmp_path):
    """A second run given the first one's checkpoint directory without --resume stops at start-up with
    one line naming the directory and the other run, and deletes nothing of it."""
    from hetpipe.checkpoint.format import run_ids

    ckpt = tmp_path / "ckpt"
    cfg = {**CFG, "epochs": 1, "time": 0.0}
    rc, err = _finish(_launch("-n", "3", "--checkpoint-dir", str(ckpt), "ckpt_run.py", str(tmp_path / "first"),
                              json.dumps(cfg)))
    assert rc == 0, err
    before = run_ids(ckpt)
    rc, err = _finish(_launch("-n", "3", "--checkpoint-dir", str(ckpt), "ckpt_run.py", str(tmp_path / "second"),
                              json.dumps(cfg)))
    assert rc != 0
    lines = [ln for ln in err.splitlines() if "holds checkpoints of another run" in ln]
    assert len(lines) == 1 and str(ckpt) in lines[0], err
    assert run_ids(ckpt) == before and not (tmp_path / "second" / "result.json").exists()


def test_a_vw_that_loses_a_device_goes_on_over_the_others(tmp_path):
    """One VW of three emulated devices, planned by the Trainer; its middle stage's rank is SIGKILLed
    mid-run. `--max-restarts 1` re-plans the two surviving devices (one VW of two stages) from the
    profile the run saved and resumes from the last checkpoint. Every minibatch is trained once, and the
    final weights equal a replay of the first plan up to the cut followed by a replay of the new plan
    from those weights over the rest (plain SGD: no optimizer state to carry)."""
    from replan_run import data

    from common import cross_entropy, mlp, sgd
    from hetpipe.plan.types import Plan
    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer

    metrics, ckpt, run, out = tmp_path / "metrics.jsonl", tmp_path / "ckpt", tmp_path / "run", tmp_path / "out"
    proc = _launch("-n", "4", "--max-restarts", "1", "--timeout", "20", "--run-dir", str(run), "--checkpoint-dir",
                   str(ckpt), "replan_run.py", str(out), str(metrics))
    _kill_at_wave(proc, metrics, ckpt, run, 3, 1)
    rc, err = _finish(proc)
    assert rc == 0, err
    assert "device n0.g1 of rank 1 (vw 0 stage 1) is left out; 1 VW(s) on 3 ranks (re-planned the 2 remaining " \
           "device(s): 1 VW(s) of [2] stage(s), predicted" in err, err
    first, second = Plan.load(run / "attempt-0" / "plan.json"), Plan.load(run / "plan-1.json")
    assert [len(vw.stages) for vw in first.virtual_workers] == [3]
    assert [[st.device for st in vw.stages] for vw in second.virtual_workers] == [["n0.g0", "n0.g2"]]
    res, weights = _result(out)
    clock = res["resumed"]["clock"]
    assert not res["resumed"]["same_plan"] and clock >= 1
    before = sum(len(per) for per in res["resumed"]["losses"].values())
    assert before == 2 * clock and before + len(res["losses"]["0"]) == 32     # every minibatch once

    full, cut = data(), before * 16
    model = mlp()
    Trainer(model, cross_entropy, sgd(momentum=0.0), Batches(full.x[:cut], full.y[:cut], 16, shuffle=False),
            plan=first, epochs=1).replay()
    ref = Trainer(model, cross_entropy, sgd(momentum=0.0), Batches(full.x[cut:], full.y[cut:], 16, shuffle=False),
                  plan=second, epochs=1).replay()
    assert all(np.array_equal(weights[l], ref.weights[l]) for l in ref.weights), "weights differ from the replays"
