"""This host's GPUs as nvidia-smi lists them (no CUDA context), in CUDA's visible order, and what tells
one GPU apart from every other across processes (its UUID, else its PCI bus id). Torch-free, stdlib
only: the stage transport (same-GPU decisions) and discovery (:mod:`hetpipe.job.inventory`) read it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional

_QUERY = "index,name,memory.total,compute_cap,pci.bus_id,uuid"
_FIELDS = len(_QUERY.split(","))


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
