"""Checkpoints of a WSP run: consistent cuts at wave boundaries, written asynchronously and atomically.

The files and their names: :mod:`hetpipe.checkpoint.format`.
Clock ``b`` is the cut after wave ``b - 1``: every PS shard has applied waves ``< b`` (its ``W`` is
the global ``W_b``) and every stage has pushed wave ``b - 1`` (its optimizer state holds exactly its
VW's updates of minibatches ``< b * nm``). A checkpoint is complete once its manifest and every
part's JSON exist; each file is written to a temporary name, fsynced, renamed and its directory
fsynced, and the JSON of a part only after its tensors, so a crash mid-write leaves an incomplete
checkpoint that :func:`latest` skips, and the previous complete one intact. A rank removes its own
parts of older checkpoints only once a newer one is complete, and never writes a clock older than the
newest complete one (see :meth:`Checkpointer._collect`); incomplete checkpoints a killed run left are
removed at the next start-up (:func:`remove_incomplete`). A run that ends normally writes its last
clock too (``Checkpointer.close(final=True)``). Formats: safetensors and JSON; nothing here unpickles.

Thread role: :class:`Checkpointer` is called from the rank's main thread (``boundary``, ``close``,
``on_signal``); one writer thread per rank does the disk I/O. At most one checkpoint is in flight:
when the next is due before the previous is on disk, ``boundary`` waits for it (the time is kept in
``waited_s``), so that every rank writes every due clock and the cuts stay complete.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hetpipe.checkpoint.format import (MANIFEST, CheckpointError, DataPosition, clock_dir, commit, complete_clocks,
                                       file_digest, find, is_complete, manifest_digest, part_name, run_of, seal,
                                       temporary_tag, verify, write_error, write_json)
from hetpipe.checkpoint.statejson import decode, encode, merge
from hetpipe.model.layout import local_buffers

Snapshot = Tuple[Dict[str, torch.Tensor], Dict[str, Any]]      # (tensors on the CPU, JSON part)


def write_tensors(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{temporary_tag()}.tmp")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp))
        commit(tmp, path)
    except Exception as e:  # noqa: BLE001 - disk full, quota, I/O error: named, and nothing half-written left
        tmp.unlink(missing_ok=True)
        # safetensors reports an I/O failure as its own SafetensorError, with no errno: write_error finds it.
        raise write_error(path, e, nbytes, f" ({nbytes} bytes of tensors)") from e


def read_tensors(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@dataclass
class Checkpoint:
    """A complete checkpoint, read back: its manifest and each rank's part (JSON and tensors)."""

    path: Path
    manifest: Dict[str, Any]
    parts: Dict[int, Dict[str, Any]]                    # rank -> part JSON
    tensors: Dict[int, Dict[str, torch.Tensor]]         # rank -> its tensors

    @classmethod
    def read(cls, path: Path) -> "Checkpoint":
        """The complete checkpoint in ``path``, verified before anything is loaded
        (:func:`~hetpipe.checkpoint.format.verify`: every part file against the digest the manifest
        holds, every part against the manifest, the data position against the run's waves); the first
        mismatch is one :class:`CheckpointError` naming the file."""
        path = Path(path)
        manifest, by_name = verify(path)
        parts, tensors = {}, {}
        for name, part in by_name.items():
            parts[part["rank"]] = part
            try:
                tensors[part["rank"]] = read_tensors(path / f"{name}.safetensors")
            except Exception as e:  # noqa: BLE001 - an unreadable file is named, whatever the library raised
                raise CheckpointError(f"hetpipe: the checkpoint part {path / name}.safetensors is unreadable: "
                                      f"{type(e).__name__}: {e}") from None
        return cls(path, manifest, parts, tensors)

    @classmethod
    def find(cls, directory: Path, fallback: bool = False) -> "Checkpoint":
        """The latest complete checkpoint in ``directory`` (a checkpoint directory or one clock of it);
        with ``fallback``, a checkpoint that fails verification is reported on stderr and the previous
        complete one is tried instead."""
        directory = Path(directory)
        if (directory / MANIFEST).exists() or not fallback:
            return cls.read(find(directory))
        errors = []
        for path in complete_clocks(directory):
            try:
                found = cls.read(path)
            except CheckpointError as e:
                errors.append(str(e))
                sys.stderr.write(f"{e}; falling back to the previous complete checkpoint\n")
                continue
            return found
        if errors:
            raise CheckpointError(f"hetpipe: no complete checkpoint in {directory} passes verification: "
                                  + "; ".join(errors))
        raise CheckpointError(f"hetpipe: no complete checkpoint in {directory}")

    @property
    def clock(self) -> int:
        return int(self.manifest["clock"])

    def global_weights(self) -> Tuple[Dict[int, np.ndarray], Dict[int, np.ndarray]]:
        """Per layer, the global weights ``W_b`` and synced buffers ``B_b`` (flat float32)."""
        weights, buffers = {}, {}
        for t in self.tensors.values():
            for key, value in t.items():
                kind, _, layer = key.partition("/")
                if kind == "w":
                    weights[int(layer)] = value.numpy()
                elif kind == "b":
                    buffers[int(layer)] = value.numpy()
        return weights, buffers

    def global_momentum(self) -> Dict[int, np.ndarray]:
        """Per layer, the PS's outer momentum buffer at the cut (``m/<layer>``, flat float32: nesterov's or
        delayed-nesterov's; a checkpoint of a run without one, or written before it existed, has none: the
        run continues from zeros)."""
        out = {}
        for t in self.tensors.values():
            for key, value in t.items():
                kind, _, layer = key.partition("/")
                if kind == "m":
                    out[int(layer)] = value.numpy()
        return out

    def global_delayed(self) -> Tuple[Dict[int, np.ndarray], Dict[int, int]]:
        """Per layer, the PS's delayed-nesterov buffer at the cut (``a/<layer>``: the pushes since the layer's
        last momentum step, flat float32) and how many pushes it holds (``n/<layer>``); both empty for a
        checkpoint of a run under another rule (a run continues from zeros)."""
        buffers, counts = {}, {}
        for t in self.tensors.values():
            for key, value in t.items():
                kind, _, layer = key.partition("/")
                if kind == "a":
                    buffers[int(layer)] = value.numpy()
                elif kind == "n":
                    counts[int(layer)] = int(value.reshape(-1)[0])
        return buffers, counts

    def stage_part(self, vw: int, stage: int) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
        for rank, part in self.parts.items():
            if part["role"] == "stage" and part["vw"] == vw and part["stage"] == stage:
                return part, self.tensors[rank]
        raise CheckpointError(f"hetpipe: the checkpoint {self.path} has no part of VW {vw} stage {stage}")

    def losses(self) -> Dict[int, Dict[int, float]]:
        """vw -> minibatch -> loss of the minibatches before the cut (from each VW's last stage)."""
        out: Dict[int, Dict[int, float]] = {}
        for part in self.parts.values():
            if "losses" in part:
                out[part["vw"]] = {int(p): v for p, v in part["losses"].items()}
        return out


