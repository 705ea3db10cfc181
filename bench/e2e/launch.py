"""Start one benchmark worker under mpiexec (or as a single process) and read back its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Union

HERE = Path(__file__).resolve().parent


def mpiexec_path() -> str:
    """The mpiexec next to the running interpreter (the venv's MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def run_worker(script: Union[str, Path], ranks: Optional[int], cfg: Path, out: Path, timeout_s: float,
               args: List[str] = ()) -> dict:
    """Run ``script`` (a file name in this folder, or a path) on ``ranks`` MPI ranks (None: one plain process).

    The worker imports from this folder and from its own. Returns the result dict rank 0 wrote, with
    ``elapsed_s`` (the whole launch) added. Raises RuntimeError with the worker's output tail if it
    fails or times out.
    """
    path = Path(script) if Path(script).is_absolute() else HERE / script
    cmd = [sys.executable, str(path), str(cfg), str(out), *args]
    if ranks is not None:
        cmd = [mpiexec_path(), "-n", str(ranks), *cmd]
    paths = dict.fromkeys([str(path.parent), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"")[-3000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:])
        raise RuntimeError(f"{script}: timed out after {timeout_s:.0f} s\n{tail}") from e
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{script}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(out.read_text())
    result["elapsed_s"] = time.perf_counter() - t0
    return result
