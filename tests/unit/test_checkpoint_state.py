"""LR schedulers and grouped optimizer state through a checkpoint's files, against plain PyTorch: the
same scheduler never interrupted, and the optimizer that was never saved."""

import json
import math
import random
import threading

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
from hetpipe.checkpoint import statejson

BEFORE, AFTER = 7, 12           # steps before the checkpoint, and after the resume


def _warmup_then_linear(warmup, total):
    """A LambdaLR over a closure: its function is not state, the factory builds it again."""
    def factor(step):
        return step / warmup if step < warmup else max(0.0, (total - step) / (total - warmup))
    return lambda opt: L.LambdaLR(opt, factor)


class _Decaying:
    """A callable object whose attributes change as it is called: LambdaLR saves its ``__dict__``."""

    def __init__(self, rate):
        self.rate, self.calls, self.seen = rate, 0, (0, -1.0)

    def __call__(self, step):
        self.calls += 1
        self.seen = (step, self.rate ** self.calls)
        return self.rate ** self.calls


def _transformers(name):
    def make(opt):
        transformers = pytest.importorskip("transformers")
        return getattr(transformers, name)(opt, num_warmup_steps=3, num_training_steps=BEFORE + AFTER)
    return make


SCHEDULERS = {
    "one-cycle": lambda opt: L.OneCycleLR(opt, max_lr=[1.0, 0.5], total_steps=BEFORE + AFTER + 1),
    "sequential": lambda opt: L.SequentialLR(opt, [L.LinearLR(opt, 0.1, total_iters=4), L.CosineAnnealingLR(opt, 9)],
                                             milestones=[4]),
    "chained": lambda opt: L.ChainedScheduler([L.ConstantLR(opt, 0.5, total_iters=9), L.ExponentialLR(opt, 0.9)],
                                              optimizer=opt),
    "warm-restarts": lambda opt: L.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=1e-3),
    "plateau": lambda opt: L.ReduceLROnPlateau(opt, factor=0.5, patience=1, cooldown=1),
    "hf-cosine": _transformers("get_cosine_schedule_with_warmup"),
    "hf-linear": _transformers("get_linear_schedule_with_warmup"),
    "lambda-closure": _warmup_then_linear(4, BEFORE + AFTER),
    "lambda-object": lambda opt: L.LambdaLR(opt, [_Decaying(0.9), _Decaying(0.8)]),
}

# A loss that plateaus now and then, for ReduceLROnPlateau (the others ignore it).
METRICS = [random.Random(5).choice([1.0, 0.9, 0.9, 0.8]) for _ in range(BEFORE + AFTER)]


def _optimizer():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(3))]
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.05}], lr=0.1, momentum=0.9)
    return opt, params


def _step(opt, params, sched, k):
    """Step ``k``: an optimizer step on a fixed loss, then the scheduler's; returns every group's options."""
    opt.zero_grad()
    sum((p ** 2).sum() for p in params).backward()
    opt.step()
    sched.step(METRICS[k]) if isinstance(sched, L.ReduceLROnPlateau) else sched.step()
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_resumes_exactly_through_the_checkpoint_files(tmp_path, name):
    """Stepped BEFORE times, saved through the checkpoint writer, read back, restored into a scheduler
    and optimizer the factories built again, and stepped AFTER more times: every group's lr (and the
    momentum OneCycleLR cycles) equals the uninterrupted scheduler's at every step, exactly."""
    make = SCHEDULERS[name]
    opt, params = _optimizer()
    reference = make(opt)
    want = [_step(opt, params, reference, k) for k in range(BEFORE + AFTER)]

    opt, params = _optimizer()
    sched = make(opt)
    for k in range(BEFORE):
        _step(opt, params, sched, k)
    keys = ["0.weight", "0.bias"]
    tensors, optimizer = ckpt.optimizer_snapshot(opt, params, keys)
    ckpt.write_tensors(tmp_path / "part.safetensors", tensors)
    ckfmt.write_json(tmp_path / "part.json", {"optimizer": optimizer, "lr_scheduler": ckpt.scheduler_snapshot(sched)})
    saved = ckfmt.read_part(tmp_path, "part")

    twins = [nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.SGD([{"params": twins[:1]}, {"params": twins[1:], "lr": 0.05}], lr=0.1, momentum=0.9)
    resumed = make(fresh)
    assert ckpt.restore_optimizer(fresh, twins, keys, saved["optimizer"]["groups"], saved["optimizer"]["scalars"],
                                  ckpt.read_tensors(tmp_path / "part.safetensors")) == 2
    ckpt.restore_scheduler(resumed, saved["lr_scheduler"])
    got = [_step(fresh, twins, resumed, k) for k in range(BEFORE, BEFORE + AFTER)]
    assert got == want[BEFORE:]
    assert resumed.get_last_lr() == reference.get_last_lr()


def test_a_callable_object_holding_what_a_checkpoint_cannot_hold_is_refused_in_one_line():
    class Guarded:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, step):
            return 1.0

    opt, _ = _optimizer()
    sched = L.LambdaLR(opt, [Guarded(), lambda step: 1.0])
    with pytest.raises(ckfmt.CheckpointError) as e:
        ckpt.scheduler_snapshot(sched)
    message = str(e.value)
    assert "\n" not in message and "LR scheduler LambdaLR" in message, message
    assert "['lr_lambdas'][0]['lock'] is a _thread.lock" in message, message


