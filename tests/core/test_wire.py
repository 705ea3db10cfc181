"""The C++ side of the wire protocol (csrc/include/hetpipe/wire.h, used by the core's MPI services) is
the Python definition (hetpipe.transport.protocol): every kind, tag, dtype code and header field."""

import numpy as np
import pytest

import hetpipe_core
from hetpipe.transport import protocol

KINDS = ("ACT", "GRAD", "PUSH", "PULL", "WEIGHTS", "DONE", "TIED", "NORM", "EVAL", "VERDICT")


def test_constants_match_python():
    w = hetpipe_core.wire_protocol()
    assert w["header_words"] == protocol.HEADER_WORDS
    assert w["max_ndim"] == protocol.MAX_NDIM
    assert w["kinds"] == {k: getattr(protocol, k) for k in KINDS}
    assert set(w["kinds"].values()) == set(protocol.KIND_NAMES), "a kind exists on one side only"
    assert tuple(w["dtypes"]) == protocol.DTYPES
    assert w["tags"] == {k: (2 * getattr(protocol, k), 2 * getattr(protocol, k) + 1) for k in KINDS}
    assert w["stopped"] == protocol.STOPPED


def test_header_fields_match_python_encoding():
    """Each word index the C++ side reads holds what Header.encode writes there."""
    kind, vw, stage, mb, aux, dtype, ndim, nbytes, shape = hetpipe_core.wire_protocol()["fields"]
    h = protocol.Header(protocol.PUSH, vw=2, stage=3, mb=5, aux=7, dtype="bfloat16", shape=(11, 13), nbytes=286)
    words = h.encode()
    assert words.dtype == np.int64 and words.size == protocol.HEADER_WORDS
    assert words[kind] == protocol.PUSH and words[vw] == 2 and words[stage] == 3 and words[mb] == 5
    assert words[aux] == 7 and words[ndim] == 2 and words[nbytes] == 286
    assert hetpipe_core.wire_protocol()["dtypes"][words[dtype] - 1] == "bfloat16"
    assert list(words[shape:shape + 2]) == [11, 13]


def test_chunk_word_and_default_match_python():
    w = hetpipe_core.wire_protocol()
    assert w["chunk_word"] == protocol.CHUNK_WORD == protocol.HEADER_WORDS - 1
    assert w["default_chunk_bytes"] == protocol.DEFAULT_CHUNK_BYTES
    # The chunk word lies past the shape words of the largest rank a header carries.
    assert w["fields"][-1] + protocol.MAX_NDIM == protocol.CHUNK_WORD


def test_a_rank_7_shape_keeps_the_chunk_word_free_and_rank_8_is_refused():
    h = protocol.Header(protocol.ACT, 0, 0, shape=(2, 3, 4, 5, 6, 7, 8), nbytes=40320)
    words = h.encode()
    assert words[protocol.CHUNK_WORD] == 0 and protocol.cut(words, 1000) == 1000
    assert words[protocol.CHUNK_WORD] == 1000 and protocol.Header.decode(words) == h
    with pytest.raises(ValueError, match="rank > 7"):
        protocol.Header(protocol.ACT, 0, 0, shape=(1,) * 8).encode()
