"""The stream/event semantics of tests/core/stream_cases.py on CUDA streams, plus device copies."""

import sys
from pathlib import Path

import numpy as np
import pytest

import hetpipe_core
from hetpipe_core import Event, PinnedBufferPool, Stream, copy_async

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
from stream_cases import CASES  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_cuda_semantics(case):
    case(lambda: Stream(0))


def test_cuda_stream_and_pinned_pool():
    s = Stream(0)
    assert s.is_cuda and s.handle != 0 and s.device == 0
    assert PinnedBufferPool(1, 64, 0).pinned
    s.close()


def test_host_device_round_trip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    n = 1 << 20
    pool = PinnedBufferPool(2, n, 0)
    src, back = pool.acquire(), pool.acquire()
    src.numpy("uint8")[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    copy_stream, compute = Stream(0), Stream(0)
    copy_async(dev.data_ptr(), src, n, copy_stream)
    e = Event()
    e.record(copy_stream)
    compute.wait_for(e)
    copy_async(back, dev.data_ptr(), n, compute)
    compute.synchronize()
    assert (back.numpy("uint8") == src.numpy("uint8")).all()
    assert hetpipe_core.build_info()["cuda_device_count"] >= 1
