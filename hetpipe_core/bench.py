"""Benchmark and stress helpers of the compiled core, for bench/ and the tests; not part of
hetpipe_core's API (they may change or go without notice).

* ``clock_bench(table, op, threads, ops)``: ``threads`` C++ threads perform ``ops`` ClockTable operations
  in total (``op``: advance, clock, global_clock or wait_check); returns the wall seconds.
* ``mutex_clock_bench(num_vws, op, threads, ops)``: the same loop over counters behind one std::mutex,
  the baseline of bench/core_clock.py.
* ``clock_stress(table, threads, ops)``: ``threads`` C++ threads perform ``ops`` advances in total, spread
  over all VWs; returns the wall seconds.
"""

from hetpipe_core._C import clock_bench, clock_stress, mutex_clock_bench

__all__ = ["clock_bench", "clock_stress", "mutex_clock_bench"]
