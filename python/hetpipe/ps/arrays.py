"""The few array operations the WSP worker half needs, for each array family it serves.

The wave ledger (:mod:`hetpipe.ps.ledger`) works on flat float32 vectors of whatever family the
front end computes in: NumPy, torch, CuPy (in place, recycling buffers) or JAX (functional: every
update returns a new array). :func:`ops_for` picks the family from an array's type without importing
any framework the process has not imported already, so a NumPy or JAX process never loads torch.

Numerics: every operation is element-wise (copy, gather and scatter by slices, ``+``, ``-``) on float32, so the
same sequence of operations gives the same bits in every family; the order of additions is the
ledger's, never the family's.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, Tuple

import numpy as np

import hetpipe_core


class ArrayOps:
    """In-place operations on 1-D float32 arrays of one family (NumPy's; torch and CuPy override a few).

    ``runs`` are ``(start, stop)`` ranges of a vector, in order (:data:`hetpipe.ps.ledger.Runs`): the
    gathers and scatters below are slices, so no family holds an index array."""

    functional = False

    def zeros(self, like: Any, n: int) -> Any:
        return np.zeros(n, dtype=np.float32)

    def clone(self, x: Any) -> Any:
        return x.copy()

    def concat(self, parts: Sequence[Any]) -> Any:
        return np.concatenate(parts)

    def take(self, x: Any, runs: Sequence[Tuple[int, int]]) -> Any:
        """A gathered copy of ``x``'s elements in ``runs``, in order."""
        return self.concat([x[a:b] for a, b in runs])

    def put(self, x: Any, runs: Sequence[Tuple[int, int]], v: Any) -> Any:
        """``x``'s elements in ``runs`` set to ``v``'s, in order; returns ``x`` (a new array in a
        functional family)."""
        off = 0
        for a, b in runs:
            x = self.set_span(x, a, b, v[off:off + b - a])
            off += b - a
        return x

    def add_at(self, x: Any, runs: Sequence[Tuple[int, int]], v: Any) -> Any:
        """``v``'s elements added to ``x``'s in ``runs`` (no element twice: each gets one addition);
        returns ``x``."""
        off = 0
        for a, b in runs:
            x = self.add_span(x, a, b, v[off:off + b - a])
            off += b - a
        return x

    def set_span(self, x: Any, a: int, b: int, v: Any) -> Any:
        x[a:b] = v
        return x

    def add_span(self, x: Any, a: int, b: int, v: Any) -> Any:
        x[a:b] += v
        return x

    def iadd(self, x: Any, v: Any) -> Any:
        x += v
        return x

    def reset(self, x: Any) -> Any:
        """``x`` set to zeros in place, for reuse."""
        x[...] = 0
        return x

    def accumulate_change(self, delta: Any, after: Any, before: Any, scratch: Any = None) -> Any:
        """``delta += after - before`` (each element rounded twice, in that order); returns ``delta``."""
        hetpipe_core.accumulate_change(delta, after, before)
        return delta


class TorchOps(ArrayOps):
    """torch tensors, on any device; CPU tensors take the core's arithmetic on their memory (no copy)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def zeros(self, like: Any, n: int) -> Any:
        return like.new_zeros(n)

    def clone(self, x: Any) -> Any:
        return x.clone()

    def concat(self, parts: Sequence[Any]) -> Any:
        return self.torch.cat(list(parts))

    def set_span(self, x: Any, a: int, b: int, v: Any) -> Any:
        with self.torch.no_grad():
            x[a:b].copy_(v)
        return x

    def add_span(self, x: Any, a: int, b: int, v: Any) -> Any:
        with self.torch.no_grad():
            x[a:b] += v
        return x

    def iadd(self, x: Any, v: Any) -> Any:
        with self.torch.no_grad():
            x += v
        return x

    def reset(self, x: Any) -> Any:
        return x.zero_()

    def accumulate_change(self, delta: Any, after: Any, before: Any, scratch: Any = None) -> Any:
        torch = self.torch
        with torch.no_grad():
            if delta.device.type == "cpu":
                hetpipe_core.accumulate_change(delta.numpy(), after.numpy(), before.numpy())
            elif scratch is not None:
                torch.sub(after, before, out=scratch)
                delta += scratch
            else:
                delta += after - before
        return delta


class CupyOps(ArrayOps):
    """CuPy arrays: NumPy's in-place semantics on the current CUDA device."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp

    def zeros(self, like: Any, n: int) -> Any:
        return self.cp.zeros(n, dtype=self.cp.float32)

    def concat(self, parts: Sequence[Any]) -> Any:
        return self.cp.concatenate(list(parts))

    def accumulate_change(self, delta: Any, after: Any, before: Any, scratch: Any = None) -> Any:
        if scratch is not None:
            self.cp.subtract(after, before, out=scratch)
            delta += scratch
        else:
            delta += after - before
        return delta


class JaxOps(ArrayOps):
    """JAX arrays are immutable: every update returns a new array (``x.at[idx]``), nothing is recycled."""

    functional = True

    def __init__(self, jnp: Any) -> None:
        self.jnp = jnp

    def zeros(self, like: Any, n: int) -> Any:
        return self.jnp.zeros(n, dtype=self.jnp.float32)

    def clone(self, x: Any) -> Any:
        return x

    def concat(self, parts: Sequence[Any]) -> Any:
        return self.jnp.concatenate(list(parts))

    def set_span(self, x: Any, a: int, b: int, v: Any) -> Any:
        return x.at[a:b].set(v)

    def add_span(self, x: Any, a: int, b: int, v: Any) -> Any:
        return x.at[a:b].add(v)

    def iadd(self, x: Any, v: Any) -> Any:
        return x + v

    def reset(self, x: Any) -> Any:
        return self.jnp.zeros_like(x)

    def accumulate_change(self, delta: Any, after: Any, before: Any, scratch: Any = None) -> Any:
        return delta + (after - before)


_NUMPY = ArrayOps()


def ops_for(x: Any) -> ArrayOps:
    """The operations of ``x``'s array family; a TypeError names the type when it is none of ours.

    Only frameworks already imported are looked at (``sys.modules``): an array of a family cannot
    exist without it."""
    if isinstance(x, np.ndarray):
        return _NUMPY
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return TorchOps(torch)
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(x, cp.ndarray):
        return CupyOps(cp)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        import jax.numpy as jnp

        return JaxOps(jnp)
    raise TypeError(f"hetpipe: a WSP ledger holds NumPy, torch, CuPy or JAX arrays, got {type(x).__module__}."
                    f"{type(x).__name__}")

