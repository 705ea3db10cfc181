"""Checkpoints owned by their run and verified: a corrupted, truncated or edited checkpoint is one
error naming the file, resume can fall back to the previous complete checkpoint, another run's
checkpoints are never deleted and a fresh run refuses their directory."""

import json

import pytest
import torch

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
from hetpipe.job.roles import LaunchError
from hetpipe.run.checkpoints import RunCheckpoints


def _manifest(run_id):
    return lambda c: {"format": ckfmt.FORMAT, "run_id": run_id, "clock": c, "parts": ["rank-00000"], "plan": {},
                      "data": {"position": {"epoch": 0, "index": 2 * c}}}


def _write(directory, clocks, run_id="a", keep_last=2):
    w = ckpt.Checkpointer(directory, 1, 0, _manifest(run_id), keep=0, run_id=run_id, keep_last=keep_last)
    for c in clocks:
        w.boundary(c, lambda c=c: ({"w/0": torch.full((1000,), float(c))}, {"role": "ps", "applied": c}))
    w.close()
    return directory


def test_a_verified_checkpoint_reads_back(tmp_path):
    found = ckpt.Checkpoint.find(_write(tmp_path, [1, 2, 3]))
    assert found.clock == 3 and bool((found.tensors[0]["w/0"] == 3.0).all())
    assert [p.name for p in ckfmt.complete_clocks(tmp_path)] == ["clock-000003", "clock-000002"]   # keep_last = 2


@pytest.mark.parametrize("damage, culprit", [
    ("flip", r"rank-00000\.safetensors is corrupt: its digest \w+ is not the \w+ recorded in rank-00000\.json"),
    ("truncate", r"rank-00000\.safetensors is corrupt"),
    ("clock", r"rank-00000\.json is of clock 3, the manifest's clock is 7"),
    ("position", r"manifest\.json does not match the manifest rank-00000 was written with"),
    ("applied", r"rank-00000\.json applied waves up to 9, the manifest's clock is 3"),
])
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path, damage, culprit):
    _write(tmp_path, [2, 3])
    path = tmp_path / "clock-000003"
    tensors, part, manifest = path / "rank-00000.safetensors", path / "rank-00000.json", path / "manifest.json"
    if damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-100] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:500])
    elif damage in ("clock", "position"):
        m = json.loads(manifest.read_text())
        if damage == "clock":
            m["clock"] = 7
        else:
            m["data"]["position"]["index"] = 0
        manifest.write_text(json.dumps(m))
    else:
        p = json.loads(part.read_text())
        p["applied"] = 9
        part.write_text(json.dumps(p))
    with pytest.raises(ckfmt.CheckpointError, match=culprit):
        ckpt.Checkpoint.find(tmp_path)
    # The launcher's torch-free check (it reads no tensors) gives the same verdict.
    with pytest.raises(ckfmt.CheckpointError, match=culprit):
        ckfmt.verify(path)
    ckfmt.verify(tmp_path / "clock-000002")
    # Asked to, resume goes back to the previous complete checkpoint, saying why.
    assert ckpt.Checkpoint.find(tmp_path, fallback=True).clock == 2


