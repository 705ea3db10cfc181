"""A run that trains until it is ended from outside (the fault suite's victim). Usage:
hetpipe launch -n 3 endless.py METRICS: one VW of two CPU stages (ranks 0, 1) and a PS shard (rank 2);
VW 0's last stage appends a line per wave to METRICS, so that a test knows training has started."""

import sys

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting


def main() -> int:
    plan = one_vw_plan([3], nm=2, d=0)
    Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=4000,
            reporting=Reporting(progress=False, metrics=sys.argv[1])).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
