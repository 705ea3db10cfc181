"""What one rank can tell about where it runs: its host, the GPUs of that host and the links between
them, and the device type it emulates, if any. Torch-free and CUDA-context-free.

Discovery (:mod:`hetpipe.job.discovery`) allgathers these facts and builds the cluster from them.

Emulation goes through the same path: ``HETPIPE_EMULATE`` names the device type a rank emulates
(``ps`` or ``none``: no device, the rank is a parameter-server slot), and ``HETPIPE_HOST`` overrides
the host name, so several "hosts" can share one machine in tests. Each variable holds one value for
every rank or a comma-separated list with one value per world rank (what one ``mpiexec -env`` can
carry). An emulated type is a type of the shipped ``cpu-emulated-6`` preset (``emu_fast``, ``emu_mid``,
``emu_slow``) or ``name:speed=S:memory=M`` (speed a fraction of the host's, memory in bytes or with a
KiB/MiB/GiB suffix).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hetpipe.util.gpus import gpu_identity, local_gpus, normal_uuid, parse_gpu_query, visible_gpus  # noqa: F401

HOST_ENV = "HETPIPE_HOST"
EMULATE_ENV = "HETPIPE_EMULATE"
NO_DEVICE = ("ps", "none")
EMULATED_TYPES = "cpu-emulated-6"     # the preset whose types HETPIPE_EMULATE may name
_SUFFIX = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def per_rank(variable: str, rank: int, size: int) -> str:
    """This rank's value of ``variable``: the whole value, or item ``rank`` of a comma list of ``size``."""
    value = os.environ.get(variable, "").strip()
    if "," not in value:
        return value
    items = [v.strip() for v in value.split(",")]
    if len(items) != size:
        raise ValueError(f"{variable} lists {len(items)} values but the world has {size} ranks "
                         f"(one value for all, or one per rank): {value!r}")
    return items[rank]


def host_name(rank: int, size: int) -> str:
    """The host this rank counts as: ``HETPIPE_HOST`` if set, else the machine's host name."""
    return per_rank(HOST_ENV, rank, size) or socket.gethostname()


def emulated_type(rank: int, size: int) -> Optional[Dict[str, Any]]:
    """The device type this rank emulates as ``{"name", "speed", "memory_bytes"}``, ``{}`` for a rank
    asked to hold no device, None when ``HETPIPE_EMULATE`` says nothing for it."""
    spec = per_rank(EMULATE_ENV, rank, size)
    if not spec:
        return None
    if spec.lower() in NO_DEVICE:
        return {}
    name, _, rest = spec.partition(":")
    if not rest:
        known = _shipped_emulated_types()
        if name not in known:
            raise ValueError(f"{EMULATE_ENV} of rank {rank}: unknown emulated type {name!r} (shipped: "
                             f"{sorted(known)}; or give name:speed=S:memory=M)")
        return {"name": name, **known[name]}
    fields: Dict[str, str] = {}
    for item in rest.split(":"):
        key, eq, value = item.partition("=")
        if not eq or key not in ("speed", "memory"):
            raise ValueError(f"{EMULATE_ENV} of rank {rank}: {item!r} in {spec!r} is not speed=S or memory=M")
        fields[key] = value
    if set(fields) != {"speed", "memory"}:
        raise ValueError(f"{EMULATE_ENV} of rank {rank}: {spec!r} needs both speed= and memory=")
    try:
        speed = float(fields["speed"])
    except ValueError:
        speed = -1.0
    if not 0 < speed < float("inf"):
        raise ValueError(f"{EMULATE_ENV} of rank {rank}: speed must be a number > 0, got {fields['speed']!r}")
    return {"name": name, "speed": speed, "memory_bytes": _bytes(fields["memory"], f"{EMULATE_ENV} of rank {rank}")}


