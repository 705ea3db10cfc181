"""A run planned on its discovered devices that trains until it is ended from outside. Usage:
discovered_endless.py METRICS (HETPIPE_HOST / HETPIPE_EMULATE give each rank its host and device)."""

import sys

from common import cross_entropy, mlp, sgd, synthetic
from hetpipe.run.trainer import Trainer


def main() -> int:
    Trainer(mlp(), cross_entropy, sgd(), synthetic(), cluster="auto", nm=2, d=0, epochs=4000, progress=False,
            metrics=sys.argv[1]).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