def test_state_json_round_trips_exactly():
    """What JSON cannot hold as itself (tuples, non-string keys, the reserved key, tensors of any dtype,
    inf, nan, big ints) comes back equal and of the same types through json.dumps/loads."""
    value = {
        "floats": [0.1, -0.0, math.inf, -math.inf, 1e-310, 2.0 ** 70],
        "ints": [0, -1, 2 ** 80],
        "nested": {"tuple": (1, (2.5, "x"), [None, True]), 3: "int key", (1, "a"): {2.0: [()]}},
        statejson.TAG: "a key that is the tag",
        "tensors": [torch.randn(2, 3, dtype=torch.float64), torch.tensor(7, dtype=torch.int64),
                    torch.randn(4).to(torch.bfloat16), torch.tensor([True, False]), torch.zeros(0, 3),
                    torch.arange(6, dtype=torch.float16).reshape(3, 2).t()],
        "code": print,
    }
    back = statejson.decode(json.loads(json.dumps(statejson.encode(value, "x"), allow_nan=True)))
    assert "code" not in back
    assert _same(back, {k: v for k, v in value.items() if k != "code"})
    nan = statejson.decode(json.loads(json.dumps(statejson.encode([math.nan], "x"), allow_nan=True)))
    assert math.isnan(nan[0])


def _same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


# --- optimizer state by name, across stage cuts --------------------------------------------------
def _layers():
    torch.manual_seed(3)
    return [nn.Linear(8, 8) for _ in range(4)]


def _named(layers, lo, hi):
    """The parameters of layers ``[lo, hi)`` under the model's names, in a stage's flat order."""
    return [(f"{l}.{n}", p) for l in range(lo, hi) for n, p in layers[l].named_parameters()]


