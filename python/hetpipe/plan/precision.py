"""Training precision: "fp32", "bf16" or "fp16" (autocast compute to the half type, float32 master
weights, the half type on the wire; "fp16" adds dynamic loss scaling, :mod:`hetpipe.stage.loss_scale`).

The names and the planner's wire factor live here, free of torch, so the planner and the runtime
agree on them; what the runtime does with each is in docs/design.md ("Mixed precision").
"""

from __future__ import annotations

from hetpipe.util.errors import ArgumentError

PRECISIONS = ("fp32", "bf16", "fp16")
# The half dtype (torch's name) a mixed precision computes and sends in.
HALF_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}

# Bytes per element of the floating dtypes a profile's activations may be measured in.
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATION_DTYPES = tuple(_ELEMENT_BYTES)


# What a device's speed is read at: a training precision, or "tf32", an fp32 run whose matmuls may use
# TF32 tensor cores (torch.set_float32_matmul_precision("high")): it trains as fp32, at another peak.
SPEED_PRECISIONS = PRECISIONS + ("tf32",)


def speed_precision(precision: str, tf32: bool = False) -> str:
    """The precision a device's speed is read at for a run of ``precision``: "tf32" for an fp32 run
    whose float32 matmuls may use TF32 (``tf32``), else ``precision``."""
    check_precision(precision, "speed_precision")
    return "tf32" if tf32 and precision == "fp32" else precision


def check_speed_precision(precision: str, where: str) -> str:
    """``precision`` if it is one of :data:`SPEED_PRECISIONS`; else a ValueError naming ``where``."""
    if precision not in SPEED_PRECISIONS:
        raise ArgumentError(f"{where}: precision must be one of {list(SPEED_PRECISIONS)}, got {precision!r}")
    return precision


def check_precision(precision: str, where: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; else a ValueError naming ``where``."""
    if precision not in PRECISIONS:
        raise ArgumentError(f"{where}: precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return precision


def wire_factor(precision: str, activation_dtype: str = "float32") -> float:
    """Stage-to-stage bytes per profiled activation byte: under "bf16"/"fp16" the float32 activations
    and their gradients cross in the half type (half the bytes); activations already profiled in a
    2-byte dtype, and every activation under "fp32", cross as profiled."""
    check_precision(precision, "wire_factor")
    if activation_dtype not in _ELEMENT_BYTES:
        raise ValueError(f"wire_factor: activation dtype must be one of {list(ACTIVATION_DTYPES)}, "
                         f"got {activation_dtype!r}")
    if precision == "fp32":
        return 1.0
    return min(1.0, 2 / _ELEMENT_BYTES[activation_dtype])
