"""The stage model: the time and memory of a run of layers on one device at one pipeline position.

One place defines what a stage costs, so the partitioner, the baselines and the reports agree.
For stage ``k`` of ``K`` holding layers ``[a, b)`` on a device of type ``t``, with ``nm`` minibatches
in flight in the VW:

* compute  = fwd_t[a:b] + bwd_t[a:b] (+ fwd_t[a:b] again when the stage recomputes);
* transfer = send of the output activation of layer ``b-1`` to stage ``k+1`` plus send of the input
  gradient (as large as the activation of layer ``a-1``) back to stage ``k-1``, each
  ``latency + wire_factor x bytes / bandwidth`` over the link between the two devices (0 at the
  pipeline ends); ``wire_factor`` is 1/2 for a bf16 plan of a float32 profile
  (:func:`hetpipe.plan.precision.wire_factor`), 1 otherwise;
* stage time = compute + transfer; the VW's bottleneck is the largest stage time.
* memory: the runtime's memory model (:mod:`hetpipe.stage.params`). With ``P = param[a:b]`` and
  ``n_k = min(nm, K - k)`` (the HetPipe schedule's 1F1B rule lets stage ``k`` run at most ``n_k``
  forwards ahead of their backwards, so ``n_k`` minibatches are in flight there)::

      memory = 2 x P                      live weights and their gradients (during an Apply)
             + optimizer state[a:b]
             + max workspace[a:b]
             + n_k x 2 x P                weight stashes: each minibatch in flight differentiates its
                                          own clone of the weights, and holds a gradient of that size
                                          until its Apply
             + (D + 2) x P                float32 wave deltas not yet merged by a Pull (D + 2 waves at
                                          most under staleness bound D)
             + n_k x stash[a:b]           activations saved for backward

  A recomputing stage stashes only its input for each minibatch in flight and rebuilds one
  minibatch's activations during its backward, so its last term is ``n_k x input_bytes(a) +
  stash[a:b]``; its weight stashes are those of a stage without recomputation.

  ``P`` also counts the replicas the stage holds: a tied parameter (the profile's ``tied``) used by
  a layer of ``[a, b)`` and owned by a layer before ``a`` is one more slice of the stage's flat
  weights (each replica once), with its gradient, optimizer state, stashes and delta slices like any
  other; one owned inside ``[a, b)`` is already in ``param[a:b]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.profile import ModelProfile

DENSE_MAX = 512


@dataclass(frozen=True)
class StageDevice:
    """One device of a VW, as the partitioner sees it."""

    device: str
    device_type: str
    node: str
    memory_bytes: int


@dataclass(frozen=True)
class LinkCost:
    """The link between two consecutive stages."""

    bandwidth: float
    latency: float

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth


class LayerTable:
    """Prefix sums and range maxima over a profile's layers, for O(1) stage queries (vectorised)."""

    def __init__(self, profile: ModelProfile, device_types: Iterable[str], d: int = 0, wire_factor: float = 1.0):
        """``d``: the plan's WSP staleness bound, which sets how many wave deltas a stage keeps.
        ``wire_factor``: bytes on the wire per profiled activation byte (transfers only; the memory
        model counts the profiled bytes)."""
        if d < 0:
            raise ValueError(f"LayerTable: d must be >= 0, got {d}")
        if not 0 < wire_factor <= 1:
            raise ValueError(f"LayerTable: wire_factor must be in (0, 1], got {wire_factor}")
        self.d = d
        self.wire_factor = wire_factor
        types = sorted(set(device_types))
        profile.validate(types)
        self.profile = profile
        self.num_layers = n = profile.num_layers
        self.cum_fwd: Dict[str, np.ndarray] = {}
        self.cum_bwd: Dict[str, np.ndarray] = {}
        for t in types:
            self.cum_fwd[t] = np.concatenate([[0.0], np.cumsum(profile.fwd(t))])
            self.cum_bwd[t] = np.concatenate([[0.0], np.cumsum(profile.bwd(t))])
        layers = profile.layers
        self.out_bytes = np.array([float(x.activation_bytes) for x in layers])
        # in_bytes[a]: the input of layer a (the model input for a = 0); in_bytes[n] is unused
        self.in_bytes = np.concatenate([[float(profile.input_bytes)], self.out_bytes])
        # What crosses a stage boundary: the activation forward, its gradient (as large) back.
        self.wire_out = self.out_bytes * wire_factor
        self.wire_in = self.in_bytes * wire_factor
        self.param_bytes = np.array([float(x.param_bytes) for x in layers])
        state = np.array([2.0 * x.param_bytes + x.optimizer_bytes for x in layers])
        self.cum_state = np.concatenate([[0.0], np.cumsum(state)])
        self.cum_param = np.concatenate([[0.0], np.cumsum(self.param_bytes)])
        # Tied parameters, one entry each: (owner, next_user, bytes, optimizer bytes), where
        # next_user[a] is the first layer >= a that holds it (n + 1 if none), so that a stage [a, b)
        # holds a replica exactly when owner < a and next_user[a] < b.
        users: Dict[Tuple[int, str], list] = {}
        for i, layer in enumerate(layers):
            for owner, name, nbytes in layer.tied:
                users.setdefault((owner, name), [nbytes, []])[1].append(i)
        self.ties = []
        for (owner, _), (nbytes, holders) in sorted(users.items()):
            nxt = np.full(n + 1, n + 1, dtype=np.intp)
            for u in sorted(holders, reverse=True):
                nxt[:u + 1] = u
            own = layers[owner]
            ratio = own.optimizer_bytes / own.param_bytes if own.param_bytes else 0.0
            self.ties.append((owner, nxt, float(nbytes), ratio * nbytes))
        self.cum_stash = np.concatenate([[0.0], np.cumsum([float(x.stash) for x in layers])])
        ws = np.array([float(x.workspace_bytes) for x in layers])
        # range maxima: a dense (L+1) x (L+1) table for models of up to DENSE_MAX layers, else a
        # sparse table (O(1) per query after O(L log L) set-up)
        self._dense = None
        if n <= DENSE_MAX:
            m = np.zeros((n + 1, n + 1))
            for a in range(n):
                m[a, a + 1:] = np.maximum.accumulate(ws[a:])
            self._dense = m
        levels = [ws]
        p = 1
        while 2 * p <= n:
            prev = levels[-1]
            levels.append(np.maximum(prev[:-p], prev[p:]))
            p *= 2
        # level p holds max(ws[i : i + 2**p]) at column i, zero-padded to n columns
        self._sparse = np.zeros((len(levels), max(n, 1)))
        for p, row in enumerate(levels):
            self._sparse[p, :len(row)] = row
        self._flat = self._sparse.ravel()
        # floor(log2(length)) for every range length, and 2 ** that
        self._lg = np.zeros(n + 1, dtype=np.intp)
        for i in range(2, n + 1):
            self._lg[i] = self._lg[i // 2] + 1
        self._pow = np.left_shift(1, self._lg)

    def ws_max(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Largest workspace over layers [a, b) (b > a), elementwise."""
        if self._dense is not None:
            return self._dense[a, b]
        length = np.maximum(b - a, 1)
        row = self._lg[length] * self._sparse.shape[1]
        start2 = np.maximum(b - self._pow[length], a)
        return np.maximum(self._flat[row + a], self._flat[row + start2])

    def stage_arrays(self, stage_dev: StageDevice, k: int, num_stages: int, nm: int, a: np.ndarray, b: np.ndarray,
                     prev: Optional[LinkCost], nxt: Optional[LinkCost], recompute: bool):
        """(time, memory) of stage ``k`` holding ``[a, b)`` on ``stage_dev``; arrays broadcast over a and b
        (typically a column of starts and a row of stops, ``b >= 1``). Entries with ``b <= a`` are
        meaningless (callers mask them). Terms that depend on one end only stay vectors, so each
        call costs about three operations on the full matrix."""
        t = stage_dev.device_type
        cf, cb = self.cum_fwd[t], self.cum_bwd[t]
        scale = 2.0 if recompute else 1.0
        hi = scale * cf[b] + cb[b]
        lo = scale * cf[a] + cb[a]
        if nxt is not None:
            out = self.wire_out[b - 1]
            hi = hi + np.where(out > 0, nxt.latency + out / nxt.bandwidth, 0.0)
        if prev is not None:
            inb = self.wire_in[a]
            lo = lo - np.where(inb > 0, prev.latency + inb / prev.bandwidth, 0.0)
        comp = hi - lo
        n = min(nm, num_stages - k)
        copies = self.weight_copies(n)
        if recompute:
            mhi = self.cum_state[b] + copies * self.cum_param[b] + self.cum_stash[b]
            mlo = self.cum_state[a] + copies * self.cum_param[a] + self.cum_stash[a] - n * self.in_bytes[a]
        else:
            mhi = self.cum_state[b] + copies * self.cum_param[b] + n * self.cum_stash[b]
            mlo = self.cum_state[a] + copies * self.cum_param[a] + n * self.cum_stash[a]
        mem = (mhi - mlo) + self.ws_max(a, np.maximum(b, a + 1) if self._dense is None else b)
        for owner, next_user, nbytes, opt in self.ties:
            held = (a > owner) & (next_user[np.minimum(a, self.num_layers)] < b)
            mem = mem + np.where(held, (2 + copies) * nbytes + opt, 0.0)
        return comp, mem

    def stage(self, stage_dev: StageDevice, k: int, num_stages: int, nm: int, a: int, b: int,
              prev: Optional[LinkCost], nxt: Optional[LinkCost], recompute: bool) -> Tuple[float, int]:
        """(time, memory bytes) of one stage."""
        c, m = self.stage_arrays(stage_dev, k, num_stages, nm, np.array(a), np.array(b), prev, nxt, recompute)
        return float(c), int(round(float(m)))

    def compute_times(self, device_type: str, a: int, b: int, recompute: bool) -> Tuple[float, float]:
        """(fwd, bwd) seconds of layers [a, b) on ``device_type``; bwd includes recomputation."""
        f = float(self.cum_fwd[device_type][b] - self.cum_fwd[device_type][a])
        bw = float(self.cum_bwd[device_type][b] - self.cum_bwd[device_type][a])
        return f, bw + (f if recompute else 0.0)

    def send_time(self, b: int, link: Optional[LinkCost]) -> float:
        """Seconds to send the output activation of layer ``b-1`` over ``link`` (0 without one)."""
        return 0.0 if link is None else link.time(float(self.wire_out[b - 1]))

    def weight_copies(self, in_flight: int) -> int:
        """Parameter-sized buffers a stage holds beyond its weights, gradients and optimizer state,
        with ``in_flight`` minibatches in flight: a stash and its gradient per minibatch, and
        ``D + 2`` wave deltas."""
        return 2 * in_flight + self.d + 2

    def min_layer_bytes(self, layer: int) -> int:
        """The least memory layer ``layer`` needs anywhere: alone, as a last stage (one minibatch in
        flight, so one weight stash and its gradient, plus the wave deltas)."""
        a = np.array(layer)
        stash = self.cum_stash[layer + 1] - self.cum_stash[layer]
        copies = self.weight_copies(1) * float(self.param_bytes[layer])
        return int(self.cum_state[layer + 1] - self.cum_state[layer] + copies + self.ws_max(a, a + 1) + stash)

    def min_model_bytes(self) -> int:
        """The least memory the whole model needs over all devices together: every layer's state,
        one weight stash and its gradient, and the wave deltas (activations and workspace left out)."""
        return int(self.cum_state[-1] + self.weight_copies(1) * self.cum_param[-1])


def stage_matrix(table: LayerTable, stage_dev: StageDevice, k: int, num_stages: int, nm: int, starts: np.ndarray,
                 stops: np.ndarray, prev: Optional[LinkCost], nxt: Optional[LinkCost], mode: str,
                 capacity: float) -> Tuple[np.ndarray, np.ndarray]:
    """Stage ``k`` on ``stage_dev`` for every start in ``starts`` (rows) and stop in ``stops`` (columns):
    (seconds, recompute flags), seconds ``+inf`` where the range is empty or does not fit
    ``capacity`` bytes. Mode ``none`` or ``all`` fixes recomputation; ``fit`` recomputes only where
    keeping the activations would not fit (recomputing is never faster)."""
    a, b = starts[:, None], stops[None, :]
    invalid = b <= a
    best = rc = None
    for r in ([False, True] if mode == "fit" else [mode == "all"]):
        t, m = table.stage_arrays(stage_dev, k, num_stages, nm, a, b, prev, nxt, r)
        t = np.where(invalid | (m > capacity), np.inf, t)
        if best is None:
            best, rc = t, np.full(t.shape, r)
        else:
            better = t < best
            best = np.where(better, t, best)
            rc = np.where(better, r, rc)
    return best, rc


def reference_times(table: LayerTable, device_type: str) -> Sequence[float]:
    """Per-layer fwd + bwd seconds on one type."""
    return np.diff(table.cum_fwd[device_type]) + np.diff(table.cum_bwd[device_type])
