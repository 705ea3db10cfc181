"""CPU streams and events: the same ordering and event semantics as CUDA, on worker threads."""

import threading
import time

import numpy as np
import pytest

from hetpipe_core import Event, Stream, copy_async

from stream_cases import CASES


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_cpu_semantics(case):
    case(lambda: Stream(-1))


def test_cpu_stream_properties():
    s = Stream()
    assert not s.is_cuda and s.handle == 0 and s.device == -1
    s.close()


def test_no_device_falls_back_to_cpu(monkeypatch):
    import hetpipe_core

    if hetpipe_core.build_info()["cuda_available"]:
        pytest.skip("a device is present: Stream(0) is a CUDA stream")
    s = Stream(0)
    assert not s.is_cuda and s.handle == 0
    s.close()


def test_synchronize_releases_the_gil():
    s = Stream()
    s.enqueue_sleep(0.3)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    th = threading.Thread(target=ticker)
    th.start()
    s.synchronize()
    stop.set()
    th.join()
    assert len(ticks) > 5
    s.close()


def test_copy_async_checks_buffer_sizes():
    s = Stream()
    a, b = np.zeros(10, np.uint8), np.zeros(20, np.uint8)
    with pytest.raises(ValueError, match="dst holds 10 bytes, fewer than nbytes=20"):
        copy_async(a, b, 20, s)
    with pytest.raises(TypeError, match=r"src \(the source\) must be an int address, an object with the buffer protocol or a DLPack array"):
        copy_async(a, "x", 1, s)
    copy_async(b, np.arange(20, dtype=np.uint8), 20, s)
    s.synchronize()
    assert list(b) == list(range(20))
    s.close()


def test_event_rerecord_and_outlive_stream():
    s = Stream()
    e = Event()
    s.enqueue_sleep(0.05)
    e.record(s)
    e.record(s)
    s.close()
    del s
    assert e.query()
    e.synchronize()


def test_context_manager_closes():
    with Stream() as s:
        s.enqueue_sleep(0.01)
    assert s.closed
