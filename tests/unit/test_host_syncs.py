"""The stage's host-sync budget, enforced without a GPU (docs/design.md, "Host-device synchronisations").

The real stage executors of one VW (and its PS shard) run several waves over a loopback transport,
stepped here as the replay steps them, while :class:`host_syncs.HostSyncs` records every operation
that would make the host wait for a GPU; each is charged to the instruction the stage's trace shows
running at that time. The budget: at most one per minibatch and stage outside the wave boundaries
(Push, Pull, Done and VW 0's evaluation points), where the stage reads what it kept on the device
(its losses, its gradients' finiteness) with one synchronisation per wave.
"""

import collections
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

from host_syncs import HostSyncs  # noqa: E402
from hetpipe.run.build import build_shard, build_stage, shard_pool, stage_pool  # noqa: E402
from hetpipe.run.config import Numerics, Reporting  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.transport.loopback import LoopbackHub  # noqa: E402

BOUNDARY = {"PUSH", "PULL", "EVAL", "SV", "RV", "DONE"}
NM = 2
MINIBATCHES = 6                     # 3 waves


def _stepped(layers, loss_fn, data, plan, precision, device="cpu"):
    """Run ``plan`` (one VW) to its end on ``device`` with every part stepped in turn, as the replay
    does, recording the syncs. Returns, per stage, (syncs per minibatch outside the boundaries, syncs
    per wave at its boundaries, syncs outside any instruction), and the last stage's losses."""
    spec = Trainer(layers, loss_fn, sgd(), data, plan=plan, numerics=Numerics(precision=precision),
                   reporting=Reporting(progress=False)).spec(plan)
    for s in range(len(plan.virtual_workers[0].stages)):
        spec.devices[plan.rank_of(0, s)] = torch.device(device)
    hub, trace, t0 = LoopbackHub(), [], time.perf_counter()
    stages = []
    for s in range(len(plan.virtual_workers[0].stages)):
        pool = stage_pool(spec, 0, s)
        stages.append(build_stage(spec, 0, s, hub.endpoint(plan.rank_of(0, s), pool), pool, trace=trace, t0=t0))
    shards = []
    for sh in plan.ps_shards:
        pool = shard_pool(spec, sh.index)
        shards.append(build_shard(spec, sh.index, hub.endpoint(plan.ps_rank(sh.index), pool), pool))
    syncs = HostSyncs(host_reads=device == "cpu")
    with syncs.recording():
        while not all(p.finished for p in stages + shards):
            progressed = False
            for part in stages + shards:
                if not part.finished:
                    syncs.owner = part
                    progressed = part.step() or progressed
            syncs.owner = None
            # As the replay: a stage whose copies are in flight (a GPU's copy stream) waits for them.
            assert progressed or any(p.wait_for_copies() for p in stages), \
                [p.blocked_on for p in stages if not p.finished]
    charged = []
    for s, stage in enumerate(stages):
        events = [e for e in trace if e.stage == s]
        per_minibatch, per_wave, loose = collections.Counter(), collections.Counter(), []
        for sync in (x for x in syncs.syncs if x.owner is stage):
            at = sync.at - t0
            e = next((e for e in events if e.start_s <= at <= e.start_s + e.dur_s), None)
            if e is None:
                loose.append(sync.what)
            elif e.kind in BOUNDARY:
                per_wave[e.wave] += 1
            else:
                per_minibatch[e.mb] += 1
        charged.append((per_minibatch, per_wave, loose))
    return charged, stages[-1].losses


