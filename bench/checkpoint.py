"""Checkpoint cost on the training thread: asynchronous (hetpipe's Checkpointer) against writing in
place (the same safetensors + fsync + rename, synchronously), per checkpointed wave boundary.

Real files on this host's disk; no devices involved. The "wave" is a busy loop of a fixed length
standing in for a wave's compute, so that the writer thread has something to overlap with. Prints
one row per state size: ms the training thread spends per wave writing in place, asynchronously, and
asynchronously with a copy at every boundary (what SIGTERM checkpoints cost), with the ratios.

Usage: python bench/checkpoint.py [--sizes-mb 4 32 128] [--waves 16] [--wave-ms 200] [--every 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt


def _manifest(clock: int) -> dict:
    return {"format": ckfmt.FORMAT, "clock": clock, "parts": [ckfmt.part_name(0)], "plan": {}}


def _wave(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def run(size_mb: int, waves: int, wave_ms: float, every: int, root: Path) -> tuple:
    state = torch.randn(size_mb * (1 << 18))              # float32: size_mb MiB

    def capture():
        return {"w/0": state.clone()}, {"role": "ps"}

    # Synchronous: the training thread copies and writes every boundary itself.
    sync_dir = root / f"sync-{size_mb}"
    sync_dir.mkdir()
    spent = 0.0
    for clock in range(1, waves + 1):
        _wave(wave_ms)
        if clock % every:
            continue
        t = time.perf_counter()
        tensors, part = capture()
        path = ckfmt.clock_dir(sync_dir, clock)
        path.mkdir()
        ckfmt.write_json(path / ckfmt.MANIFEST, _manifest(clock))
        ckpt.write_tensors(path / "rank-00000.safetensors", tensors)
        ckfmt.write_json(path / "rank-00000.json", {**part, "rank": 0, "clock": clock})
        spent += time.perf_counter() - t
    sync_ms = 1000 * spent / waves

    out = [sync_ms]
    # keep = 0: copies at due clocks only; keep = 2: a copy at every boundary (SIGTERM checkpoints, D = 0).
    for keep in (0, 2):
        writer = ckpt.Checkpointer(root / f"async-{size_mb}-{keep}", every, 0, _manifest, keep=keep)
        spent = 0.0
        for clock in range(1, waves + 1):
            _wave(wave_ms)
            t = time.perf_counter()
            writer.boundary(clock, capture)
            spent += time.perf_counter() - t
        writer.close()
        out += [1000 * spent / waves, 1000 * writer.waited_s / waves]
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 32, 128])
    ap.add_argument("--waves", type=int, default=16)
    ap.add_argument("--wave-ms", type=float, default=200.0)
    ap.add_argument("--every", type=int, default=4, help="checkpoint every this many waves")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"checkpoint every {args.every} waves, {args.waves} waves of {args.wave_ms:g} ms compute (busy loop); "
          "real disk, no devices; training-thread ms per wave")
    print(f"{'state MiB':>9} | {'in place':>8} | {'async':>6} | {'waiting':>7} | {'ratio':>6} | "
          f"{'async + SIGTERM copies':>22} | {'waiting':>7} | {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-ckpt-") as root:
        for size in args.sizes_mb:
            sync_ms, a_ms, a_wait, s_ms, s_wait = run(size, args.waves, args.wave_ms, args.every, Path(root))
            print(f"{size:>9} | {sync_ms:>8.1f} | {a_ms:>6.1f} | {a_wait:>7.1f} | {sync_ms / max(a_ms, 1e-3):>5.1f}x | "
                  f"{s_ms:>22.1f} | {s_wait:>7.1f} | {sync_ms / max(s_ms, 1e-3):>5.1f}x")


if __name__ == "__main__":
    main()