def test_fallback_with_nothing_sound_left_names_every_failure(tmp_path):
    _write(tmp_path, [1], keep_last=1)
    (tmp_path / "clock-000001" / "rank-00000.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ckfmt.CheckpointError, match=r"no complete checkpoint in .* passes verification: .*corrupt"):
        ckpt.Checkpoint.find(tmp_path, fallback=True)


def test_another_runs_checkpoints_are_never_deleted(tmp_path):
    _write(tmp_path, [5, 6], run_id="old", keep_last=1)
    _write(tmp_path, [1, 2, 3], run_id="new", keep_last=1)
    assert ckfmt.run_ids(tmp_path) == {"old": [6], "new": [3]}


def _settings(directory, resume=None):
    return RunCheckpoints([], None, 1, 0, 0, {}, directory, 1, resume, False)


def test_a_fresh_run_refuses_a_directory_holding_another_run(tmp_path):
    _write(tmp_path, [4], run_id="earlier")
    run = _settings(tmp_path)
    run.run_id = "fresh"
    with pytest.raises(LaunchError, match=r"holds checkpoints of another run \(run earlier: clock\(s\) 4\.\.4\): "
                                          r"resume it"):
        run.claim()


def test_a_failed_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A disk that fills up mid-write (simulated: the rename fails with ENOSPC): the error names the
    file and its size, and no temporary file is left behind."""
    import errno
    import os

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    w = ckpt.Checkpointer(tmp_path, 1, 0, _manifest("a"), keep=0, run_id="a")
    w.boundary(1, lambda: ({"w/0": torch.ones(1000)}, {"role": "ps", "applied": 1}))
    with pytest.raises(ckfmt.CheckpointError, match=r"^hetpipe: writing .*clock-000001/manifest\.json failed: OSError: "
                                                    r"\[Errno 28\] No space left on device"):
        w.close()
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def _attempt(directory, clocks_by_rank, resumed_from):
    """One attempt of run "a" on two ranks: each rank writes its part of the clocks given for it; the
    manifest records where the attempt resumed from, as a run's does, so two attempts' manifests differ."""
    def manifest(c):
        return {"format": ckfmt.FORMAT, "run_id": "a", "clock": c, "parts": ["rank-00000", "rank-00001"], "plan": {},
                "data": {"position": {"epoch": 0, "index": 2 * c}}, "resumed_from": resumed_from}

    for rank, clocks in clocks_by_rank.items():
        w = ckpt.Checkpointer(directory, 1, rank, manifest, keep=0, run_id="a", keep_last=2)
        for c in clocks:
            w.boundary(c, lambda c=c: ({"w/0": torch.full((100,), float(c))}, {"role": "ps", "applied": c}))
        w.close()


@pytest.mark.parametrize("discard", [True, False])
def test_a_clock_written_again_by_the_next_attempt_is_that_attempts_alone(tmp_path, discard):
    """An attempt fails while its ranks write clock 2 (rank 0's part on disk, rank 1's not); the next
    attempt resumes from clock 1 and writes clock 2 again. Discarding the run's clocks past the cut it
    resumes from (rank 0 at start-up) leaves clock 2 the new attempt's alone, and it verifies. Without
    that, the old manifest stayed and matched neither new part: the checkpoint failed verification."""
    _attempt(tmp_path, {0: [1, 2], 1: [1]}, resumed_from=None)
    assert [p.name for p in ckfmt.complete_clocks(tmp_path)] == ["clock-000001"]
    if discard:
        run = _settings(tmp_path)
        run.run_id = "a"
        run.discard_newer(1)
        assert not (tmp_path / "clock-000002").exists() and (tmp_path / "clock-000001").exists()
    _attempt(tmp_path, {0: [2], 1: [2]}, resumed_from={"clock": 1})
    if discard:
        found = ckpt.Checkpoint.find(tmp_path)
        assert found.clock == 2 and found.manifest["resumed_from"] == {"clock": 1}
    else:
        with pytest.raises(ckfmt.CheckpointError, match=r"manifest\.json does not match the manifest rank-00000"):
            ckpt.Checkpoint.find(tmp_path)


def test_discarding_keeps_the_cut_and_other_runs(tmp_path):
    _write(tmp_path / "d", [5, 6], run_id="other", keep_last=2)
    _write(tmp_path / "d", [1, 2, 3], run_id="a", keep_last=3)
    run = _settings(tmp_path / "d")
    run.run_id = "a"
    run.discard_newer(1)
    assert ckfmt.run_ids(tmp_path / "d") == {"other": [5, 6], "a": [1]}


def test_old_checkpoints_vanishing_under_a_rank_that_collects_them_are_no_error(tmp_path, monkeypatch):
    """Every rank removes its parts of old checkpoints, and the directory once empty, at the same time:
    here clock 1's directory is removed by "another rank" just as this one lists it (after pathlib saw it
    exist). The writer went on; before, the FileNotFoundError failed it, and the run with it."""
    import os
    import shutil

    _write(tmp_path, [1, 2], keep_last=2)
    victim = str(tmp_path / "clock-000001")
    real = os.scandir
    pending = {victim}

    def scandir(path="."):
        if str(path) in pending:
            pending.discard(str(path))
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    w = ckpt.Checkpointer(tmp_path, 1, 1, _manifest("a"), keep=0, run_id="a", keep_last=1)
    w.boundary(3, lambda: ({"w/0": torch.full((1000,), 3.0)}, {"role": "ps", "applied": 3}))
    w.close()
    assert not pending, "the race was not exercised: nothing listed clock 1's directory"
    assert [p.name for p in ckfmt.complete_clocks(tmp_path)] == ["clock-000002"]     # 3 lacks rank 0's part
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clock-000002", "clock-000003"]


# --- every byte a resume reads, against a corpus of edits -------------------------------------------------

def _run_checkpoint(directory, clock=3):
    """The checkpoint at ``clock`` of a run of one VW of two stages and a PS shard, as its three ranks write
    it: the run's own manifest (``RunCheckpoints.manifest``: plan, data position, the run's history), each
    stage's part with a real SGD-with-momentum state and StepLR, the last stage's losses and EarlyStopping's
    state, and the shard's weights. Returns the run's checkpoint settings (to resume with), its plan and
    its Trainer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
    from hetpipe.run.callbacks import EarlyStopping
    from hetpipe.run.trainer import Trainer

    plan = one_vw_plan([3], nm=2, d=0)
    trainer = Trainer(mlp(), cross_entropy, sgd(momentum=0.9), synthetic(n=16 * 40), plan=plan, epochs=2)
    run, spec = trainer.checkpoints, trainer.spec(plan)
    run.run_id = "r"
    stopper = EarlyStopping(patience=3)
    stopper.best, stopper.bad = 0.75, 1
    layers = list(trainer.layers)

    def stage(k, start, stop):
        params = [p for l in layers[start:stop] for p in l.parameters()]
        keys = [f"{l}.{n}" for l in range(start, stop) for n, _ in layers[l].named_parameters()]
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        for _ in range(clock * plan.nm):
            sum((p ** 2).sum() for p in params).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        tensors, state = ckpt.optimizer_snapshot(opt, params, keys)
        part = {"role": "stage", "vw": 0, "stage": k, "optimizer": state,
                "lr_scheduler": ckpt.scheduler_snapshot(sched)}
        if k == 1:
            part["losses"] = {str(p): 2.0 - 0.1 * p for p in range(clock * plan.nm)}
            part["callbacks"] = [stopper.state_dict()]
        return tensors, part

    weights = {f"w/{l}": torch.cat([p.detach().reshape(-1) for p in layers[l].parameters()])
               for l in range(6) if list(layers[l].parameters())}
    snapshots = [stage(0, 0, 3), stage(1, 3, 6),
                 (weights, {"role": "ps", "shard": 0, "clocks": [clock], "applied": clock})]
    for rank, snapshot in enumerate(snapshots):
        w = ckpt.Checkpointer(directory, clock, rank, lambda c: run.manifest(plan, spec, c), keep=0, run_id="r")
        w.boundary(clock, lambda s=snapshot: s)
        w.close()
    run.resume_from = directory
    return run, plan, trainer


