"""The checkpoint format on disk, torch-free (the launcher reads it): names, the manifest, completeness.

Layout (docs/design.md, "Checkpoints and restart")::

    DIR/clock-000008/manifest.json            plan, clock, data position and its history, seed (the same from every
                                              rank), and once every part is on disk the digest of each part file
    DIR/clock-000008/rank-00003.safetensors   that rank's tensors (PS shard: W, B, outer state; stage: optimizer state)
    DIR/clock-000008/rank-00003.json          that rank's part: role, clocks, optimizer groups, LR scheduler, losses

The first rank to write a clock writes its manifest without digests; a rank that finds every part's
JSON and tensors on disk after writing its own writes it again with them (:func:`seal`), and only
then is the checkpoint complete. Each file is written to a temporary name, fsynced, renamed and its
directory fsynced (:func:`commit`), so a crash mid-write leaves an incomplete checkpoint that
:func:`latest` skips. Every byte a resume reads is covered by a digest the manifest holds, and every
part records the digest of the manifest's content: :func:`verify` checks both, and the data position
against the waves and plans the manifest records (:func:`check_data`). What the files hold and how
they are written and read back: :mod:`hetpipe.checkpoint.state`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hetpipe.plan.waves import deal_for
from hetpipe.util.errors import HetpipeError

FORMAT = 2           # 2: the manifest is written last and holds the digest of every part file
READS = (1, 2)       # 1: the manifest was written first and the parts' JSON were covered by no digest
MANIFEST = "manifest.json"
FILES = "files"      # the manifest's map: part file name -> its digest


class CheckpointError(HetpipeError, RuntimeError):
    """A checkpoint directory holds nothing to resume from, or something unreadable, or a write failed
    (naming the file, the bytes and the errno). Reported in one line, without a traceback: the message
    names what failed, and where in this rank's code it was noticed helps no one."""

    one_line = True


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


def failed_errno(exc: BaseException, directory: Path, nbytes: int) -> Optional[int]:
    """The errno behind a failed write of ``nbytes`` into ``directory``: an OSError's own (in ``exc`` or
    its chain of causes), else, for a library that reports I/O failures in its own exception type
    (safetensors raises ``SafetensorError`` with the OS error in its text), the errno the filesystem
    gives now for reserving those bytes there (``posix_fallocate`` of a scratch file, which counts
    against quotas as the write did: ENOSPC, EDQUOT, EFBIG). None when neither names one (the space is
    there: the failure was not the disk's)."""
    seen: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        seen.append(e)
        e = e.__cause__ or e.__context__
    probe = Path(directory) / f".space-probe.{temporary_tag()}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e2:
        return e2.errno
    try:
        os.posix_fallocate(fd, 0, max(1, nbytes))
        return None
    except OSError as e2:
        return e2.errno
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


def write_error(path: Path, exc: BaseException, nbytes: int = 0, what: str = "") -> CheckpointError:
    """The :class:`CheckpointError` of a failed write of ``path`` (``what``: said after the name), naming
    the file, the error, and the errno behind it (:func:`failed_errno`) as ``[errno ENOSPC]``: the
    restarting launcher recognises a full disk by that mark (``launch.restart.out_of_space``), whatever
    layer (Python's I/O, safetensors) reported it."""
    code = failed_errno(exc, path.parent, nbytes)
    mark = f" [errno {errno.errorcode.get(code, code)}]" if code is not None else ""
    return CheckpointError(f"hetpipe: writing {path}{what} failed: {type(exc).__name__}: {exc}{mark}")


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.{temporary_tag()}.tmp")
    text = json.dumps(value, indent=1, allow_nan=True) + "\n"
    try:
        tmp.write_text(text)
        commit(tmp, path)
    except OSError as e:        # disk full, quota, I/O error: named, and nothing half-written left
        tmp.unlink(missing_ok=True)
        raise write_error(path, e, len(text.encode())) from e


