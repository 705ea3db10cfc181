"""Published dense peak FLOP/s of GPUs per training precision: the prior for a device type's speed
before a profile measured on it replaces it. Torch-free.

The figure a run of each precision is modelled at, and why:

* ``fp32``: the FP32 (CUDA core) peak. PyTorch leaves ``torch.backends.cuda.matmul.allow_tf32``
  False by default, so float32 matmuls do not use TF32 tensor cores.
* ``tf32``: a float32 run whose matmuls may use TF32 tensor cores
  (``torch.set_float32_matmul_precision("high")`` or ``allow_tf32 = True``, which the run reads when
  it plans): the dense TF32 tensor throughput, Ampere and newer; a type without TF32 runs at its FP32
  peak.
* ``bf16`` / ``fp16``: the dense tensor-core throughput with FP32 accumulation (autocast's matmuls
  accumulate in float32), without structured sparsity. GeForce cards run FP32-accumulate at half
  their FP16-accumulate rate; the figures below are the FP32-accumulate ones.
* A type without tensor cores for the half type runs it at its FP32 peak: bf16 on Volta, Turing and
  Pascal (no bf16 hardware; cuBLAS computes bf16 through FP32) and fp16 on Pascal (no tensor cores;
  torch's half matmuls accumulate in FP32, which Pascal's double-rate FP16 path does not do).

Types without TF32 (Volta, Turing, Pascal) carry their FP32 peak as ``tf32``.

Sources (vendor datasheets and architecture whitepapers, dense figures): H100/H200 SXM, A100, A40,
A30, A10, L40S, L40, L4, V100 SXM2 and T4 product datasheets; P100 PCIe datasheet; the Ampere GA102
whitepaper (RTX 3090, 3080, A6000), the Ada AD102 whitepaper (RTX 4090) and the Turing TU102
whitepaper (RTX 2080 Ti, Titan RTX; RTX 2060 from TU106's FP16 tensor rate, halved for FP32
accumulation); the Titan V product page (110 TFLOPS tensor) and the Quadro P4000 datasheet.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class Peak(NamedTuple):
    """Dense FLOP/s of a run of each precision (see the module docstring)."""

    fp32: float
    fp16: float
    bf16: float
    tf32: float


# Keyed by a word of the GPU's name (matched as in :func:`lookup`).
PEAKS = {
    "h200": Peak(67e12, 989.4e12, 989.4e12, 494.7e12),
    "h100": Peak(67e12, 989.4e12, 989.4e12, 494.7e12),         # SXM5
    "a100": Peak(19.5e12, 312e12, 312e12, 156e12),
    "a40": Peak(37.4e12, 149.7e12, 149.7e12, 74.8e12),
    "a30": Peak(10.3e12, 165e12, 165e12, 82e12),
    "a10": Peak(31.2e12, 125e12, 125e12, 62.5e12),
    "l40s": Peak(91.6e12, 362.05e12, 362.05e12, 183e12),
    "l40": Peak(90.5e12, 181.05e12, 181.05e12, 90.5e12),
    "l4": Peak(30.3e12, 121e12, 121e12, 60e12),
    "v100": Peak(15.7e12, 125e12, 15.7e12, 15.7e12),           # SXM2; no bf16
    "t4": Peak(8.1e12, 65e12, 8.1e12, 8.1e12),                # Turing: no bf16
    "p100": Peak(9.3e12, 9.3e12, 9.3e12, 9.3e12),             # Pascal: no tensor cores
    "4090": Peak(82.6e12, 165.2e12, 165.2e12, 82.6e12),
    "3090": Peak(35.6e12, 71e12, 71e12, 35.6e12),
    "3080": Peak(29.8e12, 59.5e12, 59.5e12, 29.8e12),
    "2080": Peak(13.4e12, 53.8e12, 13.4e12, 13.4e12),          # 2080 Ti; no bf16
    "2060": Peak(6.45e12, 25.8e12, 6.45e12, 6.45e12),          # no bf16
    "a6000": Peak(38.7e12, 154.8e12, 154.8e12, 77.4e12),
    "titan v": Peak(14.9e12, 110e12, 14.9e12, 14.9e12),        # Volta: no bf16
    "titan rtx": Peak(16.3e12, 130.5e12, 16.3e12, 16.3e12),    # Turing: no bf16
    "p4000": Peak(5.3e12, 5.3e12, 5.3e12, 5.3e12),            # Pascal: no tensor cores
}


def lookup(name: str) -> Optional[Peak]:
    """The :data:`PEAKS` entry whose key appears in ``name`` (a GPU's name as the driver gives it, or a
    device type name, ``_`` read as a space), the longest key first; None when none does."""
    text = name.lower().replace("_", " ")
    for key in sorted(PEAKS, key=len, reverse=True):
        if key in text:
            return PEAKS[key]
    return None
