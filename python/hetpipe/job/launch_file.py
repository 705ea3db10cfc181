"""The run file: what ``hetpipe launch`` asks of the ranks, written once, validated, read by every rank.

The launcher writes ``<run_dir>/launch.json`` before mpiexec starts; a rank finds it through the run
directory (``HETPIPE_RUN_DIR``, which the launcher sets for its own supervision). A rank started
without the launcher (plain ``mpiexec``) reads nothing and runs what its script says. The Trainer
merges these settings into the script's (:func:`hetpipe.run.config.resolve`): a field set by both, to
different values, is refused with one line naming both.

Torch-free: the launcher writes it, the ranks read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, Optional

from hetpipe.job.rundir import RUN_DIR_ENV
from hetpipe.util.errors import HetpipeError

LAUNCH_FILE = "launch.json"

# field -> the types it may hold (None always allowed: not asked for).
_TYPES: Dict[str, tuple] = {"cluster": (str,), "plan_cache": (str,), "plan": (str,), "plan_reason": (str,),
                            "restarting": (bool,), "checkpoint_dir": (str,), "checkpoint_every": (int,),
                            "resume": (str,), "run_id": (str,), "transport": (str,), "timeout": (int, float)}


class LaunchFileError(HetpipeError, ValueError):
    """The run file cannot be read or does not hold valid settings (names the file and the field)."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the launch asks for (None: the launch says nothing about it; the script decides).

    cluster / plan_cache / checkpoint_dir / checkpoint_every / resume / transport / timeout: the
    launcher's ``--cluster``, ``--plan-cache``, ... options (paths absolute). plan: a plan file every
    rank runs: ``--plan``, or the plan a restarting launcher made without a failed device
    (``plan_reason`` says which; ``restarting``: this attempt is a restart, whose plan and checkpoint
    replace the first attempt's). run_id: the run a restart from the start continues (its incomplete
    checkpoints are then its own)."""

    cluster: Optional[str] = None
    plan_cache: Optional[str] = None
    plan: Optional[str] = None
    plan_reason: Optional[str] = None
    restarting: bool = False
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None
    resume: Optional[str] = None
    run_id: Optional[str] = None
    transport: Optional[str] = None
    timeout: Optional[float] = None

    def write(self, run_dir: str) -> Path:
        """Write the file into ``run_dir`` atomically (a rank never reads half of it)."""
        path = Path(run_dir, LAUNCH_FILE)
        tmp = path.with_name(f".{LAUNCH_FILE}.tmp")
        tmp.write_text(json.dumps({k: v for k, v in asdict(self).items() if v not in (None, False)}, indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, run_dir: str) -> "LaunchSettings":
        """The settings in ``run_dir`` (none: the defaults); a malformed file is refused naming it."""
        path = Path(run_dir, LAUNCH_FILE)
        if not path.exists():
            return cls()
        try:
            data: Any = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise LaunchFileError(f"hetpipe: the run file {path} cannot be read: {e}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "LaunchSettings":
        if not isinstance(data, dict):
            raise LaunchFileError(f"hetpipe: the run file {where} must hold a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key, value in data.items():
            if key not in known:
                raise LaunchFileError(f"hetpipe: the run file {where} has an unknown field {key!r}")
            ok = _TYPES[key]
            if value is not None and (not isinstance(value, ok) or (bool not in ok and isinstance(value, bool))):
                raise LaunchFileError(f"hetpipe: the run file {where}: {key} must be "
                                      f"{' or '.join(t.__name__ for t in ok)}, got {value!r}")
        return cls(**data)

    @classmethod
    def current(cls) -> "LaunchSettings":
        """This process's launch: the run file of ``HETPIPE_RUN_DIR``, or the defaults without one."""
        run_dir = os.environ.get(RUN_DIR_ENV)
        return cls.read(run_dir) if run_dir else cls()