def is_complete(path: Path) -> bool:
    """Whether the checkpoint in ``path`` has its manifest, sealed (format 2: with the digests of the part
    files, written once they all were: :func:`seal`), and every part it lists."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format") != 1 and FILES not in manifest:
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
    """A digest of a manifest's content (its JSON with sorted keys) but its map of part digests, which is
    made after the parts: what every part records of the manifest it was written with."""
    body = {k: v for k, v in manifest.items() if k != FILES}
    return hashlib.blake2b(json.dumps(body, sort_keys=True, allow_nan=True).encode(), digest_size=16).hexdigest()


def part_files(manifest: Dict[str, Any]) -> List[str]:
    """The names of the files of the parts a manifest lists: each part's JSON and tensors."""
    return [f"{p}{ext}" for p in manifest["parts"] for ext in (".json", ".safetensors")]


def seal(path: Path) -> bool:
    """Once every part the manifest in ``path`` lists is on disk, write the manifest again with the
    digest of every part file (its ``files``: a JSON's of its bytes, a tensors file's as that JSON
    recorded it), so that the manifest covers every byte a resume reads; the checkpoint is complete
    from then on. The manifest sealed is the one on disk (the first writer's): a part written against
    another one (an earlier attempt's) fails verification, as it did before seals. Returns whether the
    checkpoint is complete. Called by each rank after it wrote its part: the last to do so seals it (or
    several at once: they write the same bytes, and the rename is atomic)."""
    on_disk = json.loads((path / MANIFEST).read_text())
    if FILES in on_disk:
        return True
    if not all((path / f).exists() for f in part_files(on_disk)):
        return False
    files = {}
    for name in on_disk["parts"]:
        raw = (path / f"{name}.json").read_bytes()
        files[f"{name}.json"] = hashlib.blake2b(raw, digest_size=16).hexdigest()
        recorded = json.loads(raw).get("tensors_digest")
        files[f"{name}.safetensors"] = recorded or file_digest(path / f"{name}.safetensors")
    write_json(path / MANIFEST, {**on_disk, FILES: files})
    return True


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


def verify(path: Path) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """Check the complete checkpoint in ``path`` as a resume does before it loads anything, torch-free
    (the launcher's check too); returns its manifest and each part's JSON by part name. Checked: each
    part against the manifest (its clock, a PS part's applied version, the digest of the manifest it
    was written with) and its tensors against the digest it recorded; every part file against the
    digest the manifest holds (format 2: the part JSONs too, so that no byte a resume reads goes
    unchecked); and the data position against the waves and plans the manifest records
    (:func:`check_data`). The first mismatch is one :class:`CheckpointError` naming the file."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"hetpipe: the checkpoint {path} is incomplete (a part or its manifest is missing)")
    manifest = read_manifest(path)
    digest = manifest_digest(manifest)
    files = manifest.get(FILES) if manifest["format"] >= 2 else {}
    if not isinstance(files, dict) or (manifest["format"] >= 2 and sorted(files) != sorted(part_files(manifest))):
        raise CheckpointError(f"hetpipe: the checkpoint {path}: {MANIFEST} does not hold the digest of each part file "
                              f"({', '.join(part_files(manifest))}): it was altered")
    parts = {}
    for name in manifest["parts"]:
        part = read_part(path, name)
        verify_part(path, name, part, manifest, digest)
        if files:
            file = path / f"{name}.json"
            got = file_digest(file)
            if got != files[file.name]:
                raise CheckpointError(f"hetpipe: the checkpoint part {file} was altered or is corrupt: its digest "
                                      f"{got} is not the {files[file.name]} recorded in {MANIFEST}")
            if part.get("tensors_digest") != files[f"{name}.safetensors"]:
                raise CheckpointError(f"hetpipe: the checkpoint {path}: {MANIFEST} records a digest of "
                                      f"{name}.safetensors other than the one {name}.json recorded: it was altered")
        parts[name] = part
    check_data(path, manifest)
    return manifest, parts


def run_of(path: Path) -> Optional[str]:
    """The run id in a checkpoint's manifest ("" before run ids; None: unreadable)."""
    try:
        return str(json.loads((Path(path) / MANIFEST).read_text()).get("run_id", ""))
    except (OSError, ValueError, AttributeError):
        return None