class Checkpointer:
    """One rank's checkpoints: keeps its last ``keep`` boundary snapshots in memory, writes every
    ``every``-th clock through the writer thread, and on SIGTERM the snapshots not yet written.
    ``keep = 0`` copies the state only at due clocks (no SIGTERM checkpoint: a signal then only lets
    the checkpoint in flight finish).

    ``manifest(clock)`` gives the manifest of a clock (identical on every rank)."""

    def __init__(self, directory: Path, every: int, rank: int, manifest: Callable[[int], Dict[str, Any]],
                 keep: int = 2, progress: Optional[Path] = None, run_id: str = "", keep_last: int = 1) -> None:
        if every < 1:
            raise ValueError(f"hetpipe: checkpoint_every must be >= 1 wave, got {every}")
        # Imported now, not at the first write: a SIGTERM write runs in a signal handler, which must not
        # interrupt (or run) a first import of the module (a second signal mid-import saw it half made).
        import safetensors.torch  # noqa: F401

        self.directory, self.every, self.rank = Path(directory), every, rank
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest = manifest
        self.progress = progress                        # a file to record the latest clock in (launcher's)
        self.keep = keep
        self.run_id, self.keep_last = run_id, keep_last        # this run's id; complete checkpoints kept
        self.ring: Deque[Tuple[int, Snapshot]] = collections.deque(maxlen=max(1, keep))
        self.written: List[int] = []
        self.waited_s = 0.0
        self.error: Optional[BaseException] = None
        self._last: Optional[Tuple[int, Callable[[], Snapshot]]] = None     # the latest boundary and its capture
        # Set by a SIGTERM that reached this rank alone: (deadline, end) for the next due clock.
        self._end: Optional[Tuple[float, Callable[[Optional[int]], None]]] = None
        self._job: Optional[Tuple[int, Snapshot]] = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hetpipe-checkpoint-{rank}", daemon=True)
        self._thread.start()

    # --- main thread -----------------------------------------------------------------------------
    def boundary(self, clock: int, capture: Callable[[], Snapshot]) -> None:
        """This rank reached clock ``clock``: keep a snapshot, and hand it to the writer if it is due."""
        self._raise()
        self._last = (clock, capture)
        due = clock % self.every == 0
        if self.keep == 0 and not due:
            snapshot = None
        else:
            snapshot = capture()
            self.ring.append((clock, snapshot))
        if self.progress is not None:
            tmp = self.progress.with_name(f".{self.progress.name}.tmp")
            tmp.write_text(f"{clock}\n")
            os.replace(tmp, self.progress)
        if due:
            started = time.monotonic()
            with self._cv:
                while self._job is not None:
                    self._cv.wait()
                self.waited_s += time.monotonic() - started
                self._job = (clock, snapshot)
                self._cv.notify_all()
        if self._end is not None:
            deadline, end = self._end
            if due:
                # Every rank writes this clock: once it is complete on disk the rank can leave.
                self.flush(max(0.0, deadline - time.monotonic()))
                path = clock_dir(self.directory, clock)
                while not is_complete(path) and time.monotonic() < deadline:
                    time.sleep(0.02)
                end(clock if is_complete(path) else None)
            elif time.monotonic() >= deadline:
                end(None)

    def flush(self, wait_s: Optional[float] = None) -> bool:
        """Wait until the writer thread has finished the checkpoint handed to it (written and collected,
        or failed: :meth:`close` raises that), at most ``wait_s`` when given. Whether it has."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._cv:
            while self._job is not None:
                if deadline is None:
                    self._cv.wait()
                elif time.monotonic() >= deadline:
                    return False
                else:
                    self._cv.wait(timeout=min(0.1, deadline - time.monotonic()))
        return True

    def close(self, final: bool = False, wait_s: float = 60.0) -> None:
        """Wait for the checkpoint in flight, stop the writer; raise what it failed with.

        ``final``: the run ended normally (all its waves, or an early stop) at the latest boundary, which
        every rank of the run reached at the same clock; that clock is written too when it was not due
        (the run's final checkpoint, from the snapshot kept at the boundary or, with ``keep = 0``, one
        captured now: nothing a rank holds changes after its last boundary). Older checkpoints are then
        removed once every rank's part of it is on disk (waiting at most ``wait_s``)."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._raise()
        if final and self._last is not None:
            clock, capture = self._last
            if clock not in self.written:
                snapshot = next((s for c, s in self.ring if c == clock and s is not None), None)
                self._write(clock, snapshot if snapshot is not None else capture())
            deadline = time.monotonic() + wait_s
            while not is_complete(clock_dir(self.directory, clock)) and time.monotonic() < deadline:
                time.sleep(0.02)
        self._collect()

    def on_signal(self, wait_s: float, settle_s: Optional[float] = None) -> bool:
        """Write every kept snapshot not yet on disk (after the one in flight), in this thread; then wait
        until one of the clocks this rank holds is complete on disk, at most ``wait_s`` in all, or
        ``settle_s`` for the completion when given. Whether one is.

        Why wait: mpiexec ends every rank once one exits, so a rank that wrote its part quickly would
        otherwise get its slower peers killed halfway through theirs; the ranks leave together instead.
        None complete within ``settle_s``: the signal reached this rank alone (its peers write only the
        due clocks), and the caller has it train on to the next due clock (:meth:`end_at_next_due`)."""
        deadline = time.monotonic() + wait_s
        self.flush(wait_s)
        for clock, snapshot in list(self.ring) if self.keep else ():
            if clock not in self.written:
                self._write(clock, snapshot)
        held = [clock for clock, _ in self.ring] if self.keep else self.written[-1:]
        until = deadline if settle_s is None else min(deadline, time.monotonic() + settle_s)
        while held and not any(is_complete(clock_dir(self.directory, c)) for c in held) \
                and time.monotonic() < until:
            time.sleep(0.02)
        self._collect()
        return any(is_complete(clock_dir(self.directory, c)) for c in held)

    def end_at_next_due(self, deadline: float, end: Callable[[Optional[int]], None]) -> None:
        """This rank got a SIGTERM that its peers did not: at the next due clock, once its checkpoint is
        complete on disk (every rank's part), :meth:`boundary` calls ``end(clock)``; past ``deadline``
        (``time.monotonic()``) the next boundary calls ``end(None)``. ``end`` does not return."""
        self._end = (deadline, end)

    def _raise(self) -> None:
        if isinstance(self.error, CheckpointError):
            raise self.error
        if self.error is not None:
            raise write_error(self.directory, self.error) from self.error

    # --- writer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._job is None:
                    return
                clock, snapshot = self._job
            try:
                self._write(clock, snapshot)
                self._collect()
            except BaseException as e:  # noqa: BLE001 - kept and raised on the main thread
                self.error = e
            with self._cv:
                self._job = None
                self._cv.notify_all()

    def _write(self, clock: int, snapshot: Snapshot) -> None:
        """Write this rank's part of ``clock`` (and the manifest, unsealed, if no rank has yet), and seal
        the manifest if the part was the last one missing (:func:`~hetpipe.checkpoint.format.seal`). A
        clock older than one of this run's complete checkpoints is not written: it is of no use, and a
        peer's :meth:`_collect` may be removing its directory (the SIGTERM path holds such clocks).

        While it writes, the rank holds a marker file in the clock's directory (``.rank-R.writing``),
        made before it checks the clock is still of use: a collector removes a directory only when it
        holds no part and no marker, after it found the clock obsolete. Either the marker is there
        when the collector looks (the directory stays), or it was made later, and the check after it
        finds the clock obsolete (a newer complete checkpoint stays complete), so the write is dropped.
        So no rank's directory is ever removed under it."""
        if self._obsolete(clock):
            return
        tensors, part = snapshot
        path = clock_dir(self.directory, clock)
        name = part_name(self.rank)
        marker = path / f".{name}.writing"
        try:
            path.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except FileNotFoundError:
            if self._obsolete(clock):               # a collector removed the directory just made: no use
                return
            raise
        except OSError as e:
            raise write_error(marker, e) from e
        try:
            if self._obsolete(clock):
                self._drop(path, marker)
                return
            manifest = self.manifest(clock)
            if not (path / MANIFEST).exists():
                write_json(path / MANIFEST, manifest)   # unsealed: who writes the clock, before any part
            write_tensors(path / f"{name}.safetensors", tensors)
            write_json(path / f"{name}.json", {**part, "rank": self.rank, "clock": clock,
                                               "tensors_digest": file_digest(path / f"{name}.safetensors"),
                                               "manifest_digest": manifest_digest(manifest)})
            self.written.append(clock)
            seal(path)
        except OSError as e:            # the digest's or the seal's reading: named like a failed write
            raise write_error(path / MANIFEST, e) from e
        finally:
            marker.unlink(missing_ok=True)

    @staticmethod
    def _drop(path: Path, marker: Path) -> None:
        """Leave a clock this rank found obsolete after marking it: its marker, and its directory if that
        is now empty (another rank's marker or part keeps it)."""
        marker.unlink(missing_ok=True)
        try:
            path.rmdir()
        except OSError:
            pass

    def _obsolete(self, clock: int) -> bool:
        """Whether ``clock`` is older than one of this run's complete checkpoints: it is of no use then,
        and stays so (a complete checkpoint is removed only once a newer one is complete)."""
        return any(clock < c for c in self._complete())

    def _complete(self) -> List[int]:
        """The clocks of this run's complete checkpoints, newest first."""
        return [clock_of(p) for p in complete_clocks(self.directory) if run_of(p) == self.run_id]

    def _collect(self) -> None:
        """Remove this rank's parts of this run's checkpoints older than the newest ``keep_last`` complete
        ones (another run's checkpoints are never touched), and the directory of one left without parts.

        Safe while other ranks write: a clock that is not older than the newest complete checkpoint is
        never touched; each rank removes only its own part (rank 0 also those of ranks this run does not
        have), and the manifest and directory go only once no part and no writer's marker is left
        (``rmdir``, never a tree): a rank still writing an older clock holds its marker there, and one
        that marks it later drops the write (see :meth:`_write`). Every rank does this at once, so a file
        or the directory can vanish under this rank, or a removal find it not yet empty: that is no
        error (another rank did, or does, the rest)."""
        mine = [p for p in complete_clocks(self.directory) if run_of(p) == self.run_id]
        if len(mine) < self.keep_last:
            return
        keep = clock_of(mine[self.keep_last - 1])
        name = part_name(self.rank)
        try:
            ranks = len(json.loads((mine[0] / MANIFEST).read_text())["parts"])
        except (OSError, ValueError):
            return
        for path in list(self.directory.glob("clock-*")):
            if clock_of(path) >= keep or run_of(path) != self.run_id:
                continue
            try:
                # The JSON first: without it the part no longer counts as written.
                files = [path / f"{name}.json", path / f"{name}.safetensors", *path.glob(f".{name}.*.tmp")]
                if self.rank == 0:
                    # Parts of ranks a run before a restart had and this one has not: nobody else removes them.
                    files += [f for f in path.glob("rank-*") if int(f.name[5:10]) >= ranks]
                for f in files:
                    f.unlink(missing_ok=True)
                if any(path.glob("rank-*")) or any(path.glob(".rank-*")):
                    continue            # a part, or a writer's marker or temporary file: not ours to remove
                for f in [path / MANIFEST, *path.glob(f".{MANIFEST}.*.tmp")]:
                    f.unlink(missing_ok=True)
                path.rmdir()
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise


def clock_of(path: Path) -> int:
    """The clock of a checkpoint directory ``clock-NNNNNN``."""
    return int(path.name.split("-")[1])


def remove_incomplete(directory: Path, run_id: str, cut: int) -> List[Path]:
    """Remove the incomplete checkpoints a killed run left in ``directory`` (nothing can run at SIGKILL
    time, so they are removed at the next start-up that uses the directory, before any rank of it
    writes); returns what was removed. Removed: run ``run_id``'s incomplete clocks before ``cut``, the
    clock that run goes on from (it is that run's start-up: no process of it is writing), and
    checkpoints whose manifest is missing or unreadable (no run claims them) older than the newest
    complete checkpoint of the directory (no live run writes a clock older than its newest complete
    one). Another run's checkpoints are never touched: it may be alive and writing them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    newest = max((clock_of(p) for p in complete_clocks(directory)), default=-1)
    removed = []
    for path in sorted(directory.glob("clock-*")):
        owner = run_of(path)
        if is_complete(path):
            continue
        if (owner == run_id and clock_of(path) < cut) or (owner is None and clock_of(path) < newest):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# --- what a rank saves ---------------------------------------------------------------------------
KEYED_BY_MODEL = "model"        # the optimizer JSON's "keyed": its keys are the model's own parameter names


def optimizer_order(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], keys: Sequence[str]
                    ) -> List[str]:
    """The key of each parameter in the order ``optimizer.state_dict()`` numbers them (group by group,
    found by identity among ``params``, whose keys are ``keys``)."""
    key_of = {id(p): k for p, k in zip(params, keys)}
    if len(set(key_of.values())) != len(key_of):
        twice = sorted({k for k in key_of.values() if list(key_of.values()).count(k) > 1})
        raise CheckpointError(f"hetpipe: the parameters named {twice} share a name; a checkpoint keys the optimizer "
                              "state by name")
    order = []
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in key_of:
                raise CheckpointError(f"hetpipe: the optimizer's param group {i} holds a {tuple(p.shape)} tensor that "
                                      "is none of the stage's parameters; a checkpoint cannot name its state")
            order.append(key_of[id(p)])
    return order


def optimizer_snapshot(optimizer: Optional[torch.optim.Optimizer], params: Sequence[torch.Tensor],
                       keys: Sequence[str]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """An optimizer's state by parameter key (``keys[i]`` names ``params[i]``; the stage passes the
    model's own names): tensors ``opt/<key>/<name>`` (CPU copies) and, as JSON, its other state and
    its param groups (each with the keys of its parameters), exactly (:mod:`~hetpipe.checkpoint.statejson`)."""
    if optimizer is None:
        return {}, {"keyed": KEYED_BY_MODEL, "groups": [], "scalars": {}}
    order = optimizer_order(optimizer, params, keys)
    sd = optimizer.state_dict()
    tensors: Dict[str, torch.Tensor] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for i, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt/{order[i]}/{name}"] = value.detach().to("cpu", copy=True)
            else:
                scalars.setdefault(order[i], {})[name] = encode(value, f"optimizer state {name!r} of {order[i]}")
    groups = []
    for g in sd["param_groups"]:
        groups.append({**{k: encode(v, f"optimizer option {k!r}") for k, v in g.items() if k != "params"},
                       "keys": [order[i] for i in g["params"]]})
    return tensors, {"keyed": KEYED_BY_MODEL, "groups": groups, "scalars": scalars}


def scheduler_snapshot(scheduler: Any) -> Any:
    """An LR scheduler's ``state_dict()``, exactly, as JSON (:mod:`~hetpipe.checkpoint.statejson`):
    nested dicts, tuples and tensors included; functions, which are code, stay out (a LambdaLR's
    lambdas come from the factory again on resume). What it cannot hold is refused in one line naming
    the scheduler's class, the key path and the type."""
    return encode(scheduler.state_dict(), f"the LR scheduler {type(scheduler).__name__} cannot be checkpointed: "
                                          "its state_dict()")


