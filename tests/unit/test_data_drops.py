"""Minibatches a run cannot train are never dropped without a word: an epoch whose minibatches are not
a multiple of the VWs is said once, in one line naming the counts; one with fewer minibatches than VWs
is refused; a multiple trains every minibatch. Checked against the losses the replay reports."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import Tagged, cross_entropy, mlp, sgd, two_vw_plan  # noqa: E402
from hetpipe.loader.source import dealt, dropped_note  # noqa: E402
from hetpipe.run.config import Reporting  # noqa: E402
from hetpipe.run.data import Batches  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402


def _replay(minibatches, epochs=1):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * minibatches, 64, generator=g), torch.randint(0, 10, (4 * minibatches,), generator=g)
    plan = two_vw_plan(([2, 4], [3]), (1.0, 1.0), nm=2, d=0)
    return Trainer(mlp(), cross_entropy, sgd(), Batches(x, y, 4, shuffle=False), plan=plan, epochs=epochs,
                   reporting=Reporting(progress=False)).replay()


def test_an_epoch_beyond_a_multiple_of_the_vws_says_what_it_drops(capfd):
    result = _replay(5, epochs=2)
    assert sum(len(per) for per in result.losses.values()) == 8       # 2 a VW an epoch, the 5th unused
    err = capfd.readouterr().err
    assert err == ("hetpipe: the data has 5 minibatches per epoch; of the 10 this run has to train, 8 are trained and "
                   "2 dropped: each of the 2 virtual workers trains the same number of an epoch's minibatches (in "
                   "waves of nm=2 per VW), so those beyond a multiple of 2 go unused; give an epoch a multiple of 2 "
                   "minibatches (of 4 for whole waves)\n")


@pytest.mark.parametrize("minibatches", [8, 6])
def test_a_multiple_of_the_vws_trains_everything_silently(capfd, minibatches):
    """8 = two whole waves of 2 VWs x nm 2; 6 = 3 a VW, the last wave short (trained, not dropped)."""
    result = _replay(minibatches)
    assert {vw: sorted(per) for vw, per in result.losses.items()} == {v: list(range(minibatches // 2)) for v in (0, 1)}
    assert capfd.readouterr().err == ""


def test_fewer_minibatches_than_vws_is_refused_naming_the_counts():
    with pytest.raises(ValueError) as e:
        _replay(1)
    assert str(e.value) == ("hetpipe: the data has 1 minibatch(es) per epoch, fewer than the 2 virtual workers, each "
                            "of which trains an equal share of an epoch (a wave is nm=2 minibatches per VW, 4 in all): "
                            "give an epoch at least 2 minibatches (a multiple of 4 for whole waves)")


def test_a_resume_into_more_vws_says_what_it_drops():
    """640 samples in minibatches of 16, resumed into 3 VWs at the start of epoch 1 of 2: 39 of the 40
    minibatches are trained (624 samples), the 40th dropped; resumed mid-epoch, the rest of that epoch
    is dealt to the 3 VWs too."""
    assert dealt(40, 3, 2, 1, 0) == (39, 1)
    note = dropped_note(40, 3, 2, 2, 1, 0)
    assert note is not None and "of the 40 this run has to train from minibatch 0 of epoch 1, 39 are trained and 1 " \
                                "dropped" in note and "a multiple of 3 minibatches (of 6 for whole waves)" in note
    assert dealt(40, 3, 2, 0, 20) == (18 + 39, 2 + 1)
    assert dealt(40, 2, 2, 0, 20) == (60, 0) and dropped_note(40, 2, 2, 2, 0, 20) is None
    # Brute force: every minibatch of every epoch is either trained by exactly one VW or counted dropped.
    from hetpipe.loader.source import vw_epochs

    for per_epoch in range(3, 30):
        for vws in (1, 2, 3, 4):
            if per_epoch < vws:
                continue
            for start in range(0, per_epoch, 3):
                got = sum(len(r) for v in range(vws) for _, r in vw_epochs(per_epoch, vws, v, 2, 0, start))
                trained, dropped = dealt(per_epoch, vws, 2, 0, start)
                assert (trained, trained + dropped) == (got, 2 * per_epoch - start)


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (2, 4), (4, 3), (1, 3), (3, 3)])
def test_a_resume_into_other_vws_drops_only_what_they_cannot_share_and_names_it(old, new):
    """A run of ``old`` VWs cut after each possible count of minibatches per VW, resumed into ``new`` VWs
    through the data cursor (``DataPosition``) and the VWs' own streams: every minibatch is trained once,
    but the fewer than ``new`` of the epoch resumed that the new VWs cannot share evenly, and each later
    epoch's usual tail; those are exactly the minibatches the start-up line names. Before, the epoch
    resumed was dealt only up to the multiple of ``new`` counted from 0: 2 VWs cut at minibatch 10 of 40,
    resumed into 3, dropped minibatches 37..39, though the 30 left share evenly."""
    from hetpipe.checkpoint.format import DataPosition
    from hetpipe.loader import StreamSource
    from hetpipe.loader.source import unused, which

    for per_epoch in (40, 41, 17):
        for epochs in (1, 2):
            data = Tagged(per_epoch)
            runs = [list(StreamSource(data).vw_stream(v, old, epochs)) for v in range(old)]
            for q in range(0, len(runs[0]) + 1):
                consumed = {b for r in runs for b, _ in r[:q]}
                pos = DataPosition().advance(q, per_epoch, old)
                rest = [[b for b, _ in StreamSource(data).vw_stream(v, new, epochs, pos.epoch, pos.index)]
                        for v in range(new)]
                assert all(len(r) == pos.per_vw(per_epoch, new, epochs) for r in rest)
                seen = [b for r in rest for b in r]
                assert len(seen) == len(set(seen)) and not consumed & set(seen)
                left = unused(per_epoch, new, epochs, pos.epoch, pos.index)
                # Global minibatch j of epoch e is the data's item order(e)[j].
                named = {(e, data.order(e)[j]) for e, r in left for j in r}
                before = {(e, data.order(e)[j]) for e, r in unused(per_epoch, old, min(pos.epoch, epochs)) for j in r}
                everything = {(e, i) for e in range(epochs) for i in range(per_epoch)}
                assert everything - consumed - set(seen) == named | before
                if pos.epoch < epochs:
                    assert sum(len(r) for e, r in left if e == pos.epoch) == (per_epoch - pos.index) % new
                note = dropped_note(per_epoch, new, 2, epochs, pos.epoch, pos.index)
                assert (note is None) == (not named)
                if note is not None and (pos.epoch, pos.index) != (0, 0):
                    assert f"dropped ({which(left)})" in note
    if (old, new) == (2, 3):
        cut = DataPosition().advance(5, 40, 2)
        assert (cut.epoch, cut.index) == (0, 10) and unused(40, 3, 1, 0, 10) == []
        assert dealt(40, 3, 1, 0, 10) == (30, 0) and dropped_note(40, 3, 2, 1, 0, 10) is None
