"""The checkpoint format on disk, torch-free (the launcher reads it): names, the manifest, completeness.

Layout (docs/design.md, "Checkpoints and restart")::

    DIR/clock-000008/manifest.json            plan, clock, data position, seed (the same from every rank)
    DIR/clock-000008/rank-00003.safetensors   that rank's tensors (PS shard: W, B, outer state; stage: optimizer state)
    DIR/clock-000008/rank-00003.json          that rank's part: role, clocks, optimizer groups, LR scheduler, losses

A checkpoint is complete once its manifest and every part's JSON and tensors exist; each file is
written to a temporary name, fsynced, renamed and its directory fsynced (:func:`commit`), so a crash
mid-write leaves an incomplete checkpoint that :func:`latest` skips. What the files hold and how they
are written and read back: :mod:`hetpipe.checkpoint.state`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hetpipe.util.errors import HetpipeError

FORMAT = 1
MANIFEST = "manifest.json"


class CheckpointError(HetpipeError, RuntimeError):
    """A checkpoint directory holds nothing to resume from, or something unreadable."""


def clock_dir(directory: Path, clock: int) -> Path:
    return Path(directory) / f"clock-{clock:06d}"


def part_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """fsync ``tmp``, rename it to ``final``, fsync the directory: ``final`` is whole or absent."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def temporary_tag() -> str:
    """What makes a writer's temporary file names its own: its process and thread (two writers of one
    clock, such as two ranks' manifests, never share a temporary file, even in one process)."""
    return f"{os.getpid()}-{threading.get_ident()}"


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.{temporary_tag()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=1, allow_nan=True) + "\n")
        commit(tmp, path)
    except OSError as e:        # disk full, quota, I/O error: named, and nothing half-written left
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"hetpipe: writing {path} failed: {type(e).__name__}: {e}") from e


def is_complete(path: Path) -> bool:
    """Whether the checkpoint in ``path`` has its manifest and every part it lists."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all((path / f"{p}.json").exists() and (path / f"{p}.safetensors").exists() for p in manifest["parts"])


def latest(directory: Path) -> Optional[Path]:
    """The complete checkpoint of the highest clock in ``directory`` (None if there is none)."""
    found = sorted(Path(directory).glob("clock-*")) if Path(directory).is_dir() else []
    for path in reversed(found):
        if is_complete(path):
            return path
    return None


def find(directory: Path) -> Path:
    """The latest complete checkpoint in ``directory`` (a checkpoint directory, or one clock of it)."""
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        if not is_complete(directory):
            raise CheckpointError(f"hetpipe: the checkpoint {directory} is incomplete (a part or its manifest is missing)")
        return directory
    path = latest(directory)
    if path is None:
        raise CheckpointError(f"hetpipe: no complete checkpoint in {directory}")
    return path


def complete_clocks(directory: Path) -> List[Path]:
    """The complete checkpoints in ``directory``, newest first."""
    found = sorted(Path(directory).glob("clock-*")) if Path(directory).is_dir() else []
    return [p for p in reversed(found) if is_complete(p)]


def file_digest(path: Path) -> str:
    """A digest of a file's bytes (BLAKE2b, 128 bits), read in 1 MiB pieces."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def manifest_digest(manifest: Dict[str, Any]) -> str:
    """A digest of a manifest's content (its JSON with sorted keys), which every part records."""
    return hashlib.blake2b(json.dumps(manifest, sort_keys=True, allow_nan=True).encode(), digest_size=16).hexdigest()


