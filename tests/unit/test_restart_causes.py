"""Which failed runs `hetpipe launch --max-restarts` restarts (launch/restart.py): a rank that died or
stopped, a peer timeout, and a checkpoint write that found its disk full (the real error text of the
checkpoint writer, as a rank reports it); not a rank that raised anything else. And which checkpoint the
restart's log line says the ranks resume from when the latest one fails verification."""

import errno
import os

import pytest
import torch

from hetpipe.checkpoint import state as ckpt
from hetpipe.checkpoint.format import FORMAT, CheckpointError
from hetpipe.launch.restart import _verified, out_of_space, restartable
from hetpipe.launch.supervisor import Outcome


def _write_failure(tmp_path, monkeypatch, code: int, where: str) -> str:
    """The message of a checkpoint write failing with ``code`` in ``where`` (the rename of the manifest
    or of the tensors file), as the rank reports it."""
    real = os.replace

    def fail(src, dst):
        if str(dst).endswith(where):
            raise OSError(code, os.strerror(code))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail)
    w = ckpt.Checkpointer(tmp_path, 1, 0, lambda c: {"clock": c, "parts": ["rank-00000"]}, keep=0)
    w.boundary(1, lambda: ({"w/0": torch.ones(10)}, {"role": "ps", "applied": 1}))
    with pytest.raises(CheckpointError) as e:
        w.close()
    return f"hetpipe: rank 1 (vw 0 stage 1) failed: CheckpointError: {e.value}"


def _reported(message: str) -> Outcome:
    return Outcome("failed", 1, "reported", 1, "rank 1 (vw 0 stage 1)", 42, message, [message])


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
@pytest.mark.parametrize("where", ["manifest.json", ".safetensors"])
def test_a_checkpoint_write_that_finds_no_space_is_restarted(tmp_path, monkeypatch, code, where):
    outcome = _reported(_write_failure(tmp_path, monkeypatch, code, where))
    assert out_of_space(outcome) and restartable(outcome)


@pytest.mark.parametrize("message", [
    "hetpipe: rank 1 (vw 0 stage 1) failed: RuntimeError: deliberate failure in the forward pass",
    "hetpipe: rank 1 (vw 0 stage 1) failed: OSError: [Errno 28] No space left on device",   # not a checkpoint write
])
def test_other_reported_errors_are_not_restarted(message):
    assert not restartable(_reported(message))


def test_a_checkpoint_write_refused_for_another_reason_is_not_restarted(tmp_path, monkeypatch):
    assert not restartable(_reported(_write_failure(tmp_path, monkeypatch, errno.EACCES, ".safetensors")))


def test_faults_of_a_rank_are_restarted():
    assert restartable(Outcome("failed", 1, "died", 2, "rank 2 (ps shard 0)", 42))
    assert restartable(Outcome("failed", 1, "stopped", 2, "rank 2 (ps shard 0)", 42))
    assert not restartable(Outcome("failed", 1, "exit"))


def test_the_restart_names_the_newest_checkpoint_that_passes_verification(tmp_path):
    """A flipped byte in the latest complete checkpoint: the launcher's line names the one before it, the
    one a resume with resume_fallback loads (checked against Checkpoint.find itself), and why."""
    manifest = lambda c: {"format": FORMAT, "clock": c, "parts": ["rank-00000"], "run_id": "a"}  # noqa: E731
    w = ckpt.Checkpointer(tmp_path, 1, 0, manifest, keep=0, run_id="a", keep_last=2)
    for c in (1, 2):
        w.boundary(c, lambda c=c: ({"w/0": torch.full((100,), float(c))}, {"role": "ps", "applied": c}))
    w.close()
    assert _verified(tmp_path) == (tmp_path / "clock-000002", [])
    part = tmp_path / "clock-000002" / "rank-00000.safetensors"
    data = bytearray(part.read_bytes())
    data[-10] ^= 0xFF
    part.write_bytes(bytes(data))
    sound, failing = _verified(tmp_path)
    assert sound == ckpt.Checkpoint.find(tmp_path, fallback=True).path == tmp_path / "clock-000001"
    assert len(failing) == 1 and f"the checkpoint part {part} is corrupt" in failing[0]
