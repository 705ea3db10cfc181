"""One PS shard's data plane: applied bytes/s of the core's ShardPlane beside the host's memcpy
bandwidth and today's Python shard (hetpipe.runtime.ps.ShardState), in the same run.

Workload: a shard of SHARD_MIB MiB in 4 layers, 2 VWs x 2 stages (each stage holds 2 layers), D = 1,
WAVES waves. "Applied bytes" are the delta bytes that reached the weights (every pushed byte, once).
- ShardPlane: one Python thread per stage pulls wave w (waits for w - D applied waves) and pushes its
  wave-w delta; push and pull run in C++ without the GIL, so the four stages overlap.
- Python shard: ShardState.push / snapshot_into for the same pushes and pulls, from one thread (the
  shard rank's main thread, as the runtime drives it today).
- memcpy: np.copyto of the shard's size (one thread) and hetpipe_core.snapshot (all threads).
No transport: both shards are fed in-process, so the figures are the data plane alone. Devices: host
CPU only (no GPU involved). Each figure is the best of REPEAT runs.
Memory traffic per applied byte, both shards: the pull's copy of W (2 bytes), the push's copy into a
pending buffer (2) and apply_delta (3: read W, read delta, write W) = 7 bytes, against memcpy's 2. So
when memory bandwidth is the limit and thread counts are equal, applied/memcpy cannot exceed 2/7.

    .venv/bin/python bench/ps_shard.py [--shard-mib 32] [--waves 24]
"""

import argparse
import os
import threading
import time

import numpy as np

import hetpipe_core
from hetpipe.runtime.ps import ShardState

MIB = 1 << 20
REPEAT = 3
CUTS = [[(0, 2), (2, 4)], [(0, 2), (2, 4)]]   # per VW: the stages' layer ranges; the shard owns layers 0..3
D = 1


def deltas(layer_numel: int, waves: int):
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal(2 * layer_numel).astype(np.float32) * 1e-3 for _ in range(4)]
    return {(vw, s, w): pool[(vw + s + w) % 4] for vw in range(2) for s in range(2) for w in range(waves)}


def run_plane(layer_numel: int, waves: int, d: dict) -> float:
    plane = hetpipe_core.ShardPlane([layer_numel] * 4, [[[0, 1], [2, 3]], [[0, 1], [2, 3]]], D, 0)

    def stage(vw: int, s: int) -> None:
        out = np.empty(2 * layer_numel, np.float32)
        for w in range(waves):
            plane.pull(vw, s, w, out, timeout=60)
            plane.push(vw, s, w, d[(vw, s, w)])

    threads = [threading.Thread(target=stage, args=(vw, s)) for vw in range(2) for s in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert plane.applied == waves
    return elapsed


def run_python(layer_numel: int, waves: int, d: dict) -> float:
    init = {l: np.zeros(layer_numel, np.float32) for l in range(4)}
    state = ShardState(0, init, CUTS, D)
    out = np.empty(2 * layer_numel, np.float32)
    start = time.perf_counter()
    for w in range(waves):
        for vw in range(2):
            for s in range(2):
                state.snapshot_into(vw, s, out)
                state.push(vw, s, w, d[(vw, s, w)])
    elapsed = time.perf_counter() - start
    assert state.applied >= waves - 1
    return elapsed


def best(fn) -> float:
    return min(fn() for _ in range(REPEAT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard-mib", type=int, default=32)
    ap.add_argument("--waves", type=int, default=24)
    args = ap.parse_args()
    layer_numel = args.shard_mib * MIB // 16
    d = deltas(layer_numel, args.waves)
    pushed = 4 * 2 * layer_numel * 4 * args.waves            # VWs*stages x 2 layers x 4 B x waves
    src = np.ones(args.shard_mib * MIB // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    memcpy_1 = src.nbytes / best(lambda: _timed(lambda: np.copyto(dst, src)))
    memcpy_all = src.nbytes / best(lambda: _timed(lambda: hetpipe_core.snapshot(src, dst)))
    memcpy = max(memcpy_1, memcpy_all)
    plane = pushed / best(lambda: run_plane(layer_numel, args.waves, d))
    python = pushed / best(lambda: run_python(layer_numel, args.waves, d))
    print(f"PS shard data plane, {args.shard_mib} MiB shard, 2 VWs x 2 stages, D = {D}, {args.waves} waves; "
          f"{os.cpu_count()} CPU cores; host only (no transport, no GPU); best of {REPEAT}")
    header = f"{'what':<34}{'GB/s':>8}{'vs memcpy':>11}{'vs Python shard':>17}"
    print(header)
    print("-" * len(header))
    rows = [("memcpy, np.copyto (1 thread)", memcpy_1), ("memcpy, core snapshot (all threads)", memcpy_all),
            ("Python shard (ShardState), applied", python), ("core ShardPlane, applied", plane)]
    for name, rate in rows:
        print(f"{name:<34}{rate / 1e9:>8.2f}{rate / memcpy:>10.0%}{rate / python:>16.1f}x")
    print(f"goal: ShardPlane >= 70% of memcpy -> {'met' if plane >= 0.7 * memcpy else 'not met'} "
          f"({plane / memcpy:.0%}; memory traffic 7 B per applied byte: {7 * plane / memcpy:.0%} of the "
          f"copy rate as bytes moved)")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
