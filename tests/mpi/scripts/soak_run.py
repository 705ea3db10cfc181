"""The fault soak's training job, started with `hetpipe launch`. Usage: soak_run.py OUT CONFIG_JSON

The Trainer plans the run itself on an emulated node of three devices (one VW of three stages and a PS
shard: 4 ranks), D = 0, SGD with momentum and a StepLR (state a resume must restore),
``epochs`` epochs of ``minibatches`` shuffled minibatches; checkpoints come from the launcher
(--checkpoint-dir, --checkpoint-every), two complete ones are kept and a resume falls back past one that
fails verification. A restart that leaves a failed stage's device out re-plans the remaining ones.
``plan_cache`` (CONFIG_JSON): where the plan is kept for the next run of the job (the soak's reference
and the soaked run then train one plan).

Records for the soak's lineage check: the last stage appends one line per loss it computes in training to
``$HETPIPE_RUN_DIR/trained-<pid>.jsonl`` (the minibatch's label digest, which identifies it, and the
loss), so every attempt leaves the list of minibatches it trained, in order.
Rank 0 writes OUT/result.json and OUT/weights.npz (common.save_run)."""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from common import cross_entropy, mlp, save_run, sgd
from hetpipe.job.rundir import current_phase
from hetpipe.plan.cluster import cluster_from_dict
from hetpipe.run.data import Batches
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Checkpointing, Numerics, Planning, Reporting, Runtime

# Three devices of one emulated type.
CLUSTER = {"name": "soak", "emulated": True, "device_types": {"emu": {"memory_bytes": 1 << 26, "speed": 0.002}},
           "nodes": [{"name": "n0", "type": "emu", "count": 3}],
           "intra_node": {"bandwidth": 2e9, "latency": 2e-5}, "inter_node": {"bandwidth": 2.5e8, "latency": 1e-4}}


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
        if current_phase() != "training":       # the planner's profiling computes losses too
            return loss
        if self.file is None:
            self.file = open(Path(os.environ["HETPIPE_RUN_DIR"], f"trained-{os.getpid()}.jsonl"), "a")
        self.file.write(json.dumps({"digest": label_digest(y), "loss": float(loss.detach())}) + "\n")
        self.file.flush()
        return loss


def main() -> int:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    run = Trainer(mlp(), LoggedLoss(), sgd(momentum=0.9), data_of(cfg), epochs=cfg["epochs"],
                  planning=Planning(cluster=cluster_from_dict(CLUSTER), policy="NP", nm=cfg["nm"], d=0,
                                    plan_cache=cfg.get("plan_cache")),
                  numerics=Numerics(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 8, gamma=0.7)),
                  checkpointing=Checkpointing(keep=2, fallback=True), reporting=Reporting(progress=False),
                  runtime=Runtime(emulate=True)).fit()
    if run.rank == 0:
        save_run(out, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
