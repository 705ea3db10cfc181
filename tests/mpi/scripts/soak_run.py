"""The fault soak's training job, started with `hetpipe launch`. Usage: soak_run.py OUT CONFIG_JSON

One VW of two emulated stages and two PS shards (4 ranks), D = 0, SGD with momentum and a StepLR (state
a resume must restore), ``epochs`` epochs of ``minibatches`` shuffled minibatches; checkpoints come from
the launcher (--checkpoint-dir, --checkpoint-every), two complete ones are kept and a resume falls back
past one that fails verification.

Records for the soak's lineage check: the last stage appends one line per loss it computes to
``$HETPIPE_RUN_DIR/trained-<pid>.jsonl`` (the minibatch's label digest, which identifies it, and the
loss), so every attempt leaves the list of minibatches it trained, in order.

Disk-full injection (``SOAK_FAULT_DIR``): while ``SOAK_FAULT_DIR/diskfull-armed`` names this rank, its
next checkpoint tensors write fills the disk: the temporary file gets half its bytes, then the write
raises OSError(ENOSPC), as a full filesystem does. The first rank to fire renames the file to
``diskfull-fired``, so the fault happens once, not again in the next attempt.
Rank 0 writes OUT/result.json and OUT/weights.npz (common.save_run)."""

import errno
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from common import cross_entropy, mlp, save_run, sgd
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.run.data import Batches
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Checkpointing, Numerics, Reporting, Runtime

FAULT_DIR_ENV = "SOAK_FAULT_DIR"


def plan_of(cfg) -> Plan:
    t = cfg.get("time", 0.0)
    stages = (StagePlan("n0.g0", "emulated", 0, 3, t, 2 * t), StagePlan("n0.g1", "emulated", 3, 6, t, 2 * t))
    shards = (ShardPlan(0, "n0", (0, 2, 4)), ShardPlan(1, "n0", (1, 3, 5)))
    return Plan(6, cfg["nm"], 0, "manual", (VirtualWorkerPlan(0, stages),), shards)


def data_of(cfg) -> Batches:
    g = torch.Generator().manual_seed(3)
    n = 16 * cfg["minibatches"]
    return Batches(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), 16, seed=3)


def label_digest(y: torch.Tensor) -> str:
    return hashlib.blake2b(y.numpy().tobytes(), digest_size=8).hexdigest()


class LoggedLoss:
    """Cross entropy that records each minibatch it is computed for (see the module doc)."""

    def __init__(self) -> None:
        self.file = None

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(out, y)
        if self.file is None:
            self.file = open(Path(os.environ["HETPIPE_RUN_DIR"], f"trained-{os.getpid()}.jsonl"), "a")
        self.file.write(json.dumps({"digest": label_digest(y), "loss": float(loss.detach())}) + "\n")
        self.file.flush()
        return loss


def arm_disk_full(fault_dir: Path) -> None:
    """Make this rank's checkpoint tensor writes fail like a full disk while the fault is armed for it."""
    import safetensors.torch

    real = safetensors.torch.save_file
    rank = os.environ.get("PMI_RANK", "")
    armed, fired = fault_dir / "diskfull-armed", fault_dir / "diskfull-fired"

    def save_file(tensors, filename, metadata=None):
        try:
            target = armed.read_text().strip()
        except OSError:
            target = None
        if target == rank:
            try:
                os.rename(armed, fired)         # one rank, once
            except OSError:
                return real(tensors, filename, metadata)
            real(tensors, filename, metadata)
            size = os.path.getsize(filename)
            with open(filename, "rb+") as f:
                f.truncate(size // 2)
            tmp = fault_dir / ".diskfull-fired.tmp"
            tmp.write_text(json.dumps({"rank": int(rank), "file": str(filename)}) + "\n")
            os.replace(tmp, fired)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        return real(tensors, filename, metadata)

    safetensors.torch.save_file = save_file


def main() -> int:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    if os.environ.get(FAULT_DIR_ENV):
        arm_disk_full(Path(os.environ[FAULT_DIR_ENV]))
    run = Trainer(mlp(), LoggedLoss(), sgd(momentum=0.9), data_of(cfg), plan=plan_of(cfg), epochs=cfg["epochs"],
                  numerics=Numerics(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 8, gamma=0.7)),
                  checkpointing=Checkpointing(keep=2, fallback=True), reporting=Reporting(progress=False),
                  runtime=Runtime(emulate=True)).fit()
    if run.rank == 0:
        save_run(out, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
