"""hetpipe.hf.Trainer against Hugging Face's own Trainer: the optimizer it builds (class, settings,
which parameters decay), the schedule's learning rates step by step, the settings each
TrainingArguments field becomes, the arguments it refuses in one line; checkpoints every so many
steps; the best evaluation point a run remembers; and the recipe's move, one line."""

import difflib
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hetpipe.hf import KEEP_ALL, Trainer  # noqa: E402
from hetpipe.run.callbacks import BestEvaluation, EvalInfo  # noqa: E402
from hetpipe.run.checkpoints import RunCheckpoints  # noqa: E402
from hetpipe.run.config import Checkpointing  # noqa: E402
from hetpipe.util.errors import ArgumentError  # noqa: E402

ROOT = Path(__file__).parents[2]


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class Samples(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(n))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), num_train_epochs=3, per_device_train_batch_size=4,
                learning_rate=3e-3, weight_decay=0.1, warmup_steps=5, lr_scheduler_type="cosine", report_to="none",
                save_strategy="no", seed=7)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def hf_optimizer_and_schedule(tmp_path, model, **kw):
    """What Hugging Face's Trainer itself builds for these arguments, and the run's steps it sizes for."""
    a = args(tmp_path, **kw)
    hf = transformers.Trainer(model=model, args=a, train_dataset=Samples(40))
    steps = a.num_train_epochs * max(len(hf.get_train_dataloader()) // a.gradient_accumulation_steps, 1)
    hf.create_optimizer_and_scheduler(num_training_steps=steps)
    return hf.optimizer, hf.lr_scheduler, steps


def group_names(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]


@pytest.mark.parametrize("kw", [{},
                                {"lr_scheduler_type": "linear", "warmup_steps": 0.2, "gradient_accumulation_steps": 2},
                                {"optim": "adamw_torch", "adam_beta2": 0.95, "weight_decay": 0.0}])
def test_the_optimizer_and_schedule_are_hugging_faces(tmp_path, kw):
    ref_model = gpt2()
    ref_opt, ref_sched, steps = hf_optimizer_and_schedule(tmp_path, ref_model, **kw)
    model = gpt2()
    ours = Trainer(model=model, args=args(tmp_path, **kw), train_dataset=Samples(40))
    opt = ours.create_optimizer()
    assert type(opt) is type(ref_opt)
    assert group_names(model, opt) == group_names(ref_model, ref_opt)
    assert any("bias" in n or "ln_" in n for n in group_names(model, opt)[1])
    for g, r in zip(opt.param_groups, ref_opt.param_groups):
        # The reference's schedule is attached already: its groups' lr is the first step's, initial_lr the set one.
        assert g["lr"] == r["initial_lr"]
        same = set(r) - {"params", "lr", "initial_lr"}
        assert {k: g[k] for k in same} == {k: r[k] for k in same}
    assert ours.num_training_steps(ours.train_loader()) == steps
    sched = ours.scheduler_factory(steps)(opt)
    lrs, ref_lrs = [], []
    for _ in range(steps):
        lrs.append(sched.get_last_lr())
        ref_lrs.append(ref_sched.get_last_lr())
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
    assert lrs == ref_lrs and lrs[0] != lrs[-1]


def test_the_arguments_become_the_run_s_sections(tmp_path):
    a = args(tmp_path, bf16=True, use_cpu=True, max_grad_norm=0.5, gradient_accumulation_steps=2, eval_strategy="steps",
             eval_steps=6, save_strategy="steps", save_steps=4, save_total_limit=3, report_to="tensorboard",
             disable_tqdm=True)
    stop = transformers.EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.01)
    t = Trainer(model=gpt2(), args=a, train_dataset=Samples(40), eval_dataset=Samples(12), callbacks=[stop])
    kw = t.sections()
    num, rep, ck = kw["numerics"], kw["reporting"], kw["checkpointing"]
    assert (num.precision, num.seed, num.accumulate, num.clip_grad_norm) == ("bf16", 7, 2, 0.5)
    assert kw["epochs"] == 3 and kw["loss_fn"] is None and len(kw["data"]) == 10
    assert rep.eval_every_steps == 6 and len(rep.eval_data) == 12 // 8 + 1 and rep.progress is False
    assert rep.tensorboard == tmp_path / "out" / "runs" and rep.metrics == tmp_path / "out" / "metrics.jsonl"
    (es,) = rep.callbacks
    assert (es.patience, es.min_delta) == (2, 0.01)
    assert (ck.dir, ck.every_steps, ck.keep, ck.resume) == (tmp_path / "out" / "checkpoints", 4, 3, None)
    # eval_steps as a fraction of the run's steps (15 here), and epochs.
    kw = Trainer(model=gpt2(), args=args(tmp_path, eval_strategy="steps", eval_steps=0.2, save_strategy="epoch"),
                 train_dataset=Samples(40), eval_dataset=Samples(8)).sections()
    assert kw["reporting"].eval_every_steps == 6 and kw["checkpointing"].every_steps == 10


