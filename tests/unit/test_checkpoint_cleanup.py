"""Checkpoints removed, and written, at the right moments: ranks collecting old clocks while their peers
still write (the SIGTERM path), the incomplete checkpoints a SIGKILL leaves, and the final checkpoint
of a run whose last clock was not due."""

import json

import pytest
import torch

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
from hetpipe.run.checkpoints import RunCheckpoints


def _manifest(parts, run_id="a"):
    return lambda c: {"format": ckfmt.FORMAT, "run_id": run_id, "clock": c, "plan": {},
                      "parts": [ckfmt.part_name(r) for r in range(parts)]}


def _capture(clock, rank):
    return lambda: ({"w/0": torch.full((64,), float(10 * clock + rank))}, {"role": "ps", "applied": clock})


def test_a_rank_collecting_while_its_peer_writes_on_sigterm_removes_nothing_the_peer_writes(tmp_path):
    """Two ranks keep the last 3 boundaries (1, 2, 3); clock 2 was due and is complete. On SIGTERM
    rank 0 handles the signal (writes what it holds, collects) in the middle of rank 1's first SIGTERM
    write, right after rank 1 made that clock's directory. Before, rank 1 wrote clock 1 (older than
    the complete clock 2), rank 0 removed clock 1's directory under it, and rank 1's write failed with
    FileNotFoundError: its part of clock 3, the last checkpoint, was never written."""
    manifests = {r: _manifest(2) for r in (0, 1)}
    writers = [ckpt.Checkpointer(tmp_path, 2, r, lambda c, r=r: manifests[r](c), keep=3, run_id="a")
               for r in (0, 1)]
    for clock in (1, 2, 3):
        for r, w in enumerate(writers):
            w.boundary(clock, _capture(clock, r))
    for w in writers:                      # clock 2 on disk from both writer threads
        w.close()
    assert [p.name for p in ckfmt.complete_clocks(tmp_path)] == ["clock-000002"]
    interleaved = []

    def rank1_manifest(clock):
        if not interleaved:
            assert ckfmt.clock_dir(tmp_path, clock).is_dir()       # rank 1 made the directory it writes
            interleaved.append(clock)
            writers[0].on_signal(0.0)                               # rank 0's whole SIGTERM path, now
        return _manifest(2)(clock)

    manifests[1] = rank1_manifest
    writers[1].on_signal(5.0)
    assert interleaved == [3], "rank 1 wrote a clock older than the complete one"
    assert writers[0].written == [2, 3] and writers[1].written == [2, 3]
    writers[0].on_signal(0.0)           # rank 0 collects again once clock 3 is complete (its wait would)
    found = ckpt.Checkpoint.find(tmp_path)
    assert found.clock == 3 and float(found.tensors[1]["w/0"][0]) == 31.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clock-000003"]


def test_collecting_keeps_what_a_peer_holds_and_removes_a_directory_once_empty(tmp_path):
    """Rank 0 collects while clock 1 (old) still holds rank 1's part and rank 1's part of clock 3 (the
    newest, incomplete) is half written: rank 0 removes only its own old part and leaves both
    directories; rank 1's collect then removes the rest of clock 1, directory and all."""
    w0 = ckpt.Checkpointer(tmp_path, 1, 0, _manifest(2), keep=0, run_id="a")
    w1 = ckpt.Checkpointer(tmp_path, 1, 1, _manifest(2), keep=0, run_id="a")
    for clock in (1, 2):
        w0._write(clock, _capture(clock, 0)())
        w1._write(clock, _capture(clock, 1)())
    w1._write(3, _capture(3, 1)())
    (ckfmt.clock_dir(tmp_path, 3) / "rank-00001.json").unlink()         # rank 1 mid-write of clock 3
    w0._collect()
    assert sorted(f.name for f in ckfmt.clock_dir(tmp_path, 1).iterdir()) == [
        "manifest.json", "rank-00001.json", "rank-00001.safetensors"]
    assert (ckfmt.clock_dir(tmp_path, 3) / "rank-00001.safetensors").exists()
    w1._collect()
    assert not ckfmt.clock_dir(tmp_path, 1).exists()
    w1._collect()                                                       # nothing left to remove: no error
    for w in (w0, w1):
        w.close()
    assert [p.name for p in ckfmt.complete_clocks(tmp_path)] == ["clock-000002"]


def _by_hand(directory, clock, run_id, parts_written, parts=2, manifest=True):
    """A checkpoint directory as a SIGKILL mid-write leaves it: the manifest (or not), some parts."""
    path = ckfmt.clock_dir(directory, clock)
    path.mkdir(parents=True)
    if manifest:
        (path / "manifest.json").write_text(json.dumps(_manifest(parts, run_id)(clock)))
    else:
        (path / ".manifest.json.4242.tmp").write_text("{")
    for r in parts_written:
        (path / f"{ckfmt.part_name(r)}.safetensors").write_bytes(b"\0" * 8)
    return path


def _settings(directory, run_id):
    run = RunCheckpoints([], None, 1, 0, 0, {}, directory, 1, None, False)
    run.run_id = run_id
    return run


