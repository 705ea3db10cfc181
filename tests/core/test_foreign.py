"""Foreign arrays in the core: DLPack in and out, and copies that keep their arrays alive until they ran.

DLPack is exercised through numpy's own ``__dlpack__`` behind a small exporter without the buffer
protocol (so the core must take the DLPack path), in its versioned and legacy forms.
"""

import ctypes
import gc
import sys
import weakref

import numpy as np
import pytest

from hetpipe_core import Event, PinnedBufferPool, Stream, apply_delta, copy_async, snapshot

KDLCPU, KDLCUDA, KDLCUDAHOST, KDLROCM = 1, 2, 3, 10

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _patch_device(capsule, device) -> None:
    """Rewrites the DLTensor device inside an unconsumed capsule (a producer that lies in
    __dlpack_device__, or one whose host memory is page-locked)."""
    versioned = "dltensor_versioned" in repr(capsule)
    ptr = _get_pointer(capsule, b"dltensor_versioned" if versioned else b"dltensor")
    offset = 40 if versioned else 8  # version, manager_ctx, deleter, flags, data | data
    ctypes.c_int32.from_address(ptr + offset).value = device[0]
    ctypes.c_int32.from_address(ptr + offset + 4).value = device[1]


class Exporter:
    """A DLPack exporter over a numpy array (or anything with __dlpack__), without the buffer protocol;
    records each __dlpack__ call and keeps the capsules it handed out."""

    def __init__(self, array, device=(KDLCPU, 0), tensor_device=None):
        self.array, self.device, self.tensor_device = array, device, tensor_device
        self.calls, self.capsules = [], []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        capsule = self.array.__dlpack__(max_version=max_version)
        if self.tensor_device is not None:
            _patch_device(capsule, self.tensor_device)
        self.capsules.append(capsule)
        return capsule


