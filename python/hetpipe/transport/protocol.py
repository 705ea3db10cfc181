"""The wire protocol between ranks: message kinds, the 16-word header, wire dtypes, chunks, received messages.

This module is the protocol's one definition (csrc/include/hetpipe/wire.h mirrors it for the core and
tests/core/test_wire.py holds the two together). Every message is a :class:`Header` (16 int64 words)
followed, when ``nbytes > 0``, by the payload bytes; header and payload use two tags per message
kind (``2 * kind`` and ``2 * kind + 1``), and MPI's non-overtaking rule between one sender and one
receiver on one tag keeps payloads paired with their headers. Nothing on the data path is pickled.

**Chunks.** A payload larger than the sender's chunk size goes as consecutive MPI messages of at most
that many bytes on the payload tag (:func:`chunks`), in order; the header's last word
(``CHUNK_WORD``) says the size it was cut at (0: one message), so the receiver posts one receive
per chunk into the right offsets of one buffer and needs no agreement with the sender beforehand.
Each sender takes its size from ``HETPIPE_CHUNK_BYTES`` (:func:`chunk_bytes`). Chunks bound what one
MPI message moves, so a rendezvous of 330 MB is many transfers that progress one after the other
instead of one that MPI's progress engine must finish whole.
The endpoints that move messages: :mod:`hetpipe.transport.base` (the interface and its calling
contract), :mod:`~hetpipe.transport.mpi`, :mod:`~hetpipe.transport.loopback`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from hetpipe.util.errors import HetpipeError

ANY = -1
HEADER_WORDS = 16
# Words 0-7: kind, vw, stage, mb, aux, dtype code, ndim, nbytes; 8-14: the shape; 15: the chunk size.
MAX_NDIM = HEADER_WORDS - 9
CHUNK_WORD = HEADER_WORDS - 1
CHUNK_ENV = "HETPIPE_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 16 << 20

# Message kinds. Each kind has its own tags, so receives of different kinds never steal each other's messages.
ACT = 1         # stage s -> s + 1: output activation of minibatch mb
GRAD = 2        # stage s -> s - 1: gradient of the input activation of minibatch mb
PUSH = 3        # stage -> PS shard: the stage's wave delta for the shard's layers (aux = wave)
PULL = 4        # stage -> PS shard: request the global weights for wave aux (no payload)
WEIGHTS = 5     # PS shard -> stage: reply to PULL; mb = the pulled wave, aux = the shard's global clock g,
                # payload = W_g
DONE = 6        # stage -> PS shard: the stage finished its stream (no payload)
TIED = 7        # stage -> stage of its VW: the gradients of the tied parameters both hold, for minibatch mb
NORM = 8        # stage -> stage of its VW: its share of minibatch mb's squared gradient norm (aux = the
                # float64's bits; no payload)
EVAL = 9        # stage s -> s + 1 of VW 0: output activation of evaluation minibatch mb (aux as ACT's)
VERDICT = 10    # last stage of VW 0 -> its other stages: an evaluation point's outcome (mb = the wave, aux =
                # the wave after which the run stops, or -1; no payload)
KIND_NAMES = {ACT: "activation", GRAD: "gradient", PUSH: "push", PULL: "pull", WEIGHTS: "weights", DONE: "done",
              TIED: "tied gradient", NORM: "gradient-norm share", EVAL: "evaluation activation",
              VERDICT: "evaluation verdict"}
# A PUSH's ``mb`` word: -1, or the wave after which the run stops (an early stop, set by VW 0's stages);
# a WEIGHTS reply whose ``aux`` is STOPPED (no payload) answers a pull of a wave after that one.
STOPPED = -2

# Wire dtypes, by torch's names (``getattr(torch, name)``); a header carries the index + 1.
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}


class TransportError(HetpipeError, RuntimeError):
    """A message was lost or cannot be delivered."""


class MPITransferError(TransportError):
    """An MPI call of a core thread (a stage endpoint's or a PS shard's) failed: its peer is gone, or the
    network. Like mpi4py's ``MPI.Exception``, the fault of no code of this rank: reported in one line
    (``mpi_transfer``), and the launcher names the peer that died first."""

    mpi_transfer = True


class StageError(HetpipeError, RuntimeError):
    """A stage received something it cannot use (wrong shape, dtype or header)."""


@dataclass(frozen=True)
class Header:
    """What a message is: kind, sender's (vw, stage), minibatch, an auxiliary word, dtype and shape."""

    kind: int
    vw: int
    stage: int
    mb: int = -1
    aux: int = -1
    dtype: str = "uint8"
    shape: Tuple[int, ...] = ()
    nbytes: int = 0

    def encode(self) -> np.ndarray:
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"transport: tensors of rank > {MAX_NDIM} are not supported, got shape {self.shape}")
        words = np.zeros(HEADER_WORDS, dtype=np.int64)
        words[:8] = (self.kind, self.vw, self.stage, self.mb, self.aux, _DTYPE_CODE[self.dtype],
                     len(self.shape), self.nbytes)
        words[8:8 + len(self.shape)] = self.shape
        return words

    @classmethod
    def decode(cls, words: np.ndarray) -> "Header":
        # One conversion to Python ints (a per-word int() of numpy scalars costs several times more).
        w = words.tolist()
        kind, vw, stage, mb, aux, code, ndim, nbytes = w[:8]
        if not (1 <= code <= len(DTYPES)) or not (0 <= ndim <= MAX_NDIM) or nbytes < 0 or w[CHUNK_WORD] < 0:
            raise ValueError(f"transport: corrupt header {w}")
        return cls(kind, vw, stage, mb, aux, DTYPES[code - 1], tuple(w[8:8 + ndim]), nbytes)


def chunk_bytes() -> int:
    """This rank's chunk size in bytes: ``HETPIPE_CHUNK_BYTES`` (0: every payload in one message), else
    :data:`DEFAULT_CHUNK_BYTES`. ValueError naming the variable unless it is an integer >= 0."""
    text = os.environ.get(CHUNK_ENV, "").strip()
    if not text:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"hetpipe: {CHUNK_ENV} must be a number of bytes >= 0 (0: no chunks), got {text!r}")
    return value


def cut(words: np.ndarray, chunk: int) -> int:
    """Write into encoded header ``words`` the chunk size its payload is sent at, and return it: ``chunk``
    when the payload is larger, else 0 (one message)."""
    nbytes = int(words[7])
    at = chunk if 0 < chunk < nbytes else 0
    words[CHUNK_WORD] = at
    return at


def chunks(nbytes: int, chunk: int) -> List[Tuple[int, int]]:
    """The ``(offset, length)`` of each MPI message of a payload of ``nbytes`` cut at ``chunk`` bytes (the
    header's ``CHUNK_WORD``; 0: one message), in sending order."""
    if chunk <= 0 or nbytes <= chunk:
        return [(0, nbytes)]
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


@dataclass
class Message:
    """A received message. ``payload`` is a private copy of the bytes (the slot is already released),
    or, when ``slot`` is set, a view of that pool slot, owned by the receiver."""

    src: int
    header: Header
    payload: np.ndarray     # uint8, length header.nbytes
    slot: object = None