def _grouped(named):
    """Decay on weights but those named ``*0.weight``; none on biases and those: group order differs from
    the flat order, and every parameter of a group has the shape of one in the other."""
    decay = [p for n, p in named if n.endswith("weight") and not n.endswith("0.weight")]
    rest = [p for n, p in named if not (n.endswith("weight") and not n.endswith("0.weight"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=0.01, betas=(0.8, 0.95))


def _train(layers, optimizers, steps):
    g = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        for opt in optimizers:
            opt.zero_grad()
        for layer in layers:
            x = torch.tanh(layer(x))
        x.pow(2).sum().backward()
        for opt in optimizers:
            opt.step()


def _group_of(opt, p):
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


@pytest.mark.parametrize("old_cuts, new_cuts", [([2], [1, 3]), ([1, 3], [])])
def test_grouped_optimizer_state_restores_by_name_into_another_stage_cut(old_cuts, new_cuts):
    """Two AdamW groups over four Linear(8, 8) layers, split into stages at ``old_cuts``, trained, their
    groups' learning rates moved apart (as a schedule would, alike on every stage), saved per stage;
    restored into stages cut at ``new_cuts``, each optimizer built by the same factory over its own
    parameters. Every parameter's exp_avg, exp_avg_sq and step, and every option of the group holding
    it (lr, weight_decay, betas, ...), equal those of the optimizer that was saved."""
    layers = _layers()
    bounds = [0, *old_cuts, 4]
    stages = [_named(layers, a, b) for a, b in zip(bounds, bounds[1:])]
    optimizers = [_grouped(named) for named in stages]
    _train(layers, optimizers, 3)
    tensors, groups, scalars = {}, [], {}
    for named, opt in zip(stages, optimizers):
        for i, g in enumerate(opt.param_groups):
            g["lr"] = 0.001 * (1 + 10 * i)
        t, part = ckpt.optimizer_snapshot(opt, [p for _, p in named], [n for n, _ in named])
        part = json.loads(json.dumps(part, allow_nan=True))
        tensors.update(t)
        groups += part["groups"]
        scalars.update(part["scalars"])

    twins = [nn.Linear(8, 8) for _ in range(4)]
    bounds = [0, *new_cuts, 4]
    for a, b in zip(bounds, bounds[1:]):
        named = _named(twins, a, b)
        fresh = _grouped(named)
        restored = ckpt.restore_optimizer(fresh, [p for _, p in named], [n for n, _ in named], groups, scalars,
                                          tensors)
        assert restored == len(named)
        for name, p in named:
            l, local = name.split(".")
            saved_p = getattr(layers[int(l)], local)
            ref = next(o for o in optimizers if any(q is saved_p for g in o.param_groups for q in g["params"]))
            want, got = ref.state[saved_p], fresh.state[p]
            assert set(got) == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(got[s], want[s]) for s in got), name
            options = {k: v for k, v in _group_of(fresh, p).items() if k != "params"}
            assert options == {k: v for k, v in _group_of(ref, saved_p).items() if k != "params"}, name


def test_a_stage_restores_by_the_model_names_and_reads_checkpoints_keyed_by_layer():
    """StageModels over layers that a model names ``enc.*``/``dec.*`` (not by position), grouped AdamW by
    name: their parts key the state by those names, and :meth:`Resume.restore_stage` gives stages of
    another cut each parameter's state; a part in the older format (``layer.name`` keys, numbered as
    the optimizer's groups list the parameters) still restores into its own plan's stage."""
    from hetpipe.model.layout import ModelLayout
    from hetpipe.model.names import model_names, named_params, param_names
    from hetpipe.stage.params import StageModel

    layers = _layers()
    source = nn.Module()
    source.enc, source.dec = nn.Sequential(*layers[:2]), nn.Sequential(*layers[2:])
    names, layout = param_names(model_names(source, layers)), ModelLayout(layers)
    factory = named_params(lambda named: _grouped(named))

    def stages(cuts):
        bounds = [0, *cuts, 4]
        return [StageModel(layers, a, b, nm=1, shard_layers={}, optimizer_factory=factory,
                           device=torch.device("cpu"), layout=layout, param_names=names)
                for a, b in zip(bounds, bounds[1:])]

    old = stages([2])
    _train([m for st in old for m in st.layers], [st.optimizer for st in old], 3)
    state_of = {n: st.optimizer.state[p] for st in old for n, p in zip(st.param_names, st.params)}
    assert sorted(state_of) == sorted(f"{half}.{i}.{kind}" for half in ("enc", "dec") for i in (0, 1)
                                      for kind in ("weight", "bias"))
    parts, tensors = {}, {}
    for s, st in enumerate(old):
        t, opt = ckpt.optimizer_snapshot(st.optimizer, st.params, st.param_names)
        parts[s] = {"role": "stage", "vw": 0, "stage": s, "optimizer": json.loads(json.dumps(opt))}
        tensors[s] = t
    manifest = {"plan": {"virtual_workers": [{}]}}
    resume = ckpt.Resume(ckpt.Checkpoint(None, manifest, parts, tensors), same_plan=False)
    for s, st in enumerate(stages([1, 3])):
        resume.restore_stage(st, layout, 0, s)
        for n, p in zip(st.param_names, st.params):
            assert all(torch.equal(st.optimizer.state[p][k], v) for k, v in state_of[n].items()), n

    # The older format: state index i of the optimizer's state_dict() under the i-th flat ``layer.name``.
    for s, st in enumerate(old):
        flat = [f"{l}.{n}" for l in range(st.start, st.stop) for n, _ in layout.owned[l]]
        sd = st.optimizer.state_dict()
        tensors[s] = {f"opt/{flat[i]}/{k}": v for i, state in sd["state"].items() for k, v in state.items()}
        groups = [{"weight_decay": g["weight_decay"], "keys": [flat[i] for i in g["params"]]}
                  for g in sd["param_groups"]]
        parts[s] = {**parts[s], "optimizer": {"groups": groups, "scalars": {}}}
    resume = ckpt.Resume(ckpt.Checkpoint(None, manifest, parts, tensors), same_plan=True)
    for s, st in enumerate(stages([2])):
        resume.restore_stage(st, layout, 0, s)
        for n, p in zip(st.param_names, st.params):
            assert all(torch.equal(st.optimizer.state[p][k], v) for k, v in state_of[n].items()), n
