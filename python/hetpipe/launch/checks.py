"""``hetpipe launch``'s arguments and environment, checked before anything is made or started.

A bad one is one :class:`~hetpipe.util.errors.ArgumentError` naming the option (or the variable), the
value and what is allowed; the command line prints it as ``hetpipe launch: <message>`` and exits 2,
leaving no run directory, run file or process behind. What argparse checks (the numbers, through
:mod:`hetpipe.util.numbers`), the host lists (:mod:`hetpipe.launch.hosts`) and ``--plan`` are checked
where they are read; this module checks the rest. Torch-free.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Optional

from hetpipe.job.environment import checked, check_per_rank, check_planes, refusal
from hetpipe.util.arguments import directory_path
from hetpipe.launch.supervisor import START_TIMEOUT_ENV
from hetpipe.util.errors import ArgumentError


def _on_this_host(placement: Any) -> bool:
    """Whether every rank runs on this machine (no host list, emulated hosts, or only this host listed)."""
    return placement is None or placement.emulate or all(h == socket.gethostname() for h, _ in placement.slots.hosts)


def _writable_below(flag: str, path: Path) -> None:
    """A directory the launcher makes at ``path`` (or writes in) can be: its nearest existing ancestor
    is a directory this user may write in."""
    above = Path(os.path.abspath(path))
    while not above.exists() and above != above.parent:
        above = above.parent
    if not os.access(above, os.W_OK | os.X_OK):
        raise ArgumentError(f"hetpipe: {flag} {str(path)!r}: the directory {str(above)!r} is not writable")


def check_arguments(args: Any, ranks: int, placement: Optional[Any]) -> None:
    """``args`` (the parsed ``hetpipe launch`` options) for a launch of ``ranks`` ranks placed by
    ``placement`` (None: all on this host): the script, the directories, the cluster and the
    environment. Raises :class:`ArgumentError` on the first bad one."""
    script = Path(args.script)
    if _on_this_host(placement) and not script.exists():
        raise ArgumentError(f"hetpipe: the script {args.script!r} does not exist (the Python file every rank runs)")
    run_dir = directory_path("--run-dir", args.run_dir)
    if run_dir is not None:
        _writable_below("--run-dir", run_dir)
    directory_path("--checkpoint-dir", args.checkpoint_dir)
    directory_path("--plan-cache", args.plan_cache)
    directory_path("--resume", args.resume, must_exist=True)
    if args.cluster is not None and args.cluster != "auto":
        from hetpipe.plan.cluster import load_cluster

        try:
            load_cluster(args.cluster)
        except ValueError as e:
            raise ArgumentError(f"hetpipe: --cluster must be auto, a cluster preset or a cluster JSON file: {e}") from None
    check_launch(ranks, placement)


def check_launch(ranks: int, placement=None) -> None:
    """The variables ``hetpipe launch`` of ``ranks`` ranks reads, and those its ranks will: the peer,
    start-up and SIGTERM times, the data planes, the emulated devices and hosts (a list: one value per
    rank; an emulating ``placement``, :class:`hetpipe.launch.hosts.Placement`, sets ``HETPIPE_HOST``
    itself), and, for a launch that places no hosts, no placement left over from another launch (it
    would tell the ranks to sit on other hosts)."""
    from hetpipe.job.failure import signal_grace_s, timeout_s
    from hetpipe.job.placement import PLACEMENT_ENV
    from hetpipe.util.numbers import seconds

    checked(timeout_s)
    start = os.environ.get(START_TIMEOUT_ENV)
    if start:
        checked(lambda: seconds(START_TIMEOUT_ENV, start))
    checked(signal_grace_s)
    check_planes()
    check_per_rank(ranks, hosts=not (placement is not None and placement.emulate))
    if placement is None and os.environ.get(PLACEMENT_ENV):
        raise refusal(f"{PLACEMENT_ENV} is set ({os.environ[PLACEMENT_ENV]!r}): it is hetpipe launch's own "
                      "channel to its ranks, left over from another launch; unset it")
