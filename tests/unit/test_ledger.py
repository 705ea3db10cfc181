"""The wave ledger (ps/ledger.py) against the WSP rule written out by hand, and the same sequence of
steps, pushes and pulls in every array family (NumPy, torch, JAX) giving the same bits."""

import numpy as np
import pytest

from hetpipe.ps.ledger import LedgerLayout, WaveLedger

# A stage of layers 2..4 (sizes 3, 0, 2), shard 0 owning layers {2, 4} (two ranges), shard 1 owning
# layer 3 (no weights) and its 1 buffer element, and a 2-element replica owned by shard 1's layer 7.
LAYOUT = LedgerLayout.of_layers(2, 5, {2: 3, 3: 0, 4: 2}, {0: (2, 4), 1: (3, 7)}, {3: 1}, [(7, 2)])
# The same sizes with layer 3 holding one weight: shard 0's weights are two ranges, (0, 3) and (4, 6),
# gathered for a push and scattered by a pull; shard 1 pulls layer 3's weight, a replica and a buffer.
SPLIT = LedgerLayout.of_layers(2, 5, {2: 3, 3: 1, 4: 2}, {0: (2, 4), 1: (3, 7)}, {3: 1}, [(7, 1)])


def test_layout():
    assert LAYOUT.numel == 7 and LAYOUT.buffer_numel == 1
    assert LAYOUT.weights[0] == ((0, 5),) and LAYOUT.spans[0] == (0, 5)      # layers 2 and 4, layer 3 empty
    assert LAYOUT.replicas[1] == ((5, 7),) and LAYOUT.buffers[1] == ((0, 1),)
    assert LAYOUT.pulled_shards == [0, 1] and LAYOUT.pushed_shards == [0, 1]
    assert LAYOUT.pull_sizes(0) == (5, 0, 0) and LAYOUT.pull_sizes(1) == (0, 2, 1)


def test_a_layout_holds_ranges_not_positions():
    """Shards owning every other layer of a stage of 2 x 10^9 weights: a few ranges each (an index of
    positions would be 16 GB here), and the sizes a pull and a push carry."""
    big = 10**9
    layout = LedgerLayout.of_layers(0, 4, {0: big, 1: 5, 2: big, 3: 0}, {0: (0, 2), 1: (1, 3)}, {1: 4, 3: 2},
                                    [(2, 3), (9, 7), (0, 1)])
    assert layout.weights == {0: ((0, big), (big + 5, 2 * big + 5)), 1: ((big, big + 5),)}
    assert layout.spans == {1: (big, big + 5)}                  # shard 0's layers are not contiguous
    assert layout.replicas == {0: ((2 * big + 5, 2 * big + 8), (2 * big + 15, 2 * big + 16))}   # not layer 9's
    assert layout.buffers == {1: ((0, 6),)}                     # layers 1 and 3: adjacent, merged
    assert layout.pull_sizes(0) == (2 * big, 4, 0) and layout.push_size(1) == 5 + 6


def _script(make, to_np, layout=LAYOUT):
    """Steps of waves 0 and 1, Push(0), then a pull at g = 0 (wave 1's deltas are the stage's own): the
    weights and buffers it leaves, the payloads it sent."""
    rng = np.random.default_rng(0)
    w = make(rng.normal(size=7).astype(np.float32))
    b = make(np.asarray([0.5], np.float32))
    ledger = WaveLedger(layout, w, b)
    for wave in (0, 0, 1):
        after = ledger.weights + make(rng.normal(size=7).astype(np.float32))
        ledger.record_step(wave, after, ledger.weights)
        if ledger.ops.functional:
            ledger.weights = after
        else:
            ledger.weights[...] = after
        if wave == 0:                           # the forward moved the synced buffer by 1
            ledger.buffers = ledger.buffers + 1 if ledger.ops.functional else ledger.buffers.__iadd__(1)
    sent = [to_np(ledger.push_payload(0, k)) for k in (0, 1)]
    ledger.mark_pushed(0)
    with pytest.raises(RuntimeError, match="a step after Push"):
        ledger.record_step(0, ledger.weights, ledger.weights)
    reply0 = make(np.arange(5, dtype=np.float32))
    reply1 = make(np.asarray([10.0, 20.0, 3.0], np.float32))
    ledger.merge_pull({0: (1, reply0), 1: (1, reply1)})
    return to_np(ledger.weights), to_np(ledger.buffers), sent, ledger


def test_the_wsp_rule_by_hand():
    w, b, sent, ledger = _script(lambda a: a, lambda a: np.asarray(a))
    delta1 = ledger.deltas[1]
    assert sorted(ledger.deltas) == [1]          # wave 0 is in every shard's W_1: dropped
    np.testing.assert_array_equal(w[:5], np.arange(5, dtype=np.float32) + delta1[:5])
    np.testing.assert_array_equal(w[5:], np.asarray([10.0, 20.0], np.float32) + delta1[5:])
    # B_1 (3.0) plus the stage's own change since it pushed wave 0 (it pushed 2.5 and still holds 2.5)
    np.testing.assert_array_equal(b, [3.0])
    assert sent[0].shape == (5,) and sent[1].tolist() == [2.5]
    assert ledger.merges == 2


def test_a_split_shard_is_gathered_and_scattered_by_its_ranges():
    w, b, sent, ledger = _script(lambda a: a, lambda a: np.asarray(a), SPLIT)
    delta1 = ledger.deltas[1]
    assert SPLIT.weights[0] == ((0, 3), (4, 6)) and 0 not in SPLIT.spans
    mine = [0, 1, 2, 4, 5]
    np.testing.assert_array_equal(w[mine], np.arange(5, dtype=np.float32) + delta1[mine])
    np.testing.assert_array_equal(w[[3, 6]], np.asarray([10.0, 20.0], np.float32) + delta1[[3, 6]])
    assert sent[0].shape == (5,) and sent[1].shape == (2,)      # shard 1: layer 3's delta, then its buffer


@pytest.mark.parametrize("layout", [LAYOUT, SPLIT], ids=["contiguous", "split"])
def test_every_family_gives_the_same_bits(layout):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    ref = _script(lambda a: a, np.asarray, layout)
    for make, to_np in ((lambda a: torch.from_numpy(a.copy()), lambda t: t.numpy()),
                        (lambda a: jnp.asarray(a), np.asarray)):
        got = _script(make, to_np, layout)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])
        for a, b in zip(got[2], ref[2]):
            np.testing.assert_array_equal(a, b)


def test_a_vector_of_the_wrong_dtype_is_refused():
    with pytest.raises(ValueError, match=r"stage's weights must be a flat float32 vector of 7 elements"):
        WaveLedger(LAYOUT, np.zeros(7), np.zeros(1, np.float32))