def restore_scheduler(scheduler: Any, saved: Any) -> None:
    """Give ``scheduler``, built again by the factory, the state :func:`scheduler_snapshot` saved (what
    it left out keeps the rebuilt scheduler's value)."""
    scheduler.load_state_dict(merge(scheduler.state_dict(), decode(saved)))


def restore_optimizer(optimizer: Optional[torch.optim.Optimizer], params: Sequence[torch.Tensor],
                      keys: Sequence[str], groups: List[Dict[str, Any]], scalars: Dict[str, Dict[str, Any]],
                      tensors: Dict[str, torch.Tensor]) -> int:
    """Load the state saved by :func:`optimizer_snapshot` (from one or several parts, of any plan) into
    ``optimizer``, whose parameters ``params`` have ``keys``; returns how many parameters got a saved
    state. ``groups``: the saved param groups; each of ``optimizer``'s groups takes the options (lr,
    weight_decay, ...) of the saved group holding its first parameter that has one (the group's own
    when the factory groups parameters the same way)."""
    if optimizer is None:
        return 0
    order = optimizer_order(optimizer, params, keys)
    index = {k: i for i, k in enumerate(order)}
    sd = optimizer.state_dict()
    state: Dict[int, Dict[str, Any]] = {}
    for name, value in tensors.items():
        kind, _, rest = name.partition("/")
        key, _, stat = rest.rpartition("/")         # a model's name may hold "/", a state's name does not
        if kind == "opt" and key in index:
            state.setdefault(index[key], {})[stat] = value
    for key, values in scalars.items():
        if key in index:
            state.setdefault(index[key], {}).update(decode(values))
    by_key = {k: g for g in groups for k in g["keys"]}
    new_groups = []
    for g in sd["param_groups"]:
        saved = next((by_key[order[i]] for i in g["params"] if order[i] in by_key), {})
        options = {k: decode(v) for k, v in saved.items() if k not in ("keys", "params", "param_names")}
        new_groups.append({**g, **options, "params": g["params"]})
    optimizer.load_state_dict({"state": state, "param_groups": new_groups})
    return len(state)