def _within_budget(charged, per_minibatch_budget):
    for s, (per_minibatch, per_wave, loose) in enumerate(charged):
        assert not loose, f"stage {s}: synchronisations outside any instruction: {loose}"
        assert max(per_minibatch.values(), default=0) <= per_minibatch_budget, f"stage {s}: {dict(per_minibatch)}"
        assert max(per_wave.values(), default=0) <= 1, f"stage {s}: at its wave boundaries {dict(per_wave)}"


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=16, vocab_size=50, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _tokens():
    """Token minibatches with their attention masks, the odd ones right-padded in one row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for p in range(MINIBATCHES):
        ids = torch.randint(0, 50, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        if p % 2:
            mask[0, 9:] = 0
        out.append(({"input_ids": ids, "attention_mask": mask}, ids))
    return out


@pytest.mark.parametrize("precision, device", [pytest.param("fp32", "cpu", marks=pytest.mark.slow), ("bf16", "cpu"),
                                               pytest.param("bf16", "cuda:0", marks=pytest.mark.gpu)])
def test_gpt2_stages_sync_at_most_once_per_minibatch_outside_wave_boundaries(precision, device):
    """Hugging Face GPT-2 (adapters.gpt2) in two stages of three layers, its head tied to the embedding
    across them: the one sync left per minibatch and stage is the causal mask's check for padding,
    which the model's own forward makes too, once for all its blocks (here: for each stage's two).
    On a GPU the copies to host memory are counted too (host_syncs)."""
    pytest.importorskip("transformers")
    from hetpipe.adapters import gpt2
    layers, loss_fn = gpt2(_gpt2())
    plan = one_vw_plan([3], nm=NM, d=0, num_layers=len(layers))
    charged, losses = _stepped(layers, loss_fn, _tokens(), plan, precision, device)
    _within_budget(charged, 1)
    assert sorted(losses) == list(range(MINIBATCHES))
    assert all(per_wave for _, per_wave, _ in charged), "the losses and checks are read at the boundaries"


def test_mlp_stages_never_sync_outside_wave_boundaries():
    """The stage's own machinery syncs nowhere per minibatch: three MLP stages make no sync at all
    outside their wave boundaries, and one at each Push, where their readings are read."""
    charged, losses = _stepped(mlp(), cross_entropy, synthetic(n=16 * MINIBATCHES), one_vw_plan([2, 4], nm=NM, d=0),
                               "fp32")
    _within_budget(charged, 0)
    assert all(sum(per_wave.values()) == MINIBATCHES // NM for _, per_wave, _ in charged), charged
    assert sorted(losses) == list(range(MINIBATCHES))


def _recorded(f):
    syncs = HostSyncs()
    with syncs.recording():
        f()
    return [s.what for s in syncs.syncs]


def test_the_recorder_sees_each_kind_of_sync_and_nothing_else():
    t = torch.arange(6.0)
    mask = t > 2
    syncing = [lambda: float(t.sum()), lambda: 1 if (t > 0).all() else 0, lambda: torch.equal(t, t),
               lambda: t.nonzero(), lambda: t[mask], lambda: t.unique(), lambda: t.tolist(),
               lambda: t.repeat_interleave(torch.ones(6, dtype=torch.long)), lambda: t.clone().__setitem__(mask, 0.0)]
    quiet = [lambda: t.sum() * 2, lambda: t[torch.tensor([1, 2])], lambda: t.to(torch.float64),
             lambda: torch.where(mask, t, 0.0), lambda: t.numpy(), lambda: t.cpu(), lambda: t.to("cpu")]
    for f in syncing + quiet:
        assert len(_recorded(f)) == (f in syncing), _recorded(f)


@pytest.mark.gpu
def test_the_recorder_sees_copies_to_the_host_of_device_tensors():
    t = torch.arange(6.0, device="cuda")
    for f in (lambda: t.cpu(), lambda: t.to("cpu"), lambda: t.to(device=torch.device("cpu")), lambda: t.tolist(),
              lambda: float(t.sum())):
        assert len(_recorded(f)) == 1, _recorded(f)
    assert _recorded(lambda: t.to("cuda")) == [] and _recorded(lambda: torch.ones(3).to("cuda")) == []
    beside = HostSyncs(host_reads=False)
    with beside.recording():
        float(torch.ones(3).sum()), torch.ones(3).tolist(), float(t.sum())
    assert [s.what for s in beside.syncs] == ["aten._local_scalar_dense.default"]
