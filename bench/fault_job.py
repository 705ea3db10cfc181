"""The job bench/fault_campaign.py injects faults into, under `hetpipe launch -n 3`.

Usage: fault_job.py CKPT_DIR [PRE_S] [POST_S]

Each phase of a run lasts long enough to be hit: before MPI start-up every rank computes for PRE_S
seconds (a dataset load); rank 0 then profiles and plans the model (no plan given); training runs 1
VW of 2 stages and 1 PS shard at D = 1 for about ten seconds, with a checkpoint of every wave (the
model is sized so that a write takes a while); after ``fit`` every rank waits POST_S seconds (a
script saving its model) and prints ``FINISHED``.
"""

import sys
import time

PRE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
POST_S = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0

until = time.monotonic() + PRE_S
while time.monotonic() < until:           # before anything imports MPI: a load that computes
    pass

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hetpipe  # noqa: E402

# Two emulated devices of one node: one VW of two stages and one PS shard, three ranks.
CLUSTER = {"name": "fault-campaign", "emulated": True,
           "device_types": {"emu": {"memory_bytes": 1 << 30, "speed": 0.5}},
           "nodes": [{"name": "n0", "type": "emu", "count": 2}],
           "intra_node": {"bandwidth": 2.0e9, "latency": 2e-5}, "inter_node": {"bandwidth": 2.5e8, "latency": 1e-4}}

torch.manual_seed(0)
x = torch.randn(4096, 256)
y = (x[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                      nn.ReLU(), nn.Linear(1024, 2))
trainer = hetpipe.Trainer(model, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                          hetpipe.Batches(x, y, batch_size=32), epochs=2,
                          planning=hetpipe.Planning(nm=2, d=1, policy="np", cluster=CLUSTER),
                          checkpointing=hetpipe.Checkpointing(dir=sys.argv[1], every=1, keep=2),
                          reporting=hetpipe.Reporting(progress=False))
trainer.fit()
time.sleep(POST_S)
print("FINISHED", flush=True)
