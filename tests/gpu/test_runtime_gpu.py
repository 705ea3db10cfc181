"""The runtime on a CUDA device: a 2-stage replay whose activations and gradients cross the host
through the copy stream trains like the same replay on the CPU; the stager's round trip is exact, and
its copies run beside compute enqueued after them."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hetpipe_core
from hetpipe.transport.device_copy import CopyStager
from hetpipe.run.replay import replay_run
from hetpipe.run.trainer import Trainer
from hetpipe.transport.protocol import ACT, Header, Message

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi" / "scripts"))
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

pytestmark = pytest.mark.gpu


def _needs_torch_cuda():
    if not torch.cuda.is_available():
        pytest.fail("hetpipe_core sees a CUDA device but torch does not (CPU-only torch build?)")


def test_two_stage_replay_on_cuda_matches_cpu(monkeypatch):
    _needs_torch_cuda()
    monkeypatch.setenv("HETPIPE_REQUIRE_PINNED", "1")      # each CUDA stage's pool must be page-locked
    plan = one_vw_plan([3], nm=2, d=0)
    cpu = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=2).replay()
    spec = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=2).spec(plan)
    spec.devices = {plan.rank_of(0, s): torch.device("cuda", 0) for s in range(2)}
    assert spec.copy_stream is None         # the copy stream is the default on CUDA
    gpu = replay_run(spec)
    assert sorted(gpu.losses[0]) == sorted(cpu.losses[0])
    assert max(abs(gpu.losses[0][p] - cpu.losses[0][p]) for p in cpu.losses[0]) < 1e-4
    for layer, w in cpu.weights.items():
        np.testing.assert_allclose(gpu.weights[layer], w, rtol=1e-4, atol=1e-5)
    assert cpu.losses[0][0] != cpu.losses[0][max(cpu.losses[0])]


def test_stager_round_trip_is_exact_and_ordered_after_its_producer():
    _needs_torch_cuda()
    n = 1 << 22
    pool = hetpipe_core.PinnedBufferPool(2, 4 * n, 0)
    assert pool.pinned and pool.device == 0
    stager = CopyStager(pool, torch.device("cuda", 0))
    a = torch.randn(n, device="cuda")
    t = a * 2                                   # the copy must wait for this kernel
    header = Header(ACT, 0, 0, 0, -1, "float32", (n,), 4 * n)
    stager.copy_out(t, 1, header)
    sent = []
    while not sent:
        sent = list(stager.ready_sends())
        if not sent:
            stager.wait()
    _, h, slot = sent[0]
    assert torch.equal(torch.from_numpy(slot.numpy("float32", n)), (a * 2).cpu())
    back = stager.copy_in(Message(0, h, slot.numpy("uint8", 4 * n), slot), torch.float32)
    assert back.is_cuda and torch.equal(back + 0, a * 2)    # compute ordered after the copy in
    stager.wait()
    stager.poll()
    assert stager.pending() == 0 and pool.available() == 2
    stager.close()


def test_stager_copy_overlaps_compute_enqueued_after_it():
    # The device->host copy of an activation goes on the copy stream, ordered after the kernel that
    # produced it only: compute enqueued afterwards on torch's stream runs beside it. Observed with
    # CUDA events: the copy has completed while that compute (~100 ms of matmuls) has not.
    _needs_torch_cuda()
    n = 1 << 22
    pool = hetpipe_core.PinnedBufferPool(1, 4 * n, 0)             # pinned: the copy can run asynchronously
    stager = CopyStager(pool, torch.device("cuda", 0))
    t = torch.randn(n, device="cuda") * 2
    m = torch.randn(4096, 4096, device="cuda") / 64
    y = torch.empty_like(m)
    torch.cuda.synchronize()
    assert stager.copy_out(t, 1, Header(ACT, 0, 0, 0, -1, "float32", (n,), 4 * n))
    compute_done = torch.cuda.Event()
    for _ in range(50):
        torch.mm(m, m, out=y)
    compute_done.record()
    sent = []
    while not sent:
        sent = list(stager.ready_sends())
    copied_during_compute = not compute_done.query()
    compute_done.synchronize()
    assert copied_during_compute, "the copy waited for compute enqueued after it: no overlap"
    _, _, slot = sent[0]
    assert torch.equal(torch.from_numpy(slot.numpy("float32", n)), t.cpu())
    pool.release(slot)
    stager.close()


def test_a_copy_in_completes_beside_a_large_copy_out():
    # One copy stream per direction: a small payload copied onto the device while a 1 GiB push is
    # copied off it completes first (on one shared stream it would wait for the push).
    _needs_torch_cuda()
    big, small = 1 << 28, 1 << 10
    pool = hetpipe_core.PinnedBufferPool.of_classes([(1, 4 * small), (1, 4 * big)], 0)
    assert pool.pinned, pool.pin_error
    stager = CopyStager(pool, torch.device("cuda", 0))
    push = torch.randn(big, device="cuda")
    torch.cuda.synchronize()
    assert stager.copy_out(push, 1, Header(ACT, 0, 0, 0, -1, "float32", (big,), 4 * big))
    slot = pool.acquire(4 * small)
    slot.numpy("float32", small)[:] = 3.0
    h = Header(ACT, 0, 0, 1, -1, "float32", (small,), 4 * small)
    back = stager.copy_in(Message(0, h, slot.numpy("uint8", 4 * small), slot), torch.float32)
    while stager.pending() > 1:
        stager.poll()
    still_pushing = not list(stager.ready_sends())
    assert torch.equal(back, torch.full((small,), 3.0, device="cuda"))
    assert still_pushing, "the copy in waited for the outgoing copy enqueued before it"
    stager.close()
