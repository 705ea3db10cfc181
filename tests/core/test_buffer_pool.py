"""PinnedBufferPool: zero-copy export, lifetime, lock-free concurrency and every error path."""

import gc
import threading
import time

import numpy as np
import pytest

import hetpipe_core
from hetpipe_core import PinnedBufferPool


def test_properties_and_alignment():
    pool = PinnedBufferPool(5, 1000)
    assert pool.num_slots == 5 and pool.slot_bytes == 1000
    assert pool.pinned is False and pool.device == -1     # device=-1 (the default): host memory, no CUDA
    slots = [pool.acquire() for _ in range(5)]
    assert pool.available() == 0
    assert sorted(s.index for s in slots) == list(range(5))
    for s in slots:
        assert s.ptr % 256 == 0
        assert s.nbytes == 1000
        assert s.pool is pool or s.pool.num_slots == 5
    ptrs = sorted(s.ptr for s in slots)
    assert all(b - a >= 1000 for a, b in zip(ptrs, ptrs[1:]))
    for s in slots:
        pool.release(s)
    assert pool.available() == 5


def test_device_argument():
    info = hetpipe_core.build_info()
    pinned = PinnedBufferPool(2, 64, 0)
    # Page-locked through device 0 when there is one; ordinary memory (as device=-1) without CUDA.
    assert pinned.pinned == info["cuda_available"]
    assert pinned.device == (0 if info["cuda_available"] else -1)
    assert "device=" in repr(pinned)
    with pytest.raises(ValueError, match="device -2"):
        PinnedBufferPool(2, 64, -2)
    if info["cuda_available"]:
        with pytest.raises(ValueError, match=f"device {info['cuda_device_count']} out of range"):
            PinnedBufferPool(2, 64, info["cuda_device_count"])


def test_pin_error_says_why_a_pool_is_not_pinned():
    info = hetpipe_core.build_info()
    assert PinnedBufferPool(1, 64).pin_error == "host memory was asked for (device -1)"
    asked = PinnedBufferPool(1, 64, 0)
    if info["cuda_available"]:
        assert asked.pinned and asked.pin_error == ""
    elif not info["cuda_built"]:
        assert asked.pin_error == "hetpipe_core was built without CUDA"
    else:
        assert asked.pin_error.startswith("no usable CUDA device")


def test_size_classes_take_the_smallest_free_slot_that_fits():
    pool = PinnedBufferPool.of_classes([(2, 100_000), (3, 1000)])
    assert pool.classes == [(3, 1000), (2, 100_000)]            # smallest slots first
    assert pool.num_slots == 5 and pool.slot_bytes == 100_000
    assert pool.total_bytes == 3 * 1024 + 2 * 100_096           # each slot rounded up to 256 bytes
    assert "classes=[(3, 1000), (2, 100000)]" in repr(pool)
    large = pool.acquire(5000)
    assert large.nbytes == 100_000 and large.ptr % 256 == 0
    small = [pool.acquire(10) for _ in range(3)]
    assert [s.nbytes for s in small] == [1000] * 3
    assert pool.acquire(10).nbytes == 100_000                   # the small class is in use: a large slot
    assert pool.available() == 0
    with pytest.raises(TimeoutError, match=r"all 3 slots of 1000 bytes and 2 of 100000 bytes"):
        pool.acquire(10, timeout=0)
    with pytest.raises(ValueError, match=r"requested 100001 bytes but a slot holds 100000 bytes"):
        pool.acquire(100_001)
    ptrs = sorted((s.ptr, s.nbytes) for s in small + [large])
    assert all(a + n <= b for (a, n), (b, _) in zip(ptrs, ptrs[1:]))     # no two slots overlap
    for s in small:
        s.numpy("uint8")[:] = s.index
        assert np.frombuffer(s, dtype=np.uint8).shape == (1000,)
    assert [int(s.numpy("uint8")[-1]) for s in small] == [s.index for s in small]
    pool.release(small[0])
    with pytest.raises(TimeoutError):
        pool.acquire(5000, timeout=0)                           # a freed small slot does not hold 5000
    assert pool.acquire(10, timeout=0).index == small[0].index


def test_size_classes_of_one_size_merge_and_bad_classes_are_refused():
    assert PinnedBufferPool.of_classes([(1, 64), (2, 64)]).classes == [(3, 64)]
    with pytest.raises(ValueError, match="at least one size class"):
        PinnedBufferPool.of_classes([])
    with pytest.raises(ValueError, match="0 slots of 64 bytes"):
        PinnedBufferPool.of_classes([(2, 128), (0, 64)])


def test_blocked_acquire_of_a_large_slot_wakes_on_its_release():
    pool = PinnedBufferPool.of_classes([(1, 64), (1, 4096)])
    large = pool.acquire(4096)
    got = []
    th = threading.Thread(target=lambda: got.append(pool.acquire(4096, timeout=3600)))
    th.start()
    time.sleep(0.1)
    assert not got and pool.available() == 1                    # the free small slot does not serve it
    pool.release(large)
    th.join(60)
    assert got and got[0].nbytes == 4096