@dataclass
class Resume:
    """What a run resumes from: a checkpoint, and whether the run's plan is the checkpoint's own."""

    checkpoint: Checkpoint
    same_plan: bool
    start: DataPosition = field(default_factory=DataPosition)
    micro_offset: int = 0            # micro-batches each VW ran before the cut (seeds continue from there)
    minibatches: int = 0             # minibatches each VW trained before the cut (same plan; else 0)
    # With waves of unequal length (docs/design.md, "Waves of unequal length"): each VW's share of the
    # deal's slots; ``minibatches`` and ``micro_offset`` then count per slot. Empty: one slot per VW.
    shares: Tuple[int, ...] = ()
    split: int = 0                   # the checkpointed run's split start-up minibatches (same plan)

    def minibatches_of(self, vw: int) -> int:
        """Minibatches VW ``vw`` trained before the cut (same plan; else 0)."""
        return self.minibatches * (self.shares[vw] if self.shares else 1)

    def micro_offset_of(self, vw: int) -> int:
        """Micro-batches VW ``vw`` ran before the cut: its minibatches, the split start-up's counted twice."""
        if not self.shares:
            return self.micro_offset
        q = self.minibatches_of(vw)
        return q + min(self.split, q)

    def restore_stage(self, model, layout, vw: int, stage: int) -> None:
        """Give a freshly built :class:`~hetpipe.stage.params.StageModel` its saved optimizer state and
        local buffers: its own part's when the plan is the same, else per parameter from the stages of
        VW ``vw % num_old_vws`` of the checkpoint."""
        ck = self.checkpoint
        if self.same_plan:
            sources = [ck.stage_part(vw, stage)]
        else:
            old = vw % len(self.checkpoint.manifest["plan"]["virtual_workers"])
            sources = [(p, ck.tensors[r]) for r, p in ck.parts.items() if p["role"] == "stage" and p["vw"] == old]
        groups = [g for p, _ in sources for g in p["optimizer"]["groups"]]
        scalars = {k: v for p, _ in sources for k, v in p["optimizer"]["scalars"].items()}
        tensors = {k: v for _, t in sources for k, v in t.items()}
        by_model = all(p["optimizer"].get("keyed") == KEYED_BY_MODEL for p, _ in sources)
        keys = model.param_names if by_model else legacy_keys(model, layout)
        restore_optimizer(model.optimizer, model.params, keys, groups, scalars, tensors)
        saved = next((p["lr_scheduler"] for p, _ in sources if "lr_scheduler" in p), None)
        if model.scheduler is not None and saved is not None:
            restore_scheduler(model.scheduler, saved)
        with torch.no_grad():
            for name, buf in local_buffers(model, layout).items():
                saved = tensors.get(f"buf/{name}")
                if saved is not None:
                    buf.copy_(saved.to(buf.device, buf.dtype))


    def loss_scale(self, vw: int, stage: int) -> Optional[Dict[str, Any]]:
        """The saved fp16 loss scale of VW ``vw`` (its own stage's with the same plan, else VW
        ``vw % num_old_vws``'s: every stage of a VW holds the same), None if the checkpoint has none."""
        if self.same_plan:
            return self.checkpoint.stage_part(vw, stage)[0].get("loss_scale")
        old = vw % len(self.checkpoint.manifest["plan"]["virtual_workers"])
        return next((p["loss_scale"] for p in self.checkpoint.parts.values()
                     if p["role"] == "stage" and p["vw"] == old and "loss_scale" in p), None)


def legacy_keys(model, layout) -> List[str]:
    """The keys a checkpoint written before the optimizer state was keyed by the model's own names gave
    the stage's parameters (in flat order): the ``layer.name`` (a replica: its owner's) of the flat
    parameter whose position equals the parameter's position in the optimizer's groups, as that writer
    numbered them. Exact for the checkpoint's own plan; another plan gets each parameter its saved state
    only when the groups list the parameters in flat order (one group)."""
    flat = [f"{l}.{n}" for l in range(model.start, model.stop) for n, _ in layout.owned[l]] + \
        [f"{o}.{n}" for o, n in model.replica_keys]
    if model.optimizer is None:
        return flat
    position = {id(p): j for j, p in enumerate(p for g in model.optimizer.param_groups for p in g["params"])}
    return [flat[position.get(id(p), i)] for i, p in enumerate(model.params)]
