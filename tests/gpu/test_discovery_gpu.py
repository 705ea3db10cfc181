"""Discovery and profiling on a real GPU: what nvidia-smi reports agrees with CUDA's own view, and a
model is measured on the device one layer at a time, leaving it where it was."""

import pytest
import torch
from torch import nn

from hetpipe.job.discovery import discover, gpu_type_name
from hetpipe.job.inventory import EMULATE_ENV, HOST_ENV, rank_facts
from hetpipe.model.measure import measure_layers

pytestmark = pytest.mark.gpu


def test_facts_agree_with_cuda(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.delenv(HOST_ENV, raising=False)
    facts = rank_facts(0, 1)
    assert len(facts["gpus"]) == torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    assert facts["gpus"][0]["name"] == props.name
    assert abs(facts["gpus"][0]["memory_bytes"] - props.total_memory) < 1 << 30
    assert facts["gpus"][0]["compute_capability"] == f"{props.major}.{props.minor}"
    found = discover([facts])
    holder = found.holders[0]
    assert holder.gpu == 0 and holder.type == gpu_type_name(props.name)
    assert found.cluster.device_types[holder.type].memory_bytes == facts["gpus"][0]["memory_bytes"]


def test_cuda_and_nvidia_smi_agree_on_the_gpu_identity():
    # "Same GPU" between ranks is decided by this identity: CUDA's UUID (through torch) and the one
    # nvidia-smi lists for the same visible device must be one string, or ranks would disagree.
    from hetpipe.job.inventory import gpu_identity, local_gpus
    from hetpipe.transport.registry import device_identity

    if not local_gpus():
        pytest.skip("no nvidia-smi: only CUDA's UUID is known here")
    for i in range(torch.cuda.device_count()):
        ours = device_identity(torch.device("cuda", i))
        assert ours.startswith("GPU-") and len(ours) == 40, ours
        assert ours == gpu_identity(i), (ours, local_gpus())


def test_a_model_is_measured_on_the_device_one_layer_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    x = torch.randn(256, 1024)
    on_cpu = measure_layers(model, x, repeats=3)
    on_gpu = measure_layers(model, x, repeats=3, device="cuda:0")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [m.activation_bytes for m in on_gpu.layers] == [m.activation_bytes for m in on_cpu.layers]
    assert all(m.fwd_s > 0 and m.bwd_s > 0 for m in on_gpu.layers)
    # the largest layer's weights, gradient, input and output were on the device at once
    assert on_gpu.peak_bytes >= 2 * 4096 * 1024 * 4 + 256 * (1024 + 4096) * 4