def test_the_best_model_at_the_end_checkpoints_at_every_evaluation_and_keeps_them(tmp_path):
    a = args(tmp_path, eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=8,
             load_best_model_at_end=True, metric_for_best_model="eval_loss", save_total_limit=1)
    kw = Trainer(model=gpt2(), args=a, train_dataset=Samples(40), eval_dataset=Samples(8)).sections()
    assert kw["checkpointing"].every_steps == 4 and kw["checkpointing"].keep == KEEP_ALL
    assert any(isinstance(cb, BestEvaluation) for cb in kw["reporting"].callbacks)


def test_resume_from_checkpoint_true_needs_a_checkpoint(tmp_path):
    t = Trainer(model=gpt2(), args=args(tmp_path, save_strategy="steps", save_steps=5), train_dataset=Samples(40))
    with pytest.raises(ArgumentError, match="resume_from_checkpoint=True.*holds no checkpoint"):
        t.sections(resume_from_checkpoint=True)
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    assert t.sections(resume_from_checkpoint=True)["checkpointing"].resume == tmp_path / "out" / "checkpoints"


class Printer(transformers.TrainerCallback):
    pass


REFUSED = [
    ("max_steps", {"args": {"max_steps": 10}}, "max_steps=10"),
    ("fractional epochs", {"args": {"num_train_epochs": 1.5}}, "num_train_epochs=1.5"),
    ("another reporter", {"args": {"report_to": "wandb"}}, "report_to"),
    ("a metric", {"args": {"metric_for_best_model": "accuracy"}}, "metric_for_best_model='accuracy'"),
    ("eval without data", {"args": {"eval_strategy": "steps", "eval_steps": 4}, "eval_dataset": None}, "eval_dataset"),
    ("compute_metrics", {"compute_metrics": lambda p: {}}, "compute_metrics"),
    ("another callback", {"callbacks": [Printer()]}, "Printer"),
    ("a scheduler object", {"optimizers": (None, object())}, "scheduler object"),
]


@pytest.mark.parametrize("name,given,culprit", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_it_cannot_honour_is_refused_in_one_line(tmp_path, name, given, culprit):
    kw = dict(model=gpt2(), train_dataset=Samples(40), eval_dataset=Samples(8))
    kw.update({k: v for k, v in given.items() if k != "args"})
    if "eval_dataset" in given:
        kw["eval_dataset"] = given["eval_dataset"]
    with pytest.raises(ArgumentError) as e:
        Trainer(args=args(tmp_path, **given.get("args", {})), **kw)
    text = str(e.value)
    assert culprit in text and "\n" not in text and text.startswith("hetpipe.hf.Trainer: ")


def test_checkpoints_every_so_many_steps_round_to_whole_waves():
    with pytest.raises(ArgumentError, match="every .* or every_steps"):
        Checkpointing(dir="c", every=2, every_steps=8)
    run = RunCheckpoints([], None, 1, 0, 0, {}, Path("c"), 1, None, False, every_steps=20, accumulate=2)
    plan = types.SimpleNamespace(minibatches_per_wave=4 * 3)     # Nm 4, 3 VWs: 4 x 3 / 2 = 6 steps per wave
    assert run.waves_between(plan) == 3
    run.every_steps = 2
    assert run.waves_between(plan) == 1
    run.every_steps = None
    assert run.waves_between(plan) == 1


def test_the_best_evaluation_is_remembered_across_a_resume():
    best = BestEvaluation()
    points = [(0, 3.0), (1, 2.5), (2, 2.7), (3, 2.4), (4, 2.6)]
    for wave, loss in points[:3]:
        assert best.on_eval(EvalInfo(wave, loss, None, 8, 0.0)) is False
    resumed = BestEvaluation()
    resumed.load_state_dict(best.state_dict())
    for wave, loss in points[3:]:
        resumed.on_eval(EvalInfo(wave, loss, None, 8, 0.0))
    assert (resumed.best, resumed.wave) == min((loss, wave) for wave, loss in points)


def test_the_hugging_face_recipe_moves_by_its_import():
    """examples/hf_recipe: the script written for Hugging Face's Trainer and its hetpipe twin differ in
    one line, the Trainer's import."""
    plain = (ROOT / "examples" / "hf_recipe" / "plain.py").read_text().splitlines()
    moved = (ROOT / "examples" / "hf_recipe" / "train.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(plain, moved, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-from transformers import Trainer", "+from hetpipe.hf import Trainer"]
