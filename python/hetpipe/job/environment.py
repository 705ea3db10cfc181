"""The ``HETPIPE_*`` environment variables, checked before anything starts (docs/clusters.md,
"Environment variables"): a malformed one is one :class:`~hetpipe.util.errors.ArgumentError` naming
the variable, its value and what is allowed, instead of a traceback on every rank that reads it later.

:func:`check_rank`: what a rank reads; the Trainer checks it when built, on every rank alike, before
MPI start-up. :func:`check_launch`: what ``hetpipe launch`` and its ranks read; the launcher checks it
before it makes its run directory. An empty variable counts as unset, as where it is read. Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from hetpipe.util.errors import ArgumentError
from hetpipe.util.planes import PLANES, PS_PLANE_ENV, STAGE_PLANE_ENV


def _value(variable: str) -> Optional[str]:
    text = os.environ.get(variable, "").strip()
    return text or None


def refusal(message: str) -> ArgumentError:
    return ArgumentError(message if message.startswith("hetpipe") else f"hetpipe: {message}")


def checked(check: Callable[[], object]) -> None:
    """Run ``check`` (a reader of the environment that raises ValueError), refusing in one line."""
    try:
        check()
    except ArgumentError:
        raise
    except ValueError as e:
        raise refusal(str(e)) from None


def check_planes() -> None:
    for variable in (PS_PLANE_ENV, STAGE_PLANE_ENV):
        text = _value(variable)
        if text is not None and text.lower() not in PLANES:
            raise refusal(f"{variable} must be one of {', '.join(PLANES)} (or unset), got {text!r}")


def check_per_rank(ranks: int, hosts: bool = True) -> None:
    """``HETPIPE_EMULATE`` (and ``HETPIPE_HOST`` with ``hosts``): every value it lists is valid, and a
    list has one value per rank of the ``ranks``."""
    from hetpipe.job.inventory import EMULATE_ENV, HOST_ENV, emulated_type, per_rank

    for variable in (EMULATE_ENV, HOST_ENV) if hosts else (EMULATE_ENV,):
        text = _value(variable)
        if text is None:
            continue
        size = ranks if "," in text else 1
        for r in range(size):
            checked(lambda: emulated_type(r, size) if variable == EMULATE_ENV else per_rank(variable, r, size))


def check_rank() -> None:
    """The variables a rank reads: the data planes, the SIGTERM grace and the launcher's own channel
    (``HETPIPE_RUN_DIR``, ``HETPIPE_LAUNCHER_PID``, ``HETPIPE_PLACEMENT``) when set. (``HETPIPE_TIMEOUT``
    is checked where the run's timeout is resolved; ``HETPIPE_EMULATE`` and ``HETPIPE_HOST`` by discovery,
    which knows the world and names the rank, on every rank alike.)"""
    from hetpipe.job.failure import signal_grace_s
    from hetpipe.job.guard import LAUNCHER_PID_ENV
    from hetpipe.job.placement import PLACEMENT_ENV
    from hetpipe.job.rundir import RUN_DIR_ENV

    check_planes()
    checked(signal_grace_s)
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir and not Path(run_dir).is_dir():
        raise refusal(f"{RUN_DIR_ENV} must be the run directory of hetpipe launch (an existing directory), "
                      f"got {run_dir!r}; unset it to run without the launcher")
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if pid and not pid.strip().isdigit():
        raise refusal(f"{LAUNCHER_PID_ENV} must be the launcher's pid (a whole number), got {pid!r}; unset it to "
                      "run without the launcher")
    placement = os.environ.get(PLACEMENT_ENV)
    if placement:
        try:
            hosts = json.loads(Path(placement).read_text())["hosts"]
            ok = isinstance(hosts, list)
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise refusal(f"{PLACEMENT_ENV} must name the launcher's placement.json (a JSON object with a 'hosts' "
                          f"list), got {placement!r}; unset it to run without the launcher")