class LegacyExporter(Exporter):
    """A producer from before DLPack 1.0: no max_version keyword, legacy capsules only."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        capsule = self.array.__dlpack__()
        self.capsules.append(capsule)
        return capsule


def _slot(nbytes):
    pool = PinnedBufferPool(1, nbytes)
    return pool.acquire()


# --- DLPack out: a slot's device -------------------------------------------------------------------

def test_host_slot_exports_kdlcpu():
    slot = _slot(64)
    assert slot.__dlpack_device__() == (KDLCPU, 0)
    view = np.from_dlpack(slot)
    assert view.ctypes.data == slot.ptr and view.shape == (64,)
    assert np.from_dlpack(Exporter(slot)).ctypes.data == slot.ptr
    slot.__dlpack__(dl_device=(KDLCPU, 0))
    with pytest.raises(BufferError, match=r"host memory \(kDLCPU\); cannot export to \(3, 0\)"):
        slot.__dlpack__(dl_device=(KDLCUDAHOST, 0))


# --- DLPack in ------------------------------------------------------------------------------------

def test_versioned_exporter_as_source_and_destination():
    src = Exporter(np.arange(256, dtype=np.uint8))
    dst = Exporter(np.zeros(256, np.uint8))
    with Stream() as s:
        copy_async(dst, src, 256, s)
        s.synchronize()
    assert (dst.array == src.array).all()
    # A consumer of DLPack >= 1.0, and no stream for host memory (DLPack: stream=None on kDLCPU).
    assert src.calls == [{"stream": None, "max_version": (1, 0)}] == dst.calls
    # The capsules were consumed: renamed, so their destructors leave the deleter to the core.
    assert "used_dltensor_versioned" in repr(src.capsules[0]) and "used_dltensor_versioned" in repr(dst.capsules[0])


def test_legacy_exporter():
    src = LegacyExporter(np.arange(64, dtype=np.uint8))
    slot = _slot(64)
    with Stream() as s:
        copy_async(slot, src, 64, s)
        s.synchronize()
    assert (slot.numpy("uint8") == src.array).all()
    assert len(src.calls) == 1 and "used_dltensor" in repr(src.capsules[0])


def test_slot_exports_to_the_core_itself():
    a, b = _slot(128), _slot(128)
    a.numpy("uint8")[:] = 9
    with Stream() as s:
        copy_async(Exporter(b), Exporter(a), 128, s)
        s.synchronize()
    assert (b.numpy("uint8") == 9).all()


def test_size_comes_from_shape_and_dtype():
    src = Exporter(np.arange(6, dtype=np.float64).reshape(2, 3))
    slot = _slot(64)
    with Stream() as s:
        with pytest.raises(ValueError, match="copy_async: src holds 48 bytes, fewer than nbytes=49"):
            copy_async(slot, src, 49, s)
        copy_async(slot, Exporter(np.arange(6, dtype=np.float64).reshape(2, 3)), 48, s)
        s.synchronize()
    assert (slot.numpy("float64", 6) == np.arange(6)).all()


def test_zero_dim_and_empty_arrays():
    slot = _slot(64)
    with Stream() as s:
        copy_async(slot, Exporter(np.array(7.5, np.float32)), 4, s)
        copy_async(Exporter(np.zeros((0, 3), np.float32)), slot, 0, s)
        s.synchronize()
    assert slot.numpy("float32", 1)[0] == 7.5


def test_non_contiguous_is_refused():
    slot = _slot(64)
    strided = Exporter(np.arange(20, dtype=np.uint8)[::2])
    with Stream() as s:
        with pytest.raises(ValueError, match=r"copy_async: src \(the source, DLPack kDLCPU:0\) must be "
                                             r"C-contiguous, got shape \(10,\) with strides \(2,\) elements"):
            copy_async(slot, strided, 10, s)
        # Through the buffer protocol too (a strided numpy array used to be copied as if compact).
        with pytest.raises(ValueError, match=r"copy_async: src \(the source\) must be C-contiguous, got shape "
                                             r"\(10,\) with strides \(2,\) bytes"):
            copy_async(slot, np.arange(20, dtype=np.uint8)[::2], 10, s)
        # Size-1 dimensions may have any stride.
        column = np.arange(8, dtype=np.uint8).reshape(8, 1)[:, :1]
        copy_async(slot, Exporter(column.T), 8, s)
        s.synchronize()
    assert list(slot.numpy("uint8", 8)) == list(range(8))
    assert "used_dltensor_versioned" in repr(strided.capsules[0])  # taken, then given back to its deleter


def test_read_only_destination_is_refused():
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    src = np.ones(16, np.uint8)
    with Stream() as s:
        with pytest.raises(ValueError, match=r"copy_async: dst \(the destination, DLPack kDLCPU:0\) is read-only"):
            copy_async(Exporter(ro), src, 16, s)
        with pytest.raises(ValueError, match=r"copy_async: dst \(the destination\) is read-only"):
            copy_async(ro, src, 16, s)
        with pytest.raises(ValueError, match=r"copy_async: dst \(the destination\) is read-only"):
            copy_async(bytes(16), src, 16, s)
        copy_async(np.zeros(16, np.uint8), Exporter(ro), 16, s)  # a read-only source is fine
        s.synchronize()


def test_unreachable_device_is_refused_before_export():
    for device, name in [((KDLCUDA, 0), "kDLCUDA:0"), ((KDLROCM, 1), "kDLROCM:1")]:
        src = Exporter(np.zeros(16, np.uint8), device=device)
        with Stream() as s:
            with pytest.raises(ValueError, match=fr"copy_async: src \(the source\) is on {name}, which a CPU stream "
                                                 r"cannot reach"):
                copy_async(_slot(16), src, 16, s)
        assert src.calls == []  # the producer did no work


def test_tensor_device_is_authoritative():
    # __dlpack_device__ says kDLCPU but the tensor says kDLCUDA: refused, and the capsule given back.
    liar = Exporter(np.zeros(16, np.uint8), tensor_device=(KDLCUDA, 0))
    with Stream() as s:
        with pytest.raises(ValueError, match=r"dst \(the destination\) is on kDLCUDA:0, which a CPU stream"):
            copy_async(liar, np.zeros(16, np.uint8), 16, s)
    assert "used_dltensor_versioned" in repr(liar.capsules[0])


def test_page_locked_host_memory_is_reachable_from_a_cpu_stream():
    src = Exporter(np.arange(32, dtype=np.uint8), device=(KDLCUDAHOST, 0), tensor_device=(KDLCUDAHOST, 0))
    slot = _slot(32)
    with Stream() as s:
        copy_async(slot, src, 32, s)
        s.synchronize()
    assert list(slot.numpy("uint8")) == list(range(32))
    assert src.calls[0]["stream"] is None  # no stream for host memory


def test_bad_exports_name_the_argument():
    class Broken:
        def __init__(self, result):
            self.result = result

        def __dlpack_device__(self):
            return (KDLCPU, 0)

        def __dlpack__(self, **kwargs):
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    slot = _slot(16)
    with Stream() as s:
        with pytest.raises(TypeError, match=r"copy_async: src \(the source\): __dlpack__\(\) returned int, not an "
                                            r"unconsumed DLPack capsule"):
            copy_async(slot, Broken(3), 16, s)
        with pytest.raises(BufferError, match=r"copy_async: src \(the source\): __dlpack__ failed: BufferError: no"):
            copy_async(slot, Broken(BufferError("no")), 16, s)
        first = Exporter(np.zeros(16, np.uint8))
        copy_async(slot, first, 16, s)
        with pytest.raises(TypeError, match="not an unconsumed DLPack capsule"):
            copy_async(slot, Broken(first.capsules[0]), 16, s)  # already taken by the copy above
        s.synchronize()


# --- Copies keep what they borrowed alive --------------------------------------------------------

N = 64 * 1024  # below glibc's mmap threshold: a freed source is handed to the next allocation of its size


def _pattern(n=N):
    return (np.arange(n, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)


@pytest.mark.parametrize("wrap", [lambda a: a, Exporter, LegacyExporter], ids=["buffer", "dlpack", "legacy"])
def test_temporary_source_lives_until_the_copy_ran(wrap):
    slot = _slot(N)
    expected = _pattern()
    with Stream() as s:
        s.enqueue_sleep(0.3)  # the copy runs well after copy_async returned
        copy_async(slot, wrap(_pattern()), N, s)  # the only reference to the source is the call's
        gc.collect()
        garbage = [np.full(N, 0xEE, np.uint8) for _ in range(64)]  # would take the freed source's memory
        s.synchronize()
        del garbage
    assert (slot.numpy("uint8") == expected).all()


@pytest.mark.parametrize("wrap", [lambda a: a, Exporter], ids=["buffer", "dlpack"])
def test_destination_lives_until_the_copy_ran(wrap):
    dst = np.zeros(N, np.uint8)
    alive = weakref.ref(dst)
    with Stream() as s:
        s.enqueue_sleep(0.2)
        copy_async(wrap(dst), _pattern(), N, s)
        del dst
        gc.collect()
        assert alive() is not None
        s.synchronize()
        assert alive() is None


@pytest.mark.parametrize("wrap", [lambda a: a, Exporter], ids=["buffer", "dlpack"])
def test_reference_released_after_completion(wrap):
    src = _pattern()
    alive = weakref.ref(src)
    refs = sys.getrefcount(src)
    slot = _slot(N)
    with Stream() as s:
        s.enqueue_sleep(0.2)
        copy_async(slot, wrap(src), N, s)
        assert sys.getrefcount(src) == refs + 1  # the buffer view, or numpy's DLPack export, holds it
        s.synchronize()  # released once the stream is past the copy
        assert sys.getrefcount(src) == refs
        del src
        assert alive() is None


def test_released_on_the_next_call_after_completion():
    src = _pattern()
    alive = weakref.ref(src)
    slot = _slot(N)
    with Stream() as s:
        copy_async(slot, src, N, s)
        del src
        done = Event()
        done.record(s)
        done.synchronize()  # the copy ran, but no call on the stream looked since
        assert alive() is not None
        assert s.query()  # any later call of the stream releases it
        assert alive() is None


def test_query_copy_async_and_close_release():
    slot = _slot(N)
    with Stream() as s:
        first = _pattern()
        alive = weakref.ref(first)
        copy_async(slot, first, N, s)
        del first
        e = Event()
        e.record(s)
        e.synchronize()
        copy_async(slot, np.zeros(N, np.uint8), N, s)  # prunes the completed copy first
        assert alive() is None
        s.enqueue_sleep(0.2)
        last = _pattern()
        alive = weakref.ref(last)
        copy_async(slot, last, N, s)
        del last
        assert alive() is not None
    assert alive() is None  # close drained the stream and released everything


def test_int_address_holds_nothing():
    src = _pattern()
    slot = _slot(N)
    with Stream() as s:
        refs = sys.getrefcount(src)
        s.enqueue_sleep(0.1)
        copy_async(slot.ptr, src.ctypes.data, N, s)
        assert sys.getrefcount(src) == refs
        s.synchronize()
    assert (slot.numpy("uint8") == src).all()


# --- Waiting on foreign handles --------------------------------------------------------------------

def test_cpu_stream_wait_external():
    src = Exporter(np.arange(16, dtype=np.uint8))
    slot = _slot(16)
    s = Stream()
    s.wait_external(0)  # a host framework's null stream: complete
    s.wait_external(0, kind="event")
    copy_async(slot, src, 16, s)
    s.synchronize()
    assert list(slot.numpy("uint8")) == list(range(16))
    with pytest.raises(ValueError, match="a CPU stream cannot wait on CUDA stream handle 0x1234; only 0"):
        s.wait_external(0x1234)
    with pytest.raises(ValueError, match="a CPU stream cannot wait on CUDA event handle 0x10"):
        s.wait_external(16, kind="event")
    with pytest.raises(ValueError, match="kind must be 'stream' or 'event', got 'queue'"):
        s.wait_external(0, kind="queue")
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.wait_external(0)


# --- Host code takes DLPack arrays too ------------------------------------------------------------

def test_shard_ops_take_dlpack_arrays():
    shard = np.ones(10, np.float32)
    apply_delta(Exporter(shard), Exporter(np.full(10, 2, np.float32)), 0.5)
    assert (shard == 2).all()
    out = snapshot(Exporter(shard))
    assert isinstance(out, np.ndarray) and (out == 2).all()
    with pytest.raises(TypeError, match="apply_delta: delta must be float32, got DLPack dtype float64"):
        apply_delta(shard, Exporter(np.zeros(10)))
    with pytest.raises(ValueError, match=r"apply_delta: shard is on kDLCUDA:0, which host code cannot reach"):
        apply_delta(Exporter(shard, device=(KDLCUDA, 0)), shard)
    ro = np.zeros(10, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"apply_delta: shard \(DLPack kDLCPU:0\) is read-only"):
        apply_delta(Exporter(ro), shard)
    with pytest.raises(TypeError, match="apply_delta: shard must be an object with the buffer protocol or a DLPack"):
        apply_delta([1.0], shard)


# --- Other frameworks, when installed ------------------------------------------------------------

def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    slot = _slot(256)
    t = torch.arange(64, dtype=torch.float32)
    back = torch.zeros(64, dtype=torch.float32)
    with Stream() as s:
        copy_async(slot, t * 2, 256, s)  # a temporary tensor
        copy_async(back, slot, 256, s)
        s.synchronize()
    assert torch.equal(back, t * 2)


def test_jax_round_trip():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.arange(64, dtype=jnp.float32) * 3
    a, b = _slot(256), _slot(256)
    with Stream() as s:
        copy_async(a, x, 256, s)  # the buffer protocol (a JAX array on the CPU exports one)
        copy_async(b, Exporter(x * 2), 256, s)  # DLPack, from a temporary
        with pytest.raises(ValueError, match=r"dst \(the destination\) is read-only"):
            copy_async(x, a, 256, s)  # JAX arrays are immutable
        s.synchronize()
    assert (a.numpy("float32") == np.asarray(x)).all()
    assert (b.numpy("float32") == np.asarray(x) * 2).all()
    y = jnp.from_dlpack(a).view(jnp.float32)
    assert np.array_equal(np.asarray(y), np.asarray(x))
