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


def test_a_rank_ended_by_sigterm_from_outside_is_restarted():
    """A rank stopped by a SIGTERM from outside the run (a preemption) wrote its checkpoint and ended:
    the device is sound, the run restarts with the same devices (before, its exit read as a death and its
    device was left out, or a race in its checkpoint made it an error, which is not restarted)."""
    assert restartable(Outcome("failed", 143, "terminated", 1, "rank 1 (vw 0 stage 1)", 42))


# A checkpoint write on a real full disk: a 64 KiB tmpfs mounted in a user and mount namespace of its own
# (no root needed where unprivileged namespaces are allowed), or a real file-size limit (RLIMIT_FSIZE).
FULL_DISK_WRITER = """
import os, sys, torch
from hetpipe.checkpoint import state as ckpt
from hetpipe.checkpoint.format import CheckpointError
w = ckpt.Checkpointer(sys.argv[1], 1, 0, lambda c: {"clock": c, "parts": ["rank-00000"]}, keep=0)
w.boundary(1, lambda: ({"w/0": torch.ones(1 << 16)}, {"role": "ps", "applied": 1}))
try:
    w.close()
except CheckpointError as e:
    print(e)
print(sorted(os.listdir(os.path.join(sys.argv[1], "clock-000001"))))
"""


NO_MOUNT = 97         # the wrapper's exit status when the namespace could not mount the tmpfs


def _write_on(tmp_path, wrap, preexec=None):
    import subprocess
    import sys

    target = tmp_path / "disk"
    target.mkdir()
    run = subprocess.run([*wrap(target), sys.executable, "-c", FULL_DISK_WRITER, str(target)], capture_output=True,
                         text=True, timeout=300, preexec_fn=preexec, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [p for p in sys.path if p])})
    return run


def test_a_checkpoint_write_on_a_real_full_disk_is_restarted(tmp_path):
    """safetensors reports ENOSPC as its own SafetensorError, which carries no errno (before, the restart
    rule looked for an OSError's text and did not restart the run): the writer names the errno behind
    it, from the filesystem itself, and the launcher restarts the run."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small tmpfs with")

    def mounted(target):
        return ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs "{target}" || exit {NO_MOUNT}; '
                                              'exec "$0" "$@"']

    run = _write_on(tmp_path, mounted)
    if run.returncode == NO_MOUNT or run.stderr.startswith("unshare:"):
        pytest.skip(f"no tmpfs can be mounted here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr
    message, listing = run.stdout.splitlines()[-2:]
    assert "rank-00000.safetensors (262144 bytes of tensors) failed: SafetensorError" in message, run.stdout
    assert message.endswith("[errno ENOSPC]"), message
    outcome = _reported(f"hetpipe: rank 1 (vw 0 stage 1) failed: CheckpointError: {message}")
    assert out_of_space(outcome) and restartable(outcome)
    assert listing == "['manifest.json']"           # no temporary file nor marker left behind


def test_a_checkpoint_write_past_a_file_size_limit_is_named_and_not_restarted(tmp_path):
    """A real RLIMIT_FSIZE: safetensors fails with its own error again; the errno named is EFBIG, a limit
    the restarted run would hit again, so it is not restarted."""
    import resource
    import signal

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    run = _write_on(tmp_path, lambda target: [], limited)
    assert run.returncode == 0, run.stderr
    message = run.stdout.splitlines()[-2]
    assert "failed: SafetensorError" in message and message.endswith("[errno EFBIG]"), message
    assert not restartable(_reported(f"hetpipe: rank 1 (vw 0 stage 1) failed: CheckpointError: {message}"))
