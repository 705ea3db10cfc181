"""The wire codec: tensors into pinned pool slots and headers, and received payloads back into tensors."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch

from hetpipe.model.tree import Boundary
from hetpipe.transport.protocol import DTYPES, Header
from hetpipe.transport.slots import slot_bytes, try_acquire



# The wire name of each torch dtype the transport carries (transport.DTYPES are torch's names).
TORCH_DTYPE_NAME = {getattr(torch, name): name for name in DTYPES}


def tensor_to_slot(pool, t: torch.Tensor):
    """Copy ``t`` into a fresh pool slot (device→host when ``t`` is on a GPU); returns (slot, dtype name),
    or (None, dtype name) when every slot is in use (see :func:`try_acquire`)."""
    t = t.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    slot = try_acquire(pool, nbytes)
    if slot is not None and nbytes:
        dst = torch.from_numpy(slot_bytes(slot, nbytes))
        dst.copy_(t.reshape(-1).view(torch.uint8))
    return slot, TORCH_DTYPE_NAME[t.dtype]


_HALF = (torch.bfloat16, torch.float16)
# A value header's ``aux`` word (ACT, GRAD, EVAL): a multi-leaf value's batch in its low 32 bits (-1 for
# one leaf), and from bit ROUNDED_BIT on one bit per leaf the sender rounded from float32 to the wire's
# half type, which the receiver widens back (:func:`from_wire`).
ROUNDED_BIT = 32
MAX_ROUNDED_LEAVES = 63 - ROUNDED_BIT


def to_wire(leaves: Sequence[torch.Tensor], boundary: Boundary) -> List[torch.Tensor]:
    """The float32 leaves that ``boundary`` (a wire boundary, see ``tree.on_wire``) carries in a half
    type, rounded to it; every other leaf as it is (a mismatch is still the receiver's error)."""
    return [t.to(leaf.dtype) if t.dtype == torch.float32 and leaf.dtype in _HALF else t
            for t, leaf in zip(leaves, boundary.leaves)]


def rounded_by_wire(leaves: Sequence[torch.Tensor], boundary: Boundary) -> Tuple[int, ...]:
    """The indices of the leaves :func:`to_wire` rounds: float32 ones that ``boundary`` carries in a half
    type. (A leaf that is already in the half type — autocast's own output — is not rounded.)"""
    return tuple(i for i, (t, leaf) in enumerate(zip(leaves, boundary.leaves))
                 if t.dtype == torch.float32 and leaf.dtype in _HALF)


def from_wire(leaves: Sequence[torch.Tensor], rounded: Sequence[int]) -> List[torch.Tensor]:
    """Received ``leaves`` with the ``rounded`` ones widened back to float32, the dtype their sender had:
    the wire's rounding is then the only one, as a cast there and back would be in one process, and
    what follows computes in float32 as it would have (a residual stream stays float32)."""
    return [t.to(torch.float32) if i in rounded else t for i, t in enumerate(leaves)]


def value_header(kind: int, vw: int, stage: int, mb: int, leaves: Sequence[torch.Tensor],
                 packed: torch.Tensor, rounded: Sequence[int] = ()) -> Tuple[Header, int]:
    """The header of a value's message and its byte count: ``packed`` (``tree.pack`` of ``leaves``)
    travels with its own dtype and shape when the value is one tensor, else as bytes with the batch
    size in ``aux`` (see ``tree.unpack``); ``aux`` also flags the ``rounded`` leaves (``ROUNDED_BIT``)."""
    if any(i >= MAX_ROUNDED_LEAVES for i in rounded):
        raise ValueError(f"hetpipe: a value of {len(leaves)} leaves rounds leaf {max(rounded)} for the wire; its "
                         f"header flags the first {MAX_ROUNDED_LEAVES} leaves only")
    flags = sum(1 << (ROUNDED_BIT + i) for i in set(rounded))
    nbytes = packed.numel() * packed.element_size()
    if len(leaves) == 1:
        return Header(kind, vw, stage, mb, flags or -1, TORCH_DTYPE_NAME[packed.dtype], tuple(packed.shape),
                      nbytes), nbytes
    batch = int(leaves[0].shape[0]) if leaves else 0
    return Header(kind, vw, stage, mb, batch | flags, "uint8", (nbytes,), nbytes), nbytes


def value_batch(aux: int) -> int:
    """A multi-leaf value's batch size from its header's ``aux`` (negative stays negative: malformed)."""
    return aux & ((1 << ROUNDED_BIT) - 1) if aux >= 0 else aux


def value_rounded(aux: int) -> Tuple[int, ...]:
    """The leaves a value's header flags as rounded from float32 by its sender."""
    if aux < 0:
        return ()
    return tuple(i for i in range(MAX_ROUNDED_LEAVES) if aux >> (ROUNDED_BIT + i) & 1)


def payload_tensor(payload: np.ndarray, dtype: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """A received payload viewed as a ``dtype`` tensor of ``shape`` (no copy on the CPU), on ``device``."""
    if payload.size == 0:           # an empty message (numpy gives its view stride 0, which torch refuses)
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
    t = torch.from_numpy(payload).view(getattr(torch, dtype)).reshape(tuple(shape))
    return t.to(device) if device.type != "cpu" else t
