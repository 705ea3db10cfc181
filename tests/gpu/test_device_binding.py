"""One device per rank: the core's CUDA calls open a context only on the device they name, leave the
thread's (and torch's) current device as it was; start-up touches no device before a stage rank binds
its own, and a parameter-server rank holds no context at all (nor appears in the driver's list of
compute processes).

Context checks run in fresh interpreters (an open context cannot be closed again), reading the
driver's own record: hetpipe_core.cuda_context_active (cuDevicePrimaryCtxGetState).
"""

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import hetpipe_core
from hetpipe_core import Event, PinnedBufferPool, Stream
from mpirun import mpiexec, results, run_mpi

pytestmark = pytest.mark.gpu


def _fresh(code: str) -> dict:
    """Runs `code` in a new interpreter; it must print one JSON line, returned here."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_pool_and_cpu_streams_open_no_context():
    got = _fresh("""
        import json, hetpipe_core
        n = hetpipe_core.build_info()["cuda_device_count"]
        pool = hetpipe_core.PinnedBufferPool(4, 1 << 20)          # device=-1: host memory
        s = hetpipe_core.Stream(-1)
        slot = pool.acquire()
        hetpipe_core.copy_async(slot, bytes(16), 16, s)
        s.synchronize()
        print(json.dumps({"n": n, "pinned": pool.pinned,
                          "active": [hetpipe_core.cuda_context_active(d) for d in range(n)]}))
    """)
    assert got["n"] >= 1 and got["pinned"] is False
    assert got["active"] == [False] * got["n"]


def test_pinned_pool_and_stream_open_only_their_device():
    got = _fresh("""
        import json, hetpipe_core
        n = hetpipe_core.build_info()["cuda_device_count"]
        d = n - 1
        pool = hetpipe_core.PinnedBufferPool(2, 4096, d)
        s = hetpipe_core.Stream(d)
        e = hetpipe_core.Event()
        e.record(s)
        s.synchronize()
        e.synchronize()
        print(json.dumps({"n": n, "d": d, "pinned": pool.pinned,
                          "active": [hetpipe_core.cuda_context_active(i) for i in range(n)]}))
    """)
    assert got["pinned"] is True
    assert got["active"] == [i == got["d"] for i in range(got["n"])]


def test_stream_on_another_device_leaves_torch_current_device():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    s = Stream(1)
    e = Event()
    src = torch.arange(1 << 16, dtype=torch.float32, device="cuda:1")
    dst = torch.empty_like(src)
    hetpipe_core.copy_async(dst.data_ptr(), src.data_ptr(), 4 * src.numel(), s)
    e.record(s)
    s.synchronize()
    e.synchronize()
    assert s.query() and e.query()
    assert torch.cuda.current_device() == 0
    assert torch.equal(dst, src)
    s.close()
    assert torch.cuda.current_device() == 0


def test_query_and_closed_never_wait_behind_synchronize():
    """query() and closed answer while another thread blocks in synchronize(): a query that waited
    behind it would only return once the stream's work was done, i.e. True."""
    s = Stream(0)
    s.enqueue_sleep(1.0)
    waiter = threading.Thread(target=s.synchronize)
    waiter.start()
    time.sleep(0.1)                           # the waiter now blocks in synchronize
    assert s.query() is False and s.closed is False
    waiter.join()
    assert s.query()
    s.close()


def test_event_rerecorded_while_a_cpu_stream_waits_on_it():
    cuda, cpu = Stream(0), Stream(-1)
    pool = PinnedBufferPool(2, 64)
    a, b = pool.acquire(), pool.acquire()
    a.numpy("uint8")[:] = 5
    e = Event()
    # Timed from before the sleep is enqueued: a wait that kept its point cannot end sooner than the
    # sleep, however loaded the host (a lower bound).
    start = time.perf_counter()
    cuda.enqueue_sleep(0.3)
    e.record(cuda)                            # the point after the sleep
    cpu.wait_for(e)
    hetpipe_core.copy_async(b, a, 64, cpu)   # must wait for that point
    e.record(cuda)                            # re-recorded before the wait runs: a new handle
    del e                                     # and destroyed: the wait keeps its own point
    cpu.synchronize()
    assert time.perf_counter() - start > 0.15 and (b.numpy("uint8") == 5).all()
    cuda.close()
    cpu.close()


def test_host_inventory_opens_no_context():
    # Every rank takes its inventory before it knows its role: it must leave CUDA untouched.
    got = _fresh("""
        import json, torch, hetpipe_core
        from hetpipe.job.world import host_info
        info = host_info()
        n = hetpipe_core.build_info()["cuda_device_count"]
        print(json.dumps({"info": info, "n": n, "torch_initialized": torch.cuda.is_initialized(),
                          "active": [hetpipe_core.cuda_context_active(d) for d in range(n)]}))
    """)
    assert got["info"]["cuda_count"] == got["n"] >= 1
    assert got["torch_initialized"] is False
    assert got["active"] == [False] * got["n"]


def test_ranks_bind_first_and_ps_rank_holds_no_context():
    if mpiexec() is None:
        pytest.fail("no mpiexec beside this Python nor on PATH")
    proc = run_mpi(3, "contexts.py", timeout=300)
    got = results(proc)
    assert proc.returncode == 0 and len(got) == 1, f"{proc.stdout}\n{proc.stderr}"
    by_role = got[0]["ranks"]
    ps = [r for r in by_role if r["role"].startswith("ps")]
    stages = [r for r in by_role if not r["role"].startswith("ps")]
    assert len(ps) == 1 and len(stages) == 2, by_role
    # The PS rank: no context on any device (the driver's record), no torch CUDA state, never bound.
    assert not any(ps[0]["contexts"]) and ps[0]["torch_initialized"] is False and ps[0]["bindings"] == [], ps
    for r in stages:
        # Bound before any CUDA call: at the first binding no device had a context and torch had not
        # initialised CUDA, so nothing could land on another GPU first.
        first = r["bindings"][0]
        assert first["device"] == "cuda:0" and not any(first["contexts"]), r
        assert first["torch_initialized"] is False, r
        assert r["contexts"][0] and not any(r["contexts"][1:]), r      # the stages run on cuda:0 only
    listed = got[0]["compute_pids"]
    if listed is None:
        pytest.skip("no nvidia-smi: the driver's process list was not read (the context checks above ran)")
    if not {r["pid"] for r in stages} <= set(listed):
        pytest.skip(f"nvidia-smi lists {listed}, not the stage ranks' pids (another pid namespace); "
                    "the context checks above ran")
    assert ps[0]["pid"] not in listed, (ps, listed)
