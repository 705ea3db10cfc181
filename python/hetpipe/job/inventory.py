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

HOST_ENV = "HETPIPE_HOST"
EMULATE_ENV = "HETPIPE_EMULATE"
NO_DEVICE = ("ps", "none")
EMULATED_TYPES = "cpu-emulated-6"     # the preset whose types HETPIPE_EMULATE may name
_SUFFIX = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_QUERY = "index,name,memory.total,compute_cap,pci.bus_id,uuid"
_FIELDS = len(_QUERY.split(","))


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


def local_gpus() -> List[Dict[str, Any]]:
    """The GPUs this rank may use, in CUDA's visible order: ``{"index", "name", "memory_bytes",
    "compute_capability", "bus_id", "uuid"}`` each. Read with ``nvidia-smi`` (no CUDA context), honouring
    ``CUDA_VISIBLE_DEVICES`` (:func:`visible_gpus`); empty without a driver."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return visible_gpus(parse_gpu_query(out), os.environ.get("CUDA_VISIBLE_DEVICES"))


def parse_gpu_query(text: str) -> List[Dict[str, Any]]:
    """The GPUs of ``nvidia-smi --query-gpu=index,name,memory.total,compute_cap,pci.bus_id,uuid
    --format=csv,noheader,nounits`` output, in its (physical) order; lines of another form are skipped."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != _FIELDS or not parts[0].isdigit():
            continue
        mib = int(parts[2]) if parts[2].isdigit() else 0
        gpus.append({"index": int(parts[0]), "name": parts[1], "memory_bytes": mib << 20,
                     "compute_capability": parts[3], "bus_id": parts[4], "uuid": normal_uuid(parts[5])})
    return gpus


def visible_gpus(gpus: List[Dict[str, Any]], visible: Optional[str]) -> List[Dict[str, Any]]:
    """``gpus`` (physical order) as CUDA numbers them under ``CUDA_VISIBLE_DEVICES=visible`` (None: all):
    its items are indices or UUIDs (``GPU-...``; a unique prefix names a GPU, as for CUDA), and CUDA
    stops at the first item it cannot use."""
    if visible is None:
        return gpus
    by_index = {g["index"]: g for g in gpus}
    chosen = []
    for item in visible.split(","):
        item = item.strip()
        if item.isdigit() and int(item) in by_index:
            chosen.append(by_index[int(item)])
            continue
        named = [g for g in gpus if item.upper().startswith("GPU-") and g["uuid"].startswith(normal_uuid(item))]
        if len(named) != 1:
            break
        chosen.append(named[0])
    return chosen


def normal_uuid(text: str) -> str:
    """A GPU UUID in nvidia-smi's form, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (lower-case hex), from
    that form or CUDA's (``cudaDeviceProp.uuid`` as torch prints it, without the prefix); a partial
    UUID (a ``CUDA_VISIBLE_DEVICES`` prefix) keeps its hex digits, lower-cased, after ``GPU-``."""
    body = text.strip()
    if body.upper().startswith("GPU-"):
        body = body[4:]
    digits = re.sub(r"[^0-9a-fA-F]", "", body).lower()
    if len(digits) == 32:
        digits = "-".join((digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:]))
    elif "-" in body:
        digits = re.sub(r"[^0-9a-f-]", "", body.lower())
    return f"GPU-{digits}" if digits else ""


def gpu_identity(position: int, reported: str = "") -> str:
    """What tells the CUDA device this process numbers ``position`` apart from every other GPU, whatever
    index other processes give it (under per-rank ``CUDA_VISIBLE_DEVICES`` two ranks on different GPUs
    both call theirs 0): ``reported`` (the UUID CUDA reports, torch's ``get_device_properties(i).uuid``)
    when given, else the UUID nvidia-smi lists for it in CUDA's visible order, else its PCI bus id;
    "" when none is known."""
    if reported:
        return normal_uuid(reported)
    gpus = local_gpus()
    if not 0 <= position < len(gpus):
        return ""
    return gpus[position]["uuid"] or (f"pci:{gpus[position]['bus_id']}" if gpus[position]["bus_id"] else "")


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
