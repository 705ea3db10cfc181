"""apply_delta throughput (GB/s) beside numpy's `a += np.float32(s) * b` on the same buffers.

Traffic counted as 3 x 4 bytes per element (read shard, read delta, write shard) for both; numpy also
writes and reads a temporary for s*b, which is part of its cost. Each figure is the best of 5 runs.
Results are checked bitwise against numpy before timing.

    .venv/bin/python bench/core_apply.py
"""

import os
import time

import numpy as np

import hetpipe_core

MIB = 1 << 20
SIZES_MIB = (1, 4, 16, 64, 256)


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    cores = os.cpu_count() or 1
    all_threads = hetpipe_core.shard_threads(0, 1 << 30)
    thread_counts = sorted({1, 2, all_threads})
    scale = np.float32(-0.01)
    print(f"apply_delta vs numpy, float32, {cores} CPU cores (all = {all_threads} threads)")
    cols = "".join(f"{'hetpipe t=' + str(t):>15}" for t in thread_counts)
    header = f"{'shard MiB':>10}{'numpy GB/s':>12}{cols}{'best/numpy':>12}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for mib in SIZES_MIB:
        n = mib * MIB // 4
        a = rng.standard_normal(n).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        check, ref = a.copy(), a.copy()
        ref += scale * b
        hetpipe_core.apply_delta(check, b, float(scale), 0)
        assert np.array_equal(check.view(np.uint32), ref.view(np.uint32))
        traffic = 3 * 4 * n / 1e9

        def numpy_op():
            a.__iadd__(scale * b)

        gbs_numpy = traffic / best(numpy_op)
        rates = []
        for t in thread_counts:
            rates.append(traffic / best(lambda: hetpipe_core.apply_delta(a, b, float(scale), t)))
        cells = "".join(f"{r:>15.1f}" for r in rates)
        print(f"{mib:>10}{gbs_numpy:>12.1f}{cells}{max(rates) / gbs_numpy:>11.1f}x")


if __name__ == "__main__":
    main()