def _edit_json(file, change):
    value = json.loads(file.read_text())
    change(value)
    file.write_text(json.dumps(value, indent=1))


def _redigest(path):
    """Make every digest of the checkpoint in ``path`` agree with its files again, as someone covering an edit
    would: each part's record of the manifest's content, then the manifest's digests of the part files."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name in manifest["parts"]:
        _edit_json(path / f"{name}.json", lambda p: p.update(manifest_digest=ckfmt.manifest_digest(manifest)))
    manifest["files"].update({f"{n}.json": ckfmt.file_digest(path / f"{n}.json") for n in manifest["parts"]})
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _flip(file):
    data = bytearray(file.read_bytes())
    data[-7] ^= 0x01
    file.write_bytes(bytes(data))


def _skip(m, by):
    m["data"]["position"]["index"] += by
    m["data"]["minibatches_per_vw"] += by // m["plan"]["nm"]


EDITS = {
    # what is edited: (the file the refusal must name, the edit)
    "lr": ("rank-00000.json", lambda p: _edit_json(p / "rank-00000.json",
                                                   lambda v: v["optimizer"]["groups"][0].update(lr=0.5))),
    "momentum": ("rank-00000.json", lambda p: _edit_json(p / "rank-00000.json",
                                                         lambda v: v["optimizer"]["groups"][0].update(momentum=0.95))),
    "losses": ("rank-00001.json", lambda p: _edit_json(p / "rank-00001.json",
                                                       lambda v: v["losses"].update({"0": 0.1}))),
    "scheduler": ("rank-00001.json", lambda p: _edit_json(p / "rank-00001.json",
                                                          lambda v: v["lr_scheduler"].update(last_epoch=1))),
    "callbacks": ("rank-00001.json", lambda p: _edit_json(p / "rank-00001.json",
                                                          lambda v: v["callbacks"][0].update(bad=0))),
    "tensor byte": ("rank-00002.safetensors", lambda p: _flip(p / "rank-00002.safetensors")),
    "momentum buffer": ("rank-00000.safetensors", lambda p: _flip(p / "rank-00000.safetensors")),
    "data cursor": ("manifest.json", lambda p: _edit_json(p / "manifest.json", lambda m: _skip(m, 10))),
    "manifest": ("manifest.json", lambda p: _edit_json(p / "manifest.json", lambda m: m["rng"].update(seed=7))),
    "digest of a part": ("manifest.json", lambda p: _edit_json(
        p / "manifest.json", lambda m: m["files"].update({"rank-00000.safetensors": "0" * 32}))),
    "data cursor, re-digested": ("manifest.json", lambda p: (
        _edit_json(p / "manifest.json", lambda m: _skip(m, 10)), _redigest(p))),
    "minibatch count, re-digested": ("manifest.json", lambda p: (
        _edit_json(p / "manifest.json", lambda m: m["data"].update(minibatches_per_vw=9)), _redigest(p))),
    "history, re-digested": ("manifest.json", lambda p: (
        _edit_json(p / "manifest.json", lambda m: m["data"]["segments"][0].update(clock=1)), _redigest(p))),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_edit_of_a_checkpoint_is_refused_naming_the_file(tmp_path, edit):
    """Each edit of a run's checkpoint (a part's JSON: learning rate, momentum, losses, scheduler and
    callbacks' state; a tensor byte; the manifest) is refused by the resume and by the launcher's check
    alike, naming the file; edits of the data cursor whose digests were all made to agree again are
    refused too, against the waves and plans the manifest records. Before, the parts' JSON were covered
    by no digest (an edited momentum resumed without a word), and a manifest whose digest was recomputed
    skipped 10 minibatches."""
    run, plan, _ = _run_checkpoint(tmp_path / "ckpt")
    path = ckfmt.latest(tmp_path / "ckpt")
    assert path is not None and ckfmt.verify(path)[0]["data"]["position"] == {"epoch": 0, "index": 6}
    assert run.resume(plan).checkpoint.clock == 3                   # sound before the edit
    culprit, damage = EDITS[edit]
    damage(path)
    with pytest.raises(ckfmt.CheckpointError) as e:
        run.resume(plan)
    assert str(path / culprit) in str(e.value) or f"{path}: {culprit}" in str(e.value), str(e.value)
    with pytest.raises(ckfmt.CheckpointError) as again:
        ckfmt.verify(path)
    assert str(again.value) == str(e.value)


def test_the_manifest_holds_a_digest_of_every_part_file(tmp_path):
    _run_checkpoint(tmp_path)
    path = ckfmt.latest(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = sorted(f.name for f in path.iterdir() if f.name != "manifest.json")
    assert manifest["format"] == 2 and sorted(manifest["files"]) == on_disk
    assert all(ckfmt.file_digest(path / f) == d for f, d in manifest["files"].items())


def test_the_data_cursor_check_follows_the_runs_resumes(tmp_path):
    """The manifests of runs resumed from a checkpoint, into its own plan and into another (two VWs, nm 3),
    record the stretch before the resume and their own, and pass the check of their data cursor; the
    history replayed gives each one's position (40 minibatches an epoch: 6 + 4 x 2 = 14 into the same
    plan; 6 + 2 x 2 x 3 = 18 into two VWs of nm 3, which start counting their minibatches afresh)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    from common import two_vw_plan

    run, plan, trainer = _run_checkpoint(tmp_path)
    for new, clock, want in ((plan, 7, ({"epoch": 0, "index": 14}, 14)),
                             (two_vw_plan(([3], [3]), (1.0, 1.0), nm=3, d=0), 5, ({"epoch": 0, "index": 18}, 6))):
        resume = run.resume(new)
        manifest = run.manifest(new, trainer.spec(new, resume), clock)
        segments = manifest["data"]["segments"]
        assert [(s["clock"], s["vws"], s["nm"], s["same_plan"]) for s in segments] == \
            [(0, 1, 2, False), (3, len(new.virtual_workers), new.nm, new is plan)]
        assert (manifest["data"]["position"], manifest["data"]["minibatches_per_vw"]) == want
        ckfmt.check_data(tmp_path, manifest)
        pos, q = ckfmt.data_cursor(segments, clock)
        assert ({"epoch": pos.epoch, "index": pos.index}, q) == want
