"""ClockTable cost per operation: lock-free table vs. a std::mutex-protected baseline, 1 to 8 threads.

Both loops run in C++ threads (hetpipe_core.bench.clock_bench / mutex_clock_bench), so the figures are the
table's, not the interpreter's. ns/op is per thread (wall time x threads / operations); Mops/s is the
aggregate rate. wait_check is a wait_until whose bound already holds (the common, non-blocking case).

    .venv/bin/python bench/core_clock.py
"""

import os

import hetpipe_core
from hetpipe_core.bench import clock_bench, mutex_clock_bench

OPS = ("advance", "clock", "global_clock", "wait_check")
NUM_VWS = 8


def measure(op: str, threads: int, ops: int, repeat: int = 3):
    best_table = min(clock_bench(hetpipe_core.ClockTable(NUM_VWS), op, threads, ops) for _ in range(repeat))
    best_mutex = min(mutex_clock_bench(NUM_VWS, op, threads, ops) for _ in range(repeat))
    return best_table, best_mutex


def main() -> None:
    print(f"ClockTable ({NUM_VWS} VWs), {os.cpu_count()} CPU cores; threads > cores are oversubscribed")
    header = f"{'op':<13}{'threads':>8}{'table ns/op':>13}{'mutex ns/op':>13}{'table Mops/s':>14}{'mutex Mops/s':>14}{'speedup':>9}"
    print(header)
    print("-" * len(header))
    for op in OPS:
        for threads in (1, 2, 4, 8):
            ops = 4_000_000 if threads == 1 else 2_000_000
            t, m = measure(op, threads, ops)
            print(f"{op:<13}{threads:>8}{t * 1e9 * threads / ops:>13.1f}{m * 1e9 * threads / ops:>13.1f}"
                  f"{ops / t / 1e6:>14.1f}{ops / m / 1e6:>14.1f}{m / t:>8.1f}x")


if __name__ == "__main__":
    main()
