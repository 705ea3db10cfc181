"""A run planned on its discovered devices that trains until it is ended from outside. Usage:
discovered_endless.py METRICS (HETPIPE_HOST / HETPIPE_EMULATE give each rank its host and device)."""

import sys

from common import cross_entropy, mlp, sgd, synthetic
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Planning, Reporting


def main() -> int:
    Trainer(mlp(), cross_entropy, sgd(), synthetic(), epochs=4000, planning=Planning(cluster="auto", nm=2, d=0),
            reporting=Reporting(progress=False, metrics=sys.argv[1])).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
