"""Hugging Face's ``transformers.Trainer``, trained by hetpipe: a script written for HF's Trainer moves
by changing its import (``from hetpipe.hf import Trainer``) and is started with ``hetpipe launch``.

:class:`Trainer` reads the script's ``TrainingArguments`` and builds what HF's Trainer would build,
with HF's own helpers wherever it has one, then trains it with :class:`hetpipe.Trainer`:

* the optimizer: HF's choice for ``args.optim`` (``Trainer.get_optimizer_cls_and_kwargs``) over HF's two
  groups (``Trainer.get_decay_parameter_names``: no weight decay on biases and norms);
* the schedule: ``transformers.get_scheduler(args.lr_scheduler_type, ...)`` sized as HF sizes it
  (``epochs * len(loader) // gradient_accumulation_steps`` steps, ``args.get_warmup_steps``), counted in
  the run's steps (``Numerics.lr_scheduler_steps="run"``), so it spans the run at any number of VWs;
* the data: a shuffled ``DataLoader`` of ``per_device_train_batch_size`` through the data collator
  (``default_data_collator`` when none), dealt to the VWs by hetpipe; HF-style samples (mappings with
  ``labels``) and the model's own loss;
* ``max_grad_norm`` (clipping over each VW's whole model), ``gradient_accumulation_steps``, ``seed``,
  ``bf16`` / ``fp16``; evaluation every ``eval_steps`` (or each epoch) on ``eval_dataset``;
  ``EarlyStoppingCallback`` as :class:`hetpipe.EarlyStopping` (checkpointed); TensorBoard when
  ``report_to`` names it; checkpoints every ``save_steps`` (or each epoch) under
  ``output_dir/checkpoints``, and ``output_dir/metrics.jsonl``, both continued by a resumed run.

What a hetpipe run does differently, and why, is in docs/training.md ("Hugging Face's Trainer"): the
steps are rounded to whole waves; the VWs' updates meet at the parameter servers (the start-up line
says what that does per sample). Whatever it cannot honour is refused in one line naming the
argument, never ignored: ``max_steps``, a fractional ``num_train_epochs``, other callbacks and
reporters, ``compute_metrics``, a scheduler object.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hetpipe.run.callbacks import BestEvaluation
from hetpipe.util.errors import ArgumentError

# HF Trainer arguments this front end cannot honour: a non-None value is refused naming it.
_UNSUPPORTED = ("model_init", "compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics",
                "optimizer_cls_and_kwargs")
_STRATEGIES = ("no", "steps", "epoch")
KEEP_ALL = 1 << 30          # checkpointing.keep that keeps every complete checkpoint


def _refuse(text: str) -> ArgumentError:
    return ArgumentError(f"hetpipe.hf.Trainer: {text}")


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


class Trainer:
    """``transformers.Trainer``'s constructor and ``train`` / ``save_model`` / ``is_world_process_zero``,
    run by hetpipe (see the module docstring for what each argument becomes)."""

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: Optional[Sequence[Any]] = None,
                 optimizers: Tuple[Any, Any] = (None, None), **others: Any) -> None:
        from transformers import TrainingArguments

        unknown = sorted(k for k in others if k not in _UNSUPPORTED)
        if unknown:
            raise TypeError(f"hetpipe.hf.Trainer: unexpected argument(s) {', '.join(unknown)}")
        given = sorted(k for k, v in others.items() if v is not None)
        if given:
            raise _refuse(f"{', '.join(given)} is not supported (the run evaluates the loss of the model's own "
                          "forward); drop it")
        if model is None:
            raise _refuse("model is required (model_init is not supported)")
        if train_dataset is None:
            raise _refuse("train_dataset is required")
        self.model = model
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        self.data_collator = data_collator
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.optimizer, scheduler = optimizers
        if scheduler is not None:
            raise _refuse("optimizers=(optimizer, scheduler): a scheduler object is built over one process's "
                          "optimizer; give args.lr_scheduler_type (each stage builds its own)")
        self.callbacks = list(callbacks or [])
        self._check_args()
        self.early_stopping = self._early_stopping()
        self.best = BestEvaluation() if self.args.load_best_model_at_end else None
        self.result = None

    # -- what the arguments become ------------------------------------------------------------------

    def _check_args(self) -> None:
        a = self.args
        if a.max_steps is not None and a.max_steps > 0:
            raise _refuse(f"args.max_steps={a.max_steps}: a hetpipe run trains whole epochs; give "
                          "num_train_epochs instead")
        if a.num_train_epochs != int(a.num_train_epochs) or a.num_train_epochs < 1:
            raise _refuse(f"args.num_train_epochs={a.num_train_epochs}: a hetpipe run trains a whole number "
                          "(>= 1) of epochs")
        for name in ("eval_strategy", "save_strategy"):
            value = _strategy(getattr(a, name))
            if value not in _STRATEGIES:
                raise _refuse(f"args.{name}={value!r} is not supported; use one of {', '.join(_STRATEGIES)}")
        if _strategy(a.eval_strategy) != "no" and self.eval_dataset is None:
            raise _refuse(f"args.eval_strategy={_strategy(a.eval_strategy)!r} needs eval_dataset")
        reporters = [r for r in (a.report_to or []) if r not in ("none", "tensorboard")]
        if reporters:
            raise _refuse(f"args.report_to={reporters}: hetpipe reports to TensorBoard only (and to "
                          "output_dir/metrics.jsonl); give report_to=['tensorboard'] or 'none'")
        metric = a.metric_for_best_model
        if metric not in (None, "loss", "eval_loss"):
            raise _refuse(f"args.metric_for_best_model={metric!r}: hetpipe evaluates the loss only "
                          "(compute_metrics is not supported); use 'eval_loss'")

    def _early_stopping(self) -> Optional[Any]:
        from transformers import EarlyStoppingCallback

        from hetpipe.run.callbacks import EarlyStopping

        stop = None
        for cb in self.callbacks:
            if isinstance(cb, EarlyStoppingCallback):
                if _strategy(self.args.eval_strategy) == "no":
                    raise _refuse("EarlyStoppingCallback needs evaluations: set args.eval_strategy")
                stop = EarlyStopping(patience=int(cb.early_stopping_patience),
                                     min_delta=float(cb.early_stopping_threshold or 0.0))
            else:
                what = cb.__name__ if isinstance(cb, type) else type(cb).__name__
                raise _refuse(f"the callback {what} is not supported (EarlyStoppingCallback is; hetpipe "
                              "reports progress, metrics and TensorBoard itself)")
        return stop

    def _collator(self) -> Any:
        from transformers import default_data_collator

        return self.data_collator if self.data_collator is not None else default_data_collator

    def train_loader(self) -> Any:
        """The DataLoader HF's Trainer would train from: shuffled, ``per_device_train_batch_size``."""
        from torch.utils.data import DataLoader

        a = self.args
        return DataLoader(self.train_dataset, batch_size=a.per_device_train_batch_size, shuffle=True,
                          collate_fn=self._collator(), drop_last=a.dataloader_drop_last,
                          num_workers=a.dataloader_num_workers)

    def eval_loader(self) -> Optional[Any]:
        from torch.utils.data import DataLoader

        if self.eval_dataset is None or _strategy(self.args.eval_strategy) == "no":
            return None
        return DataLoader(self.eval_dataset, batch_size=self.args.per_device_eval_batch_size,
                          collate_fn=self._collator(), num_workers=self.args.dataloader_num_workers)

    def steps_per_epoch(self, loader: Any) -> int:
        """Optimizer steps per epoch as HF counts them (``len(loader) // gradient_accumulation_steps``)."""
        return max(len(loader) // self.args.gradient_accumulation_steps, 1)

    def num_training_steps(self, loader: Any) -> int:
        return int(self.args.num_train_epochs) * self.steps_per_epoch(loader)

    def create_optimizer(self) -> Any:
        """HF's default optimizer: ``args.optim``'s class and settings over two groups, with
        ``args.weight_decay`` on every parameter but biases and norms (HF's own choice of names)."""
        from transformers import Trainer as HFTrainer

        if self.optimizer is not None:
            return self.optimizer
        # get_decay_parameter_names reads nothing of the Trainer it is a method of: HF's rule, as HF has it.
        decay = set(HFTrainer.get_decay_parameter_names(None, self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        cls, kwargs = HFTrainer.get_optimizer_cls_and_kwargs(self.args, self.model)
        return cls(groups, **kwargs)

    def scheduler_factory(self, total_steps: int) -> Any:
        """``optimizer -> scheduler``: HF's ``get_scheduler`` for ``args.lr_scheduler_type``, sized as HF
        sizes it; each stage builds one over its own optimizer."""
        from transformers import get_scheduler

        a = self.args
        warmup = a.get_warmup_steps(total_steps)
        kind, extra = _strategy(a.lr_scheduler_type), dict(a.lr_scheduler_kwargs or {})

        def schedule(optimizer: Any) -> Any:
            return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                                 scheduler_specific_kwargs=extra)

        return schedule

    def _every(self, strategy: str, steps: Any, per_epoch: int, total: int) -> Optional[int]:
        """Optimizer steps between evaluations or checkpoints: HF's ``*_steps`` (a fraction < 1 of the
        run's steps), or one epoch; None for "no"."""
        if strategy == "no":
            return None
        if strategy == "epoch":
            return per_epoch
        return max(1, math.ceil(steps * total) if steps < 1 else int(steps))

    def sections(self, resume_from_checkpoint: Any = None) -> Dict[str, Any]:
        """The :class:`hetpipe.Trainer` arguments the script's arguments give."""
        from hetpipe.run.config import Checkpointing, Numerics, Reporting

        a = self.args
        loader = self.train_loader()
        per_epoch, total = self.steps_per_epoch(loader), self.num_training_steps(loader)
        out = Path(a.output_dir)
        precision = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
        clip = float(a.max_grad_norm) if a.max_grad_norm else None
        numerics = Numerics(precision=precision, seed=int(a.seed), accumulate=int(a.gradient_accumulation_steps),
                            clip_grad_norm=clip, lr_scheduler=self.scheduler_factory(total))
        eval_steps = self._every(_strategy(a.eval_strategy), a.eval_steps or a.logging_steps, per_epoch, total)
        tensorboard = out / "runs" if "tensorboard" in (a.report_to or []) else None
        callbacks = [cb for cb in (self.early_stopping, self.best) if cb is not None]
        reporting = Reporting(progress=not a.disable_tqdm, metrics=out / "metrics.jsonl", tensorboard=tensorboard,
                              eval_data=self.eval_loader() if eval_steps else None, eval_every_steps=eval_steps,
                              callbacks=callbacks)
        save_steps = self._every(_strategy(a.save_strategy), a.save_steps, per_epoch, total)
        keep = max(1, a.save_total_limit or 1)
        if self.best is not None:
            # A checkpoint at every evaluation point (the same steps round to the same waves), all kept:
            # the best one is loaded at the end.
            save_steps, keep = eval_steps, KEEP_ALL
        directory = out / "checkpoints" if save_steps else None
        if resume_from_checkpoint is True:
            if directory is None or not directory.exists():
                raise _refuse(f"resume_from_checkpoint=True, but {out / 'checkpoints'} holds no checkpoint")
            resume = directory
        else:
            resume = resume_from_checkpoint or None
        checkpointing = Checkpointing(dir=directory, every_steps=save_steps, keep=keep, resume=resume)
        return {"model": self.model, "loss_fn": None, "optimizer": self.create_optimizer(), "data": loader,
                "epochs": int(a.num_train_epochs), "numerics": numerics, "reporting": reporting,
                "checkpointing": checkpointing}

    # -- HF's Trainer API -----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, **unsupported: Any) -> Any:
        """Train on every rank (under ``hetpipe launch`` / ``mpiexec``); returns HF's ``TrainOutput``
        (the run's optimizer steps, its mean training loss, its figures) on every rank.
        ``resume_from_checkpoint``: True (the latest complete checkpoint under ``output_dir``) or a path;
        ``hetpipe launch --resume`` does the same without changing the script."""
        from transformers.trainer_utils import TrainOutput

        from hetpipe.run.trainer import Trainer as HetpipeTrainer

        if unsupported:
            raise TypeError(f"hetpipe.hf.Trainer.train: unexpected argument(s) {', '.join(sorted(unsupported))}")
        kw = self.sections(resume_from_checkpoint)
        trainer = HetpipeTrainer(kw.pop("model"), kw.pop("loss_fn"), kw.pop("optimizer"), kw.pop("data"), **kw)
        self.result = result = trainer.fit()
        if self.best is not None:
            self._load_best(trainer, kw["checkpointing"].dir)
        losses = [v for per_vw in result.losses.values() for v in per_vw.values()]
        steps = len(losses) // self.args.gradient_accumulation_steps
        mean = sum(losses) / len(losses) if losses else float("nan")
        metrics = {"train_runtime": result.elapsed_s, "train_samples_per_second": result.samples_per_s,
                   "train_steps_per_second": steps / result.elapsed_s if result.elapsed_s > 0 else 0.0,
                   "train_loss": mean, "epoch": float(self.args.num_train_epochs)}
        return TrainOutput(steps, mean, metrics)

    def _load_best(self, trainer: Any, directory: Path) -> None:
        """``load_best_model_at_end``: every rank loads the global weights of the checkpoint written at the
        best evaluation point (lowest loss, this run's and a resumed one's) into the model. VW 0
        evaluated its own live weights there; the checkpoint holds the run's global weights at that clock
        (docs/training.md, "Hugging Face's Trainer")."""
        from hetpipe.checkpoint.format import clock_dir
        from hetpipe.checkpoint.state import Checkpoint
        from hetpipe.job.world import world
        from hetpipe.model.weights import load_layer_weights

        # Only the reporting rank's callback saw the evaluations: every rank takes its record.
        states = [s for s in world().allgather(self.best.state_dict()) if s["wave"] is not None]
        if not states:
            return                                      # the run evaluated nowhere (too short): the last weights
        wave = states[0]["wave"]
        found = Checkpoint.read(clock_dir(directory, wave + 1))
        weights, buffers = found.global_weights()
        load_layer_weights(trainer.layers, weights, buffers)

    def is_world_process_zero(self) -> bool:
        """Whether this is rank 0 of the job (the one that saves and prints)."""
        from hetpipe.job.world import world

        return world().Get_rank() == 0

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Rank 0 saves the model (after :meth:`train`, the run's final global weights) with
        ``save_pretrained``, and the processing class beside it, as HF's Trainer does."""
        if not self.is_world_process_zero():
            return
        target = output_dir if output_dir is not None else self.args.output_dir
        Path(target).mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(target)
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(target)


__all__: List[str] = ["Trainer"]
