"""apply_delta / snapshot: bitwise equal to numpy for every size, scale and thread count; clear errors."""

import threading
import time

import numpy as np
import pytest

import hetpipe_core
from hetpipe_core import apply_delta, snapshot

SIZES = [0, 1, 3, 15, 16, 17, 1000, 65_537, 300_001, 1 << 20]
SCALES = [1.0, -1.0, 0.1, -0.37, 3e-5, 1e30]


def _pair(n, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = (rng.standard_normal(n) * 10).astype(np.float32)
    return a, b


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 2, 3, 0])
def test_matches_numpy_bitwise(n, threads):
    for k, scale in enumerate(SCALES):
        a, b = _pair(n, n * 31 + k)
        expected = a.copy()
        expected += np.float32(scale) * b
        apply_delta(a, b, scale, threads)
        assert np.array_equal(a.view(np.uint32), expected.view(np.uint32)), (n, threads, scale)


def test_default_scale_and_multidimensional():
    a, b = _pair(6 * 7, 1)
    a, b = a.reshape(6, 7), b.reshape(6, 7)
    expected = a + b
    apply_delta(a, b)
    assert np.array_equal(a, expected)


def test_same_buffer():
    a, _ = _pair(1001, 2)
    expected = a.copy()
    expected += np.float32(0.5) * expected.copy()
    apply_delta(a, a, 0.5)
    assert np.array_equal(a.view(np.uint32), expected.view(np.uint32))


def test_thread_count_resolution():
    assert hetpipe_core.shard_threads(8, 10) == 1  # small shards stay on the caller's thread
    assert hetpipe_core.shard_threads(4, 1 << 20) == 4
    assert 1 <= hetpipe_core.shard_threads(0, 1 << 24) <= 16


def test_errors_name_sizes_and_types():
    a = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="shard has 10 elements but delta has 12"):
        apply_delta(a, np.zeros(12, np.float32))
    with pytest.raises(TypeError, match="delta must be float32, got format 'd'"):
        apply_delta(a, np.zeros(10, np.float64))
    with pytest.raises(TypeError, match="shard must be float32"):
        apply_delta(np.zeros(10, np.int32), np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="delta must be C-contiguous"):
        apply_delta(a, np.zeros(20, np.float32)[::2])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(10, np.float32)
        ro.flags.writeable = False
        apply_delta(ro, a)
    big = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        apply_delta(big[:10], big[5:15])
    with pytest.raises(ValueError, match="shard has 10 elements but out has 9"):
        snapshot(a, np.zeros(9, np.float32))


@pytest.mark.parametrize("n", [0, 5, 70_000, 1 << 20])
def test_snapshot(n):
    a, _ = _pair(n, 3)
    out = np.empty_like(a)
    assert snapshot(a, out) is out
    assert np.array_equal(out, a)
    fresh = snapshot(a.reshape(-1, 1) if n else a)
    assert fresh.dtype == np.float32 and np.array_equal(fresh.reshape(-1), a)
    assert fresh.ctypes.data != a.ctypes.data


def test_snapshot_into_pool_slot():
    pool = hetpipe_core.PinnedBufferPool(1, 4 * 100)
    slot = pool.acquire()
    a, _ = _pair(100, 4)
    snapshot(a, np.frombuffer(slot, dtype=np.float32))
    assert np.array_equal(slot.numpy("float32"), a)


def test_apply_releases_the_gil():
    a, b = _pair(1 << 22, 5)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.01)
    before = len(ticks)
    for _ in range(20):
        apply_delta(a, b, 1e-3, 1)
    done.set()
    th.join()
    assert len(ticks) > before + 2


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 3, 0])
def test_accumulate_change_matches_numpy_bitwise(n, threads):
    rng = np.random.default_rng(n + 7)
    # Magnitudes far apart, so that (after - before) and the sum round differently from a fused form.
    delta = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    before = (rng.standard_normal(n) * 1e4).astype(np.float32)
    after = before + (rng.standard_normal(n) * 1e-2).astype(np.float32)
    expected = delta.copy()
    expected += after - before
    hetpipe_core.accumulate_change(delta, after, before, threads)
    assert np.array_equal(delta.view(np.uint32), expected.view(np.uint32)), (n, threads)


def test_accumulate_change_rejects_bad_buffers():
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="delta overlaps after or before"):
        hetpipe_core.accumulate_change(a, a, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="delta has 8 elements, after 7, before 8"):
        hetpipe_core.accumulate_change(a, np.zeros(7, np.float32), np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="accumulate_change: before must be float32"):
        hetpipe_core.accumulate_change(a, np.zeros(8, np.float32), np.zeros(8, np.float64))
    # after and before may be one buffer (both are only read): the change is zero.
    before = np.arange(8, dtype=np.float32)
    hetpipe_core.accumulate_change(a, before, before)
    assert not a.any()
