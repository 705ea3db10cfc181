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