def verify_part(path: Path, name: str, part: Dict[str, Any], manifest: Dict[str, Any], digest: str) -> None:
    """Raise :class:`CheckpointError` naming the file and field where ``part`` (the JSON of part ``name``
    of the checkpoint in ``path``) disagrees with its tensors file or with the manifest, whose digest is
    ``digest``: its clock, a PS part's applied version, the manifest's digest, its tensors file's digest.
    Parts written before digests existed pass."""
    clock = manifest.get("clock")
    if part.get("clock") != clock:
        raise CheckpointError(f"hetpipe: the checkpoint {path}: {name}.json is of clock {part.get('clock')}, the "
                              f"manifest's clock is {clock}: the manifest or the part was altered")
    if part.get("role") == "ps" and "applied" in part and part["applied"] != clock:
        raise CheckpointError(f"hetpipe: the checkpoint {path}: {name}.json applied waves up to {part.get('applied')}, "
                              f"the manifest's clock is {clock}: the manifest or the part was altered")
    if "manifest_digest" in part and part["manifest_digest"] != digest:
        raise CheckpointError(f"hetpipe: the checkpoint {path}: {MANIFEST} does not match the manifest {name} was "
                              "written with (a field of it was altered: clock, data position, plan, ...)")
    if "tensors_digest" in part:
        file = path / f"{name}.safetensors"
        got = file_digest(file)
        if got != part["tensors_digest"]:
            raise CheckpointError(f"hetpipe: the checkpoint part {file} is corrupt: its digest {got} is not the "
                                  f"{part['tensors_digest']} recorded in {name}.json when it was written")


def read_part(path: Path, name: str) -> Dict[str, Any]:
    """The JSON of part ``name`` of the checkpoint in ``path``."""
    file = Path(path) / f"{name}.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"hetpipe: the checkpoint part {file} is unreadable: {e}") from None


def verify(path: Path) -> None:
    """Check the complete checkpoint in ``path`` as a resume does before it loads anything (every part
    against its tensors file's digest and the manifest), without reading the tensors: the launcher's
    check, torch-free. Raises :class:`CheckpointError` naming the first mismatch."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"hetpipe: the checkpoint {path} is incomplete (a part or its manifest is missing)")
    manifest = read_manifest(path)
    digest = manifest_digest(manifest)
    for name in manifest["parts"]:
        verify_part(path, name, read_part(path, name), manifest, digest)


def run_ids(directory: Path) -> Dict[str, List[int]]:
    """The runs whose checkpoints (complete or not) lie in ``directory``: run id -> their clocks
    (checkpoints written before run ids existed count as run ""); unreadable manifests are skipped."""
    out: Dict[str, List[int]] = {}
    for path in sorted(Path(directory).glob("clock-*")) if Path(directory).is_dir() else []:
        try:
            rid = str(json.loads((path / MANIFEST).read_text()).get("run_id", ""))
        except (OSError, ValueError, AttributeError):
            continue
        out.setdefault(rid, []).append(int(path.name.split("-")[1]))
    return out


def read_manifest(path: Path) -> Dict[str, Any]:
    """The manifest of the complete checkpoint in ``path``, of a format this hetpipe reads."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"hetpipe: the checkpoint {path} has format {manifest.get('format')}, "
                              f"this hetpipe reads format {FORMAT}")
    return manifest


def reached(directory: Path) -> int:
    """The highest clock any rank wrote a part for (complete or not), -1 if none."""
    clocks = [int(p.name.split("-")[1]) for p in Path(directory).glob("clock-*") if any(p.glob("rank-*.json"))]
    return max(clocks, default=-1)


@dataclass
class DataPosition:
    """Where a run is in its data: epoch ``epoch`` of ``epochs``, from minibatch ``index`` of that epoch
    (minibatches before it in the epoch were trained); see :func:`hetpipe.loader.source.epoch_range`."""

    epoch: int = 0
    index: int = 0

    def per_vw(self, per_epoch: int, num_vws: int, epochs: int) -> int:
        """Minibatches each of ``num_vws`` VWs trains from here to the end of ``epochs`` epochs."""
        if self.epoch >= epochs:
            return 0
        per = per_epoch // num_vws
        first = max(0, per * num_vws - self.index) // num_vws
        return first + (epochs - self.epoch - 1) * per

    def advance(self, k: int, per_epoch: int, num_vws: int) -> "DataPosition":
        """The position after each of ``num_vws`` VWs trained ``k`` more minibatches from here."""
        per = per_epoch // num_vws
        first = max(0, per * num_vws - self.index) // num_vws
        if k < first:
            return DataPosition(self.epoch, self.index + k * num_vws)
        k -= first
        return DataPosition(self.epoch + 1 + k // per, (k % per) * num_vws)
