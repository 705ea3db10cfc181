"""TrainResult.cpu_s against known work: stage 0's first layer burns ``BURN_S`` of CPU per forward.

1 VW x 2 stages + 1 PS (3 ranks), the mpi4py stage plane; rank 0 prints ``RESULT {json}`` with the
result's ``cpu_s``, how many forwards stage 0 ran, and the CPU its process had used before the
Trainer was built (``before_s``: start-up, imports) and when it prints (``process_cpu_s``).
"""

import json
import sys
import time

import torch
from torch import nn

from common import mlp, one_vw_plan, sgd, synthetic
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting

BURN_S = 0.02


class Burn(nn.Module):
    """The identity, after spinning until this process has used ``BURN_S`` more CPU seconds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.process_time() + BURN_S
        while time.process_time() < end:
            pass
        return x


def main() -> int:
    layers = list(mlp())
    layers[1] = nn.Sequential(Burn(), layers[1])
    data = synthetic(n=128, batch=16)
    before = time.process_time()
    r = Trainer(layers, nn.functional.cross_entropy, sgd(), data, plan=one_vw_plan([3], nm=2, d=0), epochs=1,
                reporting=Reporting(progress=False)).fit()
    if r.rank == 0:
        print("RESULT " + json.dumps({"cpu_s": r.cpu_s, "before_s": before, "process_cpu_s": time.process_time(),
                                      "forwards": len(data), "burn_s": BURN_S}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
