"""The multi-process runtime with its stages on real CUDA devices, under mpiexec: activations and
gradients cross ranks through pinned slots and the copy stream (stages sharing one GPU) or GPU to GPU
over NCCL (torch-p2p, one GPU per stage), and the run trains like the CPU replay of the same plan
(to float tolerance: cuBLAS and the CPU sum in different orders); in bf16 a decoder trains like
plain PyTorch autocast on the same GPU."""

import json

import pytest
import torch

from mpirun import mpiexec, results, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("cfg", [
    {"cuts": [3], "nm": 2, "d": 0, "copy_stream": True},
    {"cuts": [2, 4], "nm": 3, "d": 1, "shards": 2, "copy_stream": True},
    {"cuts": [3], "nm": 2, "d": 0, "copy_stream": False},
], ids=lambda c: f"stages{len(c['cuts']) + 1}-nm{c['nm']}-d{c['d']}-copy{int(c['copy_stream'])}")
def test_cuda_stages_train_like_cpu_replay(cfg):
    if mpiexec() is None:
        pytest.fail("no mpiexec beside this Python nor on PATH")
    ranks = len(cfg["cuts"]) + 1 + cfg.get("shards", 1)
    proc = run_mpi(ranks, "on_cuda.py", json.dumps(cfg), timeout=300)
    got = results(proc)
    assert proc.returncode == 0 and len(got) == 1, f"{proc.stdout}\n{proc.stderr}"
    r = got[0]
    assert r["cuda"] and r["trained"], r
    assert r["minibatches"] == r["expected"], r
    assert r["loss_diff"] < 1e-4 and r["weight_diff"] < 1e-4, r
    assert r["transport"] == "mpi-host", r     # NCCL cannot join two ranks of one GPU: the edge stays on MPI


@pytest.mark.parametrize("transport", [None, "torch-p2p"])
def test_stages_on_two_gpus_go_gpu_to_gpu_over_nccl(transport):
    if mpiexec() is None:
        pytest.fail("no mpiexec beside this Python nor on PATH")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    cfg = {"cuts": [3], "nm": 2, "d": 0, "gpu_per_stage": True, "transport": transport}
    proc = run_mpi(3, "on_cuda.py", json.dumps(cfg), timeout=300)
    got = results(proc)
    assert proc.returncode == 0 and len(got) == 1, f"{proc.stdout}\n{proc.stderr}"
    r = got[0]
    assert r["transport"] == "mpi-host+torch-p2p", r     # chosen automatically between two GPUs
    assert r["minibatches"] == r["expected"] and r["trained"], r
    assert r["loss_diff"] < 1e-4 and r["weight_diff"] < 1e-4, r


def test_bf16_decoder_trains_like_plain_autocast_on_the_gpu():
    # 2 stages + 1 PS sharing the GPU, bf16, against plain PyTorch in one process on the same GPU
    # (scripts/bf16_decoder.py says what the reference rounds and why); float32 training is the
    # yardstick of "bf16 off", so the tolerance is relative to what precision changes.
    if mpiexec() is None:
        pytest.fail("no mpiexec beside this Python nor on PATH")
    pytest.importorskip("transformers")
    proc = run_mpi(3, "bf16_decoder.py", json.dumps({"device": "cuda:0"}), timeout=300)
    got = results(proc)
    assert proc.returncode == 0 and len(got) == 1, f"{proc.stdout}\n{proc.stderr}"
    r = got[0]
    assert r["trained"] and r["minibatches"] == 8, r
    assert r["fp32_loss_diff"] > 0 and r["fp32_weight_error"] > 0, r
    assert r["loss_diff"] <= 0.1 * r["fp32_loss_diff"], r
    assert r["weight_error"] <= 0.1 * r["fp32_weight_error"], r