def test_start_up_removes_the_incomplete_checkpoints_a_killed_run_left(tmp_path, capfd):
    """Run "a" was SIGKILLed mid-write twice (clocks 2 and 3 incomplete, 3 before its manifest was
    written); its checkpoint at clock 4 is complete. Resuming from 4 removes both leftovers and says
    so; a directory with no manifest newer than the newest complete checkpoint, and another run's
    incomplete checkpoint, may belong to a live run: they stay."""
    w = [ckpt.Checkpointer(tmp_path, 4, r, _manifest(2), keep=0, run_id="a") for r in (0, 1)]
    for r in (0, 1):
        w[r].boundary(4, _capture(4, r))
        w[r].close()
    _by_hand(tmp_path, 2, "a", [0])
    _by_hand(tmp_path, 3, None, [1], manifest=False)
    _by_hand(tmp_path, 6, None, [0], manifest=False)
    _by_hand(tmp_path, 1, "b", [0])
    _settings(tmp_path, "a").discard_newer(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clock-000001", "clock-000004", "clock-000006"]
    err = capfd.readouterr().err
    assert err == (f"hetpipe: removed 2 incomplete checkpoint(s) that a run which ended mid-write left in {tmp_path}: "
                   "clock-000002, clock-000003\n")
    assert ckpt.Checkpoint.find(tmp_path).clock == 4


def test_a_directory_without_leftovers_is_left_alone_silently(tmp_path, capfd):
    w = ckpt.Checkpointer(tmp_path, 1, 0, _manifest(1), keep=0, run_id="a")
    w.boundary(1, _capture(1, 0))
    w.close()
    _settings(tmp_path, "a").discard_newer(1)
    assert capfd.readouterr().err == "" and ckfmt.latest(tmp_path) == ckfmt.clock_dir(tmp_path, 1)


@pytest.mark.parametrize("keep", [0, 3])
def test_closing_at_the_end_writes_the_last_clock_when_it_was_not_due(tmp_path, keep):
    """Checkpoints every 2 waves, the run ends at clock 5: ``close(final=True)`` writes clock 5 on every
    rank (from the kept snapshot, or captured at the end with keep = 0) and then removes clock 4."""
    writers = [ckpt.Checkpointer(tmp_path, 2, r, _manifest(2), keep=keep, run_id="a") for r in (0, 1)]
    for clock in range(1, 6):
        for r, w in enumerate(writers):
            w.boundary(clock, _capture(clock, r))
    for w in writers:                      # clock 4 on disk from both writer threads
        w.flush()
    writers[0].close(final=True, wait_s=0.0)
    assert not ckfmt.is_complete(ckfmt.clock_dir(tmp_path, 5))
    writers[1].close(final=True, wait_s=60.0)
    found = ckpt.Checkpoint.find(tmp_path)
    assert found.clock == 5 and [float(found.tensors[r]["w/0"][0]) for r in (0, 1)] == [50.0, 51.0]
    assert writers[0].written == [2, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clock-000004", "clock-000005"]   # rank 1 collected
    writers[0]._collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clock-000005"]


def test_closing_without_final_writes_nothing_more(tmp_path):
    w = ckpt.Checkpointer(tmp_path, 2, 0, _manifest(1), keep=0, run_id="a")
    for clock in (1, 2, 3):
        w.boundary(clock, _capture(clock, 0))
    w.close()
    assert w.written == [2] and ckfmt.latest(tmp_path) == ckfmt.clock_dir(tmp_path, 2)



class _Interleaved(dict):
    """A part's tensors that run ``then`` once when the writer starts reading them: the moment the writing
    rank has made the clock's directory and its manifest, and not yet any file of its part."""

    def __init__(self, tensors, then):
        super().__init__(tensors)
        self.then = then

    def items(self):
        then, self.then = self.then, None
        if then is not None:
            then()
        return super().items()


def test_a_rank_writing_an_older_clock_while_a_newer_one_completes_keeps_its_directory(tmp_path):
    """The SIGTERM race a fault campaign found: rank 1 holds clocks 2..4 (4 due: on disk from its writer
    thread) and on SIGTERM writes clock 3, the newest it shared with rank 0 so far. Just as rank 1 has
    made clock 3's directory and manifest, rank 0 reaches clock 4, writes it (4 is complete, 3 obsolete)
    and collects. Before, rank 0 removed clock 3's manifest and directory (no part in it yet) under rank
    1, whose write then failed with FileNotFoundError: an error, not a SIGTERM, so no restart followed.
    Now rank 1's marker keeps the directory; its part of 3 is written, and removed by its own collect."""
    writers = [ckpt.Checkpointer(tmp_path, 2, r, _manifest(2), keep=3, run_id="a") for r in (0, 1)]
    seen = []

    def rank0_reaches_4():
        path = ckfmt.clock_dir(tmp_path, 3)
        seen.append(sorted(f.name for f in path.iterdir() if not f.name.startswith(".")))
        writers[0].boundary(4, _capture(4, 0))
        writers[0].close()                              # on disk, and collected: 4 complete, 3 obsolete
        assert ckfmt.is_complete(ckfmt.clock_dir(tmp_path, 4))

    for clock in (1, 2, 3, 4):
        tensors, part = _capture(clock, 1)()
        snapshot = (_Interleaved(tensors, rank0_reaches_4) if clock == 3 else tensors, part)
        writers[1].boundary(clock, lambda s=snapshot: s)
    for clock in (1, 2, 3):
        writers[0].boundary(clock, _capture(clock, 0))
    writers[1].close()
    writers[0].flush()                                  # rank 0's part of clock 2 on disk from its writer thread
    assert [p.name for p in ckfmt.complete_clocks(tmp_path)] == ["clock-000002"]
    writers[1].on_signal(5.0)
    assert seen == [["manifest.json"]] and writers[1].written == [2, 4, 3]
    found = ckpt.Checkpoint.find(tmp_path)
    assert found.clock == 4 and [float(found.tensors[r]["w/0"][0]) for r in (0, 1)] == [40.0, 41.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clock-000004"]
