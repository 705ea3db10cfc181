"""Foreign arrays and handles on CUDA: pinned slots export kDLCUDAHost, a CUDA stream waits on another
framework's stream or event, and a DLPack producer on the device is handed the stream's handle.

The waits are checked against work torch leaves pending on its own streams (torch.cuda._sleep keeps a
stream busy for a number of GPU cycles), so a missing wait shows as stale bytes.
"""

import numpy as np
import pytest

from hetpipe_core import PinnedBufferPool, Stream, copy_async

pytestmark = pytest.mark.gpu

KDLCPU, KDLCUDA, KDLCUDAHOST = 1, 2, 3
BUSY = 200_000_000  # GPU cycles torch.cuda._sleep keeps a stream busy: about 0.1 s


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def test_pinned_slot_exports_cuda_host():
    pool = PinnedBufferPool(1, 256, 0)
    assert pool.pinned
    slot = pool.acquire()
    assert slot.__dlpack_device__() == (KDLCUDAHOST, 0)
    slot.numpy("uint8")[:] = 5
    a = np.from_dlpack(slot)  # numpy reads kDLCUDAHost as host memory
    assert a.ctypes.data == slot.ptr and (a == 5).all()
    # A consumer that does not know kDLCUDAHost asks for kDLCPU.
    cpu = slot.__dlpack__(dl_device=(KDLCPU, 0))
    assert "dltensor" in repr(cpu)
    with pytest.raises(BufferError, match="kDLCUDAHost, or kDLCPU"):
        slot.__dlpack__(dl_device=(KDLCUDA, 0))
    host = PinnedBufferPool(1, 64, -1).acquire()
    assert host.__dlpack_device__() == (KDLCPU, 0)


def test_pinned_slot_in_torch_through_kdlcpu():
    torch = pytest.importorskip("torch")
    slot = PinnedBufferPool(1, 64, 0).acquire()
    t = torch.from_dlpack(slot.__dlpack__(dl_device=(KDLCPU, 0)))
    assert t.data_ptr() == slot.ptr and t.device.type == "cpu"


def _filled_late(torch, n: int, value: int):
    """A CUDA tensor of ``n`` bytes that a side stream fills with ``value`` after a busy wait: a copy
    not ordered after that stream reads zeros. Returns (tensor, producer stream)."""
    producer = torch.cuda.Stream()
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(BUSY)
        t.fill_(value)
    return t, producer


def test_wait_external_stream():
    torch = _torch_cuda()
    n = 1 << 20
    t, producer = _filled_late(torch, n, 7)
    s = Stream(0)
    s.wait_external(producer.cuda_stream)  # the copy below waits for the fill
    slot = PinnedBufferPool(1, n, 0).acquire()
    copy_async(slot, t.data_ptr(), n, s)
    s.synchronize()
    assert (slot.numpy("uint8") == 7).all()
    s.wait_external(s.handle)  # this very stream: a no-op
    s.wait_external(0)  # the default stream of device 0
    s.synchronize()
    s.close()


def test_wait_external_event():
    torch = _torch_cuda()
    n = 1 << 20
    t, producer = _filled_late(torch, n, 9)
    done = torch.cuda.Event()
    done.record(producer)
    s = Stream(0)
    s.wait_external(done.cuda_event, kind="event")
    slot = PinnedBufferPool(1, n, 0).acquire()
    copy_async(slot, t.data_ptr(), n, s)
    s.synchronize()
    assert (slot.numpy("uint8") == 9).all()
    with pytest.raises(ValueError, match="event handle 0 is not a cudaEvent_t"):
        s.wait_external(0, kind="event")
    s.close()


def test_dlpack_producer_gets_the_stream():
    torch = _torch_cuda()
    n = 1 << 20
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY)  # on torch's current stream, before the fill
    t.fill_(3)

    class Recorder:
        def __init__(self, tensor):
            self.tensor, self.streams = tensor, []

        def __dlpack_device__(self):
            return self.tensor.__dlpack_device__()

        def __dlpack__(self, *, stream=None, **kwargs):
            self.streams.append(stream)
            return self.tensor.__dlpack__(stream=stream, **kwargs)

    s = Stream(0)
    src = Recorder(t)
    slot = PinnedBufferPool(1, n, 0).acquire()
    copy_async(slot, src, n, s)  # torch makes s wait for its current stream
    s.synchronize()
    assert src.streams == [s.handle]
    assert (slot.numpy("uint8") == 3).all()
    back = torch.zeros(n, dtype=torch.uint8, device="cuda")
    copy_async(back, slot, n, s)
    s.synchronize()
    assert int(back.sum()) == 3 * n
    s.close()


def test_device_array_refused_by_a_cpu_stream():
    torch = _torch_cuda()
    t = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with Stream(-1) as s:
        with pytest.raises(ValueError, match=r"src \(the source\) is on kDLCUDA:0, which a CPU stream cannot reach"):
            copy_async(np.zeros(16, np.uint8), t, 16, s)
        with pytest.raises(ValueError, match="a CPU stream cannot wait on CUDA stream handle"):
            s.wait_external(torch.cuda.Stream().cuda_stream)


def test_temporary_device_tensor_lives_until_the_copy_ran():
    torch = _torch_cuda()
    n = 1 << 20
    s = Stream(0)
    slot = PinnedBufferPool(1, n, 0).acquire()
    s.enqueue_sleep(0.2)
    copy_async(slot, torch.full((n,), 4, dtype=torch.uint8, device="cuda"), n, s)
    garbage = [torch.full((n,), 0xEE, dtype=torch.uint8, device="cuda") for _ in range(16)]
    s.synchronize()
    del garbage
    assert (slot.numpy("uint8") == 4).all()
    s.close()