def test_zero_copy_torch_numpy_buffer():
    torch = pytest.importorskip("torch")
    pool = PinnedBufferPool(2, 4096)
    slot = pool.acquire(1024)
    t = torch.from_dlpack(slot)
    a = np.from_dlpack(slot)
    b = np.frombuffer(slot, dtype=np.uint8)
    f = slot.numpy("float32")
    assert t.dtype == torch.uint8 and t.shape == (4096,)
    assert t.data_ptr() == a.ctypes.data == b.ctypes.data == f.ctypes.data == slot.ptr
    assert f.shape == (1024,) and f.flags.writeable
    t[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert list(a[:4]) == [1, 2, 3, 4] and list(b[:4]) == [1, 2, 3, 4]
    f[1] = 2.5
    assert torch.from_dlpack(slot)[4:8].view(torch.float32).item() == 2.5
    memoryview(slot)[100] = 77
    assert t[100].item() == 77 and a[100] == 77
    assert slot.__dlpack_device__() == (1, 0)


def test_legacy_and_versioned_capsules():
    pool = PinnedBufferPool(1, 64)
    slot = pool.acquire()
    legacy = slot.__dlpack__()
    versioned = slot.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "dltensor_versioned" in repr(versioned)
    del legacy, versioned  # unconsumed capsules free their export
    gc.collect()
    with pytest.raises(BufferError, match="copy=True"):
        slot.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="kDLCPU"):
        slot.__dlpack__(dl_device=(2, 0))


def test_view_outlives_pool_handle():
    torch = pytest.importorskip("torch")
    pool = PinnedBufferPool(2, 256)
    slot = pool.acquire()
    t = torch.from_dlpack(slot)
    a = np.frombuffer(slot, dtype=np.uint8)
    n = slot.numpy("int32")
    t.fill_(5)
    del pool, slot
    gc.collect()
    assert int(a.sum()) == 5 * 256
    a[:] = 9
    assert int(t.sum()) == 9 * 256
    n[0] = -1
    assert t[:4].tolist() == [255, 255, 255, 255]


def test_dlpack_capsule_alone_keeps_memory():
    torch = pytest.importorskip("torch")
    pool = PinnedBufferPool(1, 128)
    t = torch.from_dlpack(pool.acquire())
    del pool
    gc.collect()
    t.fill_(3)
    assert int(t.sum()) == 3 * 128


def test_exhaustion_timeout_names_pool_size():
    pool = PinnedBufferPool(3, 512)
    held = [pool.acquire() for _ in range(3)]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"all 3 slots of 512 bytes"):
        pool.acquire(timeout=0.1)
    assert time.monotonic() - start >= 0.09       # it waited (a lower bound: no load can break it)
    with pytest.raises(TimeoutError, match="3 slots"):
        pool.acquire(timeout=0)
    pool.release(held[0])
    assert pool.acquire(timeout=0).index == held[0].index


def test_blocking_acquire_wakes_on_release():
    pool = PinnedBufferPool(1, 64)
    slot = pool.acquire()
    got = []

    def waiter():
        got.append(pool.acquire(timeout=3600))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    assert not got  # blocked, and the GIL is free for this thread
    pool.release(slot)
    th.join(60)     # a hang guard: with that timeout only the release can end the wait
    assert got and got[0].index == slot.index


def test_double_release_and_stale_handle():
    pool = PinnedBufferPool(1, 64)
    first = pool.acquire()
    pool.release(first)
    with pytest.raises(ValueError, match="double release of slot 0"):
        pool.release(first)
    second = pool.acquire()  # the same index, a new acquisition
    with pytest.raises(ValueError, match="double release"):
        pool.release(first)  # the stale handle cannot release someone else's slot
    pool.release(second)


def test_foreign_slot():
    a, b = PinnedBufferPool(1, 64), PinnedBufferPool(1, 64)
    slot = a.acquire()
    with pytest.raises(ValueError, match="belongs to another pool"):
        b.release(slot)
    a.release(slot)


def test_oversize_names_both_sizes():
    pool = PinnedBufferPool(2, 1000)
    with pytest.raises(ValueError, match=r"requested 1001 bytes but a slot holds 1000 bytes"):
        pool.acquire(1001)
    assert pool.acquire(1000).nbytes == 1000


def test_bad_construction():
    with pytest.raises(ValueError, match="at least one slot"):
        PinnedBufferPool(0, 64)
    with pytest.raises(ValueError, match="0 bytes"):
        PinnedBufferPool(2, 0)


def test_close_wakes_and_refuses():
    pool = PinnedBufferPool(1, 64)
    slot = pool.acquire()
    errors = []

    def waiter():
        try:
            pool.acquire(timeout=10)
        except RuntimeError as e:
            errors.append(str(e))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    pool.close()
    th.join(5)
    assert errors == ["PinnedBufferPool is closed"]
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()
    memoryview(slot)[0] = 1  # outstanding slots stay usable
    pool.release(slot)


def test_numpy_view_bounds():
    pool = PinnedBufferPool(1, 64)
    slot = pool.acquire()
    assert slot.numpy("float64").shape == (8,)
    assert slot.numpy("uint8", 10).shape == (10,)
    with pytest.raises(ValueError, match="17 items of 4 bytes exceed the slot's 64 bytes"):
        slot.numpy("float32", 17)


def test_concurrent_acquire_release_never_shares_a_slot():
    pool = PinnedBufferPool(4, 64)
    owners = np.zeros(4, dtype=np.int64)
    errors = []
    rounds = 2000

    def worker(tid):
        try:
            for _ in range(rounds):
                s = pool.acquire(timeout=10)
                view = s.numpy("int64", 1)
                view[0] = tid
                if owners[s.index] != 0:
                    errors.append(f"slot {s.index} held twice")
                owners[s.index] = tid
                if view[0] != tid:
                    errors.append("slot memory changed under its owner")
                owners[s.index] = 0
                pool.release(s)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t + 1,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    assert pool.available() == 4
