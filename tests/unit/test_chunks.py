"""How a payload is cut into MPI messages (hetpipe.transport.protocol.chunks, cut, chunk_bytes): every
byte in exactly one chunk, in order, none above the chunk size; the sender's size written into the
header; the environment variable checked."""

import numpy as np
import pytest

from hetpipe.transport import protocol


@pytest.mark.parametrize("nbytes, chunk", [(0, 0), (1, 0), (10, 0), (10, 10), (10, 11), (11, 10), (100, 7),
                                           (1 << 20, 4096), ((1 << 20) + 3, 4096), (5, 1)])
def test_chunks_cover_the_payload_once_in_order(nbytes, chunk):
    pieces = protocol.chunks(nbytes, chunk)
    assert pieces[0][0] == 0 and sum(n for _, n in pieces) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    if chunk > 0:
        assert all(0 < n <= chunk for _, n in pieces) or nbytes == 0
        assert len(pieces) == max(1, -(-nbytes // chunk))
    else:
        assert pieces == [(0, nbytes)]


def test_cut_writes_the_chunk_size_only_when_the_payload_is_larger():
    words = protocol.Header(protocol.PUSH, 0, 0, -1, 3, "float32", (1000,), 4000).encode()
    assert protocol.cut(words, 4096) == 0 and words[protocol.CHUNK_WORD] == 0
    assert protocol.cut(words, 4000) == 0
    assert protocol.cut(words, 1024) == 1024 and words[protocol.CHUNK_WORD] == 1024
    assert protocol.cut(words, 0) == 0 and words[protocol.CHUNK_WORD] == 0
    # Reassembling the chunks of a buffer gives the buffer back.
    data = np.random.default_rng(0).integers(0, 255, size=4000, dtype=np.uint8)
    out = np.zeros_like(data)
    for off, n in protocol.chunks(4000, 1024):
        out[off:off + n] = data[off:off + n]
    assert np.array_equal(out, data)


def test_chunk_bytes_reads_the_environment(monkeypatch):
    monkeypatch.delenv(protocol.CHUNK_ENV, raising=False)
    assert protocol.chunk_bytes() == protocol.DEFAULT_CHUNK_BYTES
    monkeypatch.setenv(protocol.CHUNK_ENV, "0")
    assert protocol.chunk_bytes() == 0
    monkeypatch.setenv(protocol.CHUNK_ENV, " 8388608 ")
    assert protocol.chunk_bytes() == 8 << 20
    for bad in ("-1", "8M", "1.5"):
        monkeypatch.setenv(protocol.CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=protocol.CHUNK_ENV):
            protocol.chunk_bytes()