def run_ids(directory: Path) -> Dict[str, List[int]]:
    """The runs whose checkpoints (complete or not) lie in ``directory``: run id -> their clocks
    (checkpoints written before run ids existed count as run ""); unreadable manifests are skipped."""
    out: Dict[str, List[int]] = {}
    for path in sorted(Path(directory).glob("clock-*")) if Path(directory).is_dir() else []:
        rid = run_of(path)
        if rid is not None:
            out.setdefault(rid, []).append(int(path.name.split("-")[1]))
    return out


def read_manifest(path: Path) -> Dict[str, Any]:
    """The manifest of the complete checkpoint in ``path``, of a format this hetpipe reads."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    if manifest.get("format") not in READS:
        raise CheckpointError(f"hetpipe: the checkpoint {path} has format {manifest.get('format')}, "
                              f"this hetpipe reads format(s) {', '.join(map(str, READS))}")
    return manifest


def reached(directory: Path) -> int:
    """The highest clock any rank wrote a part for (complete or not), -1 if none."""
    clocks = [int(p.name.split("-")[1]) for p in Path(directory).glob("clock-*") if any(p.glob("rank-*.json"))]
    return max(clocks, default=-1)


@dataclass
class DataPosition:
    """Where a run is in its data: epoch ``epoch`` of ``epochs``, from minibatch ``index`` of that epoch
    (minibatches before it in the epoch were trained); see :func:`hetpipe.loader.source.epoch_range`:
    the rest of that epoch is dealt round-robin to the VWs, each taking ``(per_epoch - index) //
    num_vws`` (fewer than ``num_vws`` left over), later epochs ``per_epoch // num_vws`` each."""

    epoch: int = 0
    index: int = 0

    def per_vw(self, per_epoch: int, num_vws: int, epochs: int) -> int:
        """Minibatches each of ``num_vws`` VWs trains from here to the end of ``epochs`` epochs."""
        if self.epoch >= epochs:
            return 0
        first = max(0, per_epoch - self.index) // num_vws
        return first + (epochs - self.epoch - 1) * (per_epoch // num_vws)

    def advance(self, k: int, per_epoch: int, num_vws: int) -> "DataPosition":
        """The position after each of ``num_vws`` VWs trained ``k`` more minibatches from here."""
        per = per_epoch // num_vws
        first = max(0, per_epoch - self.index) // num_vws
        if k < first:
            return DataPosition(self.epoch, self.index + k * num_vws)
        k -= first
        return DataPosition(self.epoch + 1 + k // per, (k % per) * num_vws)


def segment(clock: int, num_vws: int, nm: int, per_epoch: int, epochs: int, same_plan: bool,
            start: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """A manifest's record of one stretch of its run (from the start, or from a resume to the next):
    from ``clock`` on, ``num_vws`` VWs trained ``nm`` minibatches a wave each of an epoch of
    ``per_epoch`` minibatches, for ``epochs`` epochs; ``same_plan``: its minibatch count per VW goes on
    from the stretch before (a resume into the same plan). ``start`` (epoch, index, minibatches_per_vw):
    where the first stretch began when the run resumed from a checkpoint that recorded no stretches."""
    out = {"clock": clock, "vws": num_vws, "nm": nm, "minibatches_per_epoch": per_epoch, "epochs": epochs,
           "same_plan": same_plan}
    if start is not None:
        out["start"] = dict(start)
    return out


def data_cursor(segments: List[Dict[str, Any]], clock: int) -> Tuple[DataPosition, int]:
    """Where the stretches ``segments`` of a run (:func:`segment`) leave its data at ``clock``: the data
    position and the minibatches each VW trained under the last plan (what a manifest records)."""
    start = segments[0].get("start")
    pos = DataPosition(int(start["epoch"]), int(start["index"])) if start else DataPosition()
    q = int(start["minibatches_per_vw"]) if start else 0
    for i, seg in enumerate(segments):
        end = int(segments[i + 1]["clock"]) if i + 1 < len(segments) else clock
        n, per_epoch = int(seg["vws"]), int(seg["minibatches_per_epoch"])
        k = min(pos.per_vw(per_epoch, n, int(seg["epochs"])), (end - int(seg["clock"])) * int(seg["nm"]))
        q = (q if i == 0 or seg["same_plan"] else 0) + k
        pos = pos.advance(k, per_epoch, n)
    return pos, q


def stretch_shape(plan: Dict[str, Any]) -> Tuple[int, int]:
    """(slots, minibatches per slot and wave) of a plan's data deal (JSON data,
    :func:`hetpipe.plan.waves.deal_for`): its VWs and Nm with equal waves. A stretch (:func:`segment`)
    records these."""
    deal = deal_for([int(v.get("nm") or plan["nm"]) for v in plan["virtual_workers"]])
    return deal.num_slots, deal.per_slot


def check_data(path: Path, manifest: Dict[str, Any]) -> None:
    """Refuse, naming the manifest, a run's checkpoint (format 2, with a plan) whose data position or
    minibatch count is not where the waves up to its clock of the stretches it records leave the data
    (:func:`data_cursor`), or whose last stretch is not of its own plan or does not start at the clock
    it resumed from: a manifest edited to skip (or repeat) minibatches, even with every digest
    recomputed to match, unless its whole history was rewritten to agree."""
    plan = manifest.get("plan")
    if manifest.get("format") not in READS[1:] or not isinstance(plan, dict) or "virtual_workers" not in plan:
        return
    where = f"hetpipe: the checkpoint {path}: {MANIFEST}"
    try:
        clock, data = int(manifest["clock"]), manifest["data"]
        segments = data["segments"]
        pos, q = DataPosition(int(data["position"]["epoch"]), int(data["position"]["index"])), \
            int(data["minibatches_per_vw"])
        last = segments[-1]
        resumed = manifest.get("resumed_from")
        since = int(resumed["clock"]) if resumed else 0
        slots, per_slot = stretch_shape(plan)
        if (int(last["vws"]), int(last["nm"]), int(last["clock"])) != (slots, per_slot, since):
            raise CheckpointError(f"{where} records a last stretch of {last['vws']} VW(s), nm={last['nm']} from clock "
                                  f"{last['clock']}, but its plan has {slots} VW(s), nm={per_slot} (slots of its "
                                  f"deal, minibatches of each per wave), and it resumed at clock {since}: it was "
                                  "altered")
        clocks = [int(s["clock"]) for s in segments] + [clock]
        if clocks != sorted(clocks) or (clocks[0] != 0 and "start" not in segments[0]):
            raise CheckpointError(f"{where} records stretches from clocks {clocks[:-1]} up to clock {clock}, not a "
                                  "run's history: it was altered")
        want, want_q = data_cursor(segments, clock)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{where} lacks its data position or its history ({type(e).__name__}: {e}): it was "
                              "altered") from None
    if (want, want_q) != (pos, q):
        raise CheckpointError(f"{where} puts the data at minibatch {pos.index} of epoch {pos.epoch}, {q} "
                              f"minibatch(es) trained per VW, but the waves up to clock {clock} of the plan(s) it "
                              f"records leave it at minibatch {want.index} of epoch {want.epoch}, {want_q} per VW: it "
                              "was altered (resuming would skip or repeat minibatches)")
