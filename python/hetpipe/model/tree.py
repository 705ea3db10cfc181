"""Pytree values at stage boundaries: their fixed spec, checked flattening, and one wire buffer per value.

What a layer returns may be any pytree (tensor, tuple, list, dict, Hugging Face ``ModelOutput``) whose
leaves are tensors with the batch on dim 0. Its :class:`Boundary` — tree structure plus each leaf's
trailing shape and dtype — is fixed at shape inference from the first minibatch; every later value
must match it. On the wire a value is one message: a single-leaf value is sent as that tensor (its
dtype and shape in the header), a multi-leaf value as one uint8 buffer holding every leaf's raw bytes
in leaf order, each leaf starting at a multiple of :data:`ALIGN` bytes (header: dtype uint8, shape
``(nbytes,)``, aux = batch). Nothing is pickled. Gradients travel the same way for the floating
leaves only: integer and bool leaves carry no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from hetpipe.plan.precision import HALF_DTYPE

ALIGN = 16


@dataclass(frozen=True)
class Leaf:
    """One tensor leaf of a boundary value: trailing shape (batch dimension excluded) and dtype."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self, batch: int) -> int:
        n = batch
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Boundary:
    """What crosses a stage boundary per minibatch: the tree structure and its leaves."""

    spec: Any                    # torch.utils._pytree.TreeSpec
    leaves: Tuple[Leaf, ...]

    @property
    def grad_leaves(self) -> Tuple[int, ...]:
        """Indices of the leaves that carry a gradient (the floating-point ones)."""
        return tuple(i for i, l in enumerate(self.leaves) if l.dtype.is_floating_point)

    def grad_boundary(self) -> "Boundary":
        """The boundary of the gradient message: the floating leaves, as a list."""
        leaves = tuple(self.leaves[i] for i in self.grad_leaves)
        return Boundary(pytree.tree_structure(list(range(len(leaves)))), leaves)

    def nbytes(self, batch: int) -> int:
        """Bytes of one message of ``batch`` samples (the packed size for several leaves)."""
        if len(self.leaves) == 1:
            return self.leaves[0].nbytes(batch)
        return sum(_aligned(l.nbytes(batch)) for l in self.leaves)

    def describe(self) -> str:
        parts = [f"{str(l.dtype).replace('torch.', '')}[batch, {', '.join(map(str, l.shape))}]".replace(", ]", "]")
                 for l in self.leaves]
        return ", ".join(parts)


def on_wire(boundary: Boundary, precision: str) -> Boundary:
    """``boundary`` as it crosses the wire under ``precision``: with "bf16"/"fp16" its float32 leaves
    travel in the half type (and so do their gradients); other leaves, and every leaf with "fp32",
    keep their dtype."""
    if precision not in HALF_DTYPE:
        return boundary
    half = getattr(torch, HALF_DTYPE[precision])
    leaves = tuple(Leaf(l.shape, half) if l.dtype == torch.float32 else l for l in boundary.leaves)
    return Boundary(boundary.spec, leaves)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def flatten(value: Any, where: str) -> Tuple[List[torch.Tensor], Any]:
    """The tensor leaves and spec of ``value``; TypeError naming ``where`` and the first non-tensor leaf."""
    with_path, spec = pytree.tree_flatten_with_path(value)
    for path, leaf in with_path:
        if not isinstance(leaf, torch.Tensor):
            at = pytree.keystr(path) or "the value itself"
            raise TypeError(f"hetpipe: {where} returned a {type(leaf).__name__} leaf at {at}; stage boundaries "
                            "carry pytrees (tuple, list, dict, ModelOutput) whose leaves are tensors")
    return [leaf for _, leaf in with_path], spec


def boundary_of(value: Any, where: str) -> Boundary:
    """The :class:`Boundary` of ``value``; every leaf must have the same batch size on dim 0."""
    leaves, spec = flatten(value, where)
    if not leaves:
        raise TypeError(f"hetpipe: {where} returned no tensor")
    batch = None
    for i, t in enumerate(leaves):
        if t.dim() == 0 or (batch is not None and t.shape[0] != batch):
            raise ValueError(f"hetpipe: {where} returned leaf {i} of shape {list(t.shape)}; every leaf needs the "
                             f"batch ({batch if batch is not None else 'the first leaf’s dim 0'}) on dim 0")
        batch = t.shape[0]
    return Boundary(spec, tuple(Leaf(tuple(t.shape[1:]), t.dtype) for t in leaves))


def batch_of(value: Any) -> int:
    """The batch size of a minibatch value (dim 0 of its first tensor leaf; 1 for a scalar)."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return int(leaf.shape[0]) if leaf.dim() else 1
    return 1


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with its tensor leaves on ``device``. A host tensor bound for a CUDA device is copied
    from pinned memory without blocking the host (a pageable copy would wait for the device to
    drain): from the tensor itself when pinned, else from a pinned copy, which torch's pinned-memory
    allocator keeps until the transfer completed."""
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device.type == "cuda" and t.device.type == "cpu":
            return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
        return t.to(device)

    return pytree.tree_map(move, value)


def halves(value: Any) -> Tuple[Any, Any]:
    """``value`` cut on dim 0 of every leaf into its first ``ceil(n / 2)`` and last ``floor(n / 2)`` samples."""
    h = (batch_of(value) + 1) // 2
    first = pytree.tree_map(lambda t: t[:h] if isinstance(t, torch.Tensor) else t, value)
    second = pytree.tree_map(lambda t: t[h:] if isinstance(t, torch.Tensor) else t, value)
    return first, second


def pack(leaves: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One tensor holding ``leaves`` for the wire: the leaf itself when there is one, else the
    aligned uint8 concatenation of their bytes (on ``device``)."""
    if len(leaves) == 1:
        return leaves[0].detach().contiguous()
    sizes = [t.numel() * t.element_size() for t in leaves]
    out = torch.zeros(sum(_aligned(n) for n in sizes), dtype=torch.uint8, device=device)
    off = 0
    for t, n in zip(leaves, sizes):
        if n:
            out[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        off += _aligned(n)
    return out


def unpack(buf: torch.Tensor, boundary: Boundary, batch: int) -> List[torch.Tensor]:
    """The leaves of a packed buffer (views into it); the inverse of :func:`pack`."""
    if len(boundary.leaves) == 1:
        return [buf]
    out, off = [], 0
    for leaf in boundary.leaves:
        n = leaf.nbytes(batch)
        out.append(buf[off:off + n].view(leaf.dtype).reshape((batch, *leaf.shape)))
        off += _aligned(n)
    return out


def check_message(boundary: Boundary, dtype: str, shape: Sequence[int], aux: int, nbytes: int) -> Optional[str]:
    """Why a received header does not fit ``boundary`` (None when it fits)."""
    if len(boundary.leaves) == 1:
        leaf = boundary.leaves[0]
        want = str(leaf.dtype).replace("torch.", "")
        if tuple(shape[1:]) != tuple(leaf.shape) or dtype != want:
            return f"is {dtype}{list(shape)}, expects {want}[batch, {', '.join(map(str, leaf.shape))}]"
        return None
    if dtype != "uint8" or aux < 0 or nbytes != boundary.nbytes(aux):
        return (f"is {nbytes} bytes for a batch of {aux}, expects the {len(boundary.leaves)} leaves "
                f"{boundary.describe()} ({boundary.nbytes(max(aux, 0))} bytes)")
    return None