def _bytes(text: str, where: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KkMmGg]i[Bb])?\s*", text)
    if not m:
        raise ValueError(f"{where}: memory must be bytes or a number with KiB/MiB/GiB, got {text!r}")
    value = int(m.group(1)) * _SUFFIX[(m.group(2) or "").lower()]
    if value < 1:
        raise ValueError(f"{where}: memory must be at least 1 byte, got {text!r}")
    return value


def _shipped_emulated_types() -> Dict[str, Dict[str, Any]]:
    """The device types of the shipped preset :data:`EMULATED_TYPES` (name -> speed, memory_bytes)."""
    path = Path(__file__).resolve().parents[1] / "data" / "clusters" / f"{EMULATED_TYPES}.json"
    types = json.loads(path.read_text())["device_types"]
    return {name: {"speed": t["speed"], "memory_bytes": t["memory_bytes"]} for name, t in types.items()}


def gpu_links(gpus: List[Dict[str, Any]]) -> Dict[Tuple[int, int], str]:
    """``"nvlink"`` or ``"pcie"`` for each pair of ``gpus`` (positions in that list), from
    ``nvidia-smi topo -m``; pairs it does not describe are left out."""
    smi = shutil.which("nvidia-smi")
    if not smi or len(gpus) < 2:
        return {}
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_topology(out, [g["index"] for g in gpus])


def parse_topology(text: str, indices: List[int]) -> Dict[Tuple[int, int], str]:
    """The link kinds of ``nvidia-smi topo -m``'s matrix between GPUs ``indices`` (physical), keyed by
    positions in ``indices``: ``NV<k>`` is NVLink; ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS`` are PCIe
    paths (through switches, the host bridge or the CPU interconnect)."""
    rows: Dict[int, List[str]] = {}
    header: List[str] = []
    for line in text.splitlines():
        cells = line.split()
        if not cells:
            continue
        if not header and cells[0].startswith("GPU0"):
            header = cells
            continue
        m = re.fullmatch(r"GPU(\d+)", cells[0])
        if header and m:
            rows[int(m.group(1))] = cells[1:1 + len(header)]
    columns = {int(h[3:]): i for i, h in enumerate(header) if re.fullmatch(r"GPU\d+", h)}
    kinds: Dict[Tuple[int, int], str] = {}
    for a, ia in enumerate(indices):
        for b, ib in enumerate(indices):
            if a >= b or ia not in rows or ib not in columns or columns[ib] >= len(rows[ia]):
                continue
            cell = rows[ia][columns[ib]]
            if cell.startswith("NV"):
                kinds[(a, b)] = "nvlink"
            elif cell in ("PIX", "PXB", "PHB", "NODE", "SYS"):
                kinds[(a, b)] = "pcie"
    return kinds


def host_ranks() -> int:
    """The world a lone process describes when it discovers for itself (``hetpipe plan --cluster auto``
    not under mpiexec): the ranks ``hetpipe launch`` would start on this host, one per item of
    ``HETPIPE_EMULATE``'s (else ``HETPIPE_HOST``'s) comma list, one for a single ``HETPIPE_EMULATE``
    value, else one per GPU this host shows (one when it shows none)."""
    for variable in (EMULATE_ENV, HOST_ENV):
        value = os.environ.get(variable, "").strip()
        if "," in value:
            return len(value.split(","))
    if os.environ.get(EMULATE_ENV, "").strip():
        return 1
    return max(1, len(local_gpus()))


def rank_facts(rank: int, size: int) -> Dict[str, Any]:
    """Everything discovery needs from this rank (plain data, for an allgather). Bad environment
    values are reported in ``"error"`` rather than raised, so that every rank can name them together."""
    facts: Dict[str, Any] = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "error": ""}
    try:
        facts["host"] = host_name(rank, size)
        facts["emulate"] = emulated_type(rank, size)
    except ValueError as e:
        facts["emulate"], facts["error"] = None, str(e)
    gpus = local_gpus() if facts["emulate"] is None else []
    facts["gpus"] = gpus
    facts["links"] = [[a, b, kind] for (a, b), kind in sorted(gpu_links(gpus).items())]
    return facts
