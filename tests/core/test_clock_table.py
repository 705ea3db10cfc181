"""ClockTable: no lost update under contention, the staleness bound, prompt wake-ups, timeouts."""

import threading
import time

import pytest

from hetpipe_core import ClockTable
from hetpipe_core.bench import clock_bench, clock_stress, mutex_clock_bench


def test_basics_and_global_minimum():
    t = ClockTable(3)
    assert t.num_vws == 3 and t.global_clock() == 0
    assert t.advance(0) == 1 and t.advance(0) == 2 and t.advance(1) == 1
    assert [t.clock(v) for v in range(3)] == [2, 1, 0]
    assert t.global_clock() == 0
    t.advance(2)
    assert t.global_clock() == 1


def test_out_of_range_names_vw_and_count():
    t = ClockTable(4)
    for call in (t.advance, t.clock, t.remove, t.active):
        with pytest.raises(IndexError, match=r"vw 4 out of range for a ClockTable of 4 virtual workers"):
            call(4)
    with pytest.raises(IndexError, match="vw -1"):
        t.clock(-1)
    with pytest.raises(ValueError, match="at least one virtual worker"):
        ClockTable(0)


def test_remove_takes_vw_out_of_minimum():
    t = ClockTable(3)
    t.advance(0)
    t.advance(1)
    assert t.global_clock() == 0
    t.remove(2)
    assert not t.active(2) and t.active(0)
    assert t.global_clock() == 1
    with pytest.raises(ValueError, match="vw 2 was removed"):
        t.advance(2)
    t.remove(0)
    t.remove(1)
    assert t.global_clock() == 1  # none active: the largest clock reached
    assert t.wait_until(100, 0, timeout=1) == 1  # nothing left to wait for


def test_contention_no_lost_update():
    t = ClockTable(5)
    ops = 1_000_000
    seconds = clock_stress(t, 8, ops)
    assert seconds > 0
    assert sum(t.clock(v) for v in range(5)) == ops
    assert t.global_clock() == min(t.clock(v) for v in range(5))
    assert max(t.clock(v) for v in range(5)) - t.global_clock() <= 1  # (t + i) % n spreads evenly


def test_waiters_never_pass_the_staleness_bound():
    n, d, waves = 4, 1, 200
    t = ClockTable(n)
    violations = []

    def waiter():
        for wave in range(waves):
            g = t.wait_until(wave, d, timeout=30)
            now = t.global_clock()
            if g < wave - d or now < wave - d:
                violations.append((wave, g, now))

    waiters = [threading.Thread(target=waiter) for _ in range(3)]
    for th in waiters:
        th.start()
    # C++ advancers race the Python waiters: 8 threads, waves * n advances in steps.
    for _ in range(waves):
        clock_stress(t, 8, n)
    for th in waiters:
        th.join(60)
    assert not violations
    assert t.global_clock() == waves


def test_wait_until_wakes_when_the_clock_reaches_its_bound():
    """The advance that completes the bound wakes the waiter, not its timeout: with a timeout the test
    never reaches, only a wake-up can end the wait."""
    t = ClockTable(2)
    woke = []

    def waiter():
        woke.append(t.wait_until(1, 0, timeout=3600))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    t.advance(0)
    th.join(0.1)
    assert not woke and th.is_alive()            # one VW at clock 1 is not yet a global clock of 1
    t.advance(1)
    th.join(60)                                   # a hang guard, not a latency bound
    assert not th.is_alive() and woke == [1]


def test_remove_wakes_waiters():
    t = ClockTable(2)
    t.advance(0)
    out = []
    th = threading.Thread(target=lambda: out.append(t.wait_until(1, 0, timeout=3600)))
    th.start()
    time.sleep(0.05)
    t.remove(1)
    th.join(60)                                   # a hang guard: only the wake-up can end the wait
    assert out == [1]


def test_timeout_fires_after_waiting_its_timeout():
    t = ClockTable(2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"wait_until\(wave=3, bound_d=1\) timed out after 0.2 s: global clock 0 < 2"):
        t.wait_until(3, 1, timeout=0.2)
    assert time.monotonic() - start >= 0.19       # it waited (a lower bound: no load can break it)
    with pytest.raises(TimeoutError):
        t.wait_until(1, 0, timeout=0)
    assert t.wait_until(1, 1, timeout=0) == 0  # already satisfied: returns without waiting


def test_bench_helpers_run():
    t = ClockTable(4)
    for op in ("advance", "clock", "global_clock", "wait_check"):
        assert clock_bench(t, op, 2, 1000) > 0
        assert mutex_clock_bench(4, op, 2, 1000) > 0
    assert t.clock(0) + t.clock(1) == 1000
    with pytest.raises(ValueError, match="unknown clock op 'bogus'"):
        clock_bench(t, "bogus", 1, 1)
