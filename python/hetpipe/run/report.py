"""What a run reports while it trains, from the last stage of VW 0 (the rank that sees VW 0's losses):
the progress bar, the JSON-lines metrics file, TensorBoard scalars, and the user's callbacks.

Per completed wave of VW 0: a ``{"event": "wave", ...}`` line (loss, learning rate, gradient norm with
clipping, samples/s, global clock, staleness), the same as TensorBoard scalars under ``train/``, and
``on_wave_end``. Per evaluation point: ``{"event": "eval", ...}``, ``eval/`` scalars and ``on_eval``,
whose answer (stop or not) the evaluation pass carries to VW 0's stages. At the end: per epoch and a
summary line. Thread role: the rank's main thread (the driver loop calls :meth:`Reporter.update`
after each step that progressed).

A resumed run continues its run's logs: the metrics file's waves and global clocks and TensorBoard's
steps (VW 0's minibatches trained, ``(wave + 1) * nm`` in a run that was never cut) go on from the
checkpoint's, so that the curves of the attempts overlay as one run's. The metrics file is appended
to, after it is cut back (by a rename, never truncated in place) to its wave and evaluation records
of the waves before the checkpoint's clock; what a killed attempt wrote after that cut, and a line it
left half written, is dropped and counted on stderr. TensorBoard hides the killed attempt's events
from the resumed run's first step on (``purge_step``). The callbacks see the resumed run's own waves
(their ``step`` is the run's), and their state comes back from the checkpoint (``state_dict``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hetpipe.plan.types import Plan
from hetpipe.run.callbacks import Callbacks, EvalInfo, WaveInfo, run_steps
from hetpipe.schedule.trace import write_chrome_trace


def tensorboard_writer(directory: Optional[Path], purge_step: Optional[int] = None):
    """A TensorBoard ``SummaryWriter`` on ``directory`` (None: none); a clear error without tensorboard.
    ``purge_step``: events of that step and later which an earlier writer left are hidden (a resume)."""
    if directory is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(f"hetpipe: Reporting(tensorboard=) needs the tensorboard package ({e}); pip install "
                          "tensorboard") from None
    return SummaryWriter(log_dir=str(directory), purge_step=purge_step)


def cut_metrics(path: Path, wave: int) -> Tuple[int, int]:
    """Cut the metrics file ``path`` back to its wave and evaluation records of waves before ``wave``
    (the clock a run resumes from), as a run never cut would have it there; returns (kept, dropped)
    records. The cut file replaces the old one by a rename, so a crash leaves one or the other."""
    if not path.exists():
        return 0, 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            before = record.get("event") in ("wave", "eval") and int(record["wave"]) < wave
        except (ValueError, KeyError, TypeError, AttributeError):
            before = False
        if before:
            kept.append(line + "\n")
        elif line.strip():
            dropped += 1
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(kept), dropped


class Reporter:
    """See the module docstring. ``attach`` the last stage of VW 0 before the first ``update``.
    ``resume``: the checkpoint the run resumes from (a :class:`~hetpipe.checkpoint.state.Resume`; None:
    from the start), whose clock and VW 0 minibatch count the logs continue from."""

    def __init__(self, plan: Plan, metrics: Optional[Path], tensorboard: Optional[Path], progress: bool,
                 total: int, epochs: int, callbacks: Sequence[object] = (), evaluates: bool = False,
                 accumulate: int = 1, resume: Any = None) -> None:
        self.plan, self.total, self.epochs = plan, total, epochs
        self.accumulate = accumulate
        self.ex: Any = None
        self.t0 = time.perf_counter()
        self.callbacks = Callbacks(callbacks, evaluates)
        # Where the logs go on from: the checkpoint's clock (waves) and VW 0's minibatches before it.
        self.clock0, self.step0 = 0, 0
        # wave -> the checkpoint boundary of VW 0's last stage deferred until that wave's evaluation.
        self.after_eval: Dict[int, Callable[[], None]] = {}
        if resume is not None:
            self.clock0 = resume.checkpoint.clock
            saved = next((p["callbacks"] for p in resume.checkpoint.parts.values() if "callbacks" in p), None)
            if saved is not None:
                self.callbacks.load(saved)
            self.step0 = int(resume.checkpoint.manifest["data"]["minibatches_per_vw"])
        self.file = None
        if metrics is not None:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            if resume is not None:
                kept, dropped = cut_metrics(metrics, self.clock0)
                if dropped:
                    sys.stderr.write(f"hetpipe: {metrics}: resuming at wave {self.clock0}, kept the {kept} record(s) "
                                     f"of the waves before it and dropped {dropped} written after it\n")
            self.file = open(metrics, "a" if resume is not None else "w")
        self.tb = tensorboard_writer(tensorboard, self.step0 + 1 if resume is not None else None)
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="hetpipe VW 0", unit="mb", dynamic_ncols=True, mininterval=0.5)
        self.seen = 0
        self.wave = 0
        self.samples = 0
        self.evals: List[Dict[str, Any]] = []

    def attach(self, ex, t0: float) -> None:
        self.ex, self.t0 = ex, t0

    def _write(self, event: Dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(event) + "\n")
            self.file.flush()

    def update(self) -> None:
        ex = self.ex
        losses = ex.losses
        while self.seen in losses:
            self.samples += ex.batch_sizes.get(self.seen, 0)
            self.seen += 1
            if self.bar is not None:
                self.bar.update(1)
        nm = self.plan.nm_of(0)             # the waves of VW 0, whose last stage this follows
        total = self.total if ex.stopped_after is None else min(self.total, (ex.stopped_after + 1) * nm)
        while (self.wave + 1) * nm <= self.seen or (self.seen == total and self.wave * nm < total):
            mbs = range(self.wave * nm, min((self.wave + 1) * nm, total))
            if ex.clip_grad_norm is not None and mbs[-1] not in ex.grad_norms:
                break                       # the wave's last Apply (and its norm) is still to come
            loss = float(np.mean([losses[p] for p in mbs]))
            now = time.perf_counter() - self.t0
            rate = self.samples * len(self.plan.virtual_workers) / now if now > 0 else 0.0
            norms = [ex.grad_norms[p] for p in mbs if p in ex.grad_norms]
            # Waves and clocks count on from a resumed checkpoint's clock, as the metrics log does.
            info = WaveInfo(self.clock0 + self.wave, loss, ex.lrs.get(mbs[-1]),
                            float(np.mean(norms)) if norms else None, rate,
                            self.clock0 + ex.global_clock, now, self._step(self.clock0 + self.wave))
            # Staleness: how many waves VW 0's weights may lack from the global ones (its clock - g).
            staleness = max(0, self.wave + 1 - ex.global_clock)
            self._write({"event": "wave", "vw": 0, "wave": info.wave, "loss": loss, "lr": info.lr,
                         "grad_norm": info.grad_norm, "time_s": now, "samples_per_s_est": rate,
                         "global_clock": info.global_clock, "staleness": staleness})
            if self.tb is not None:
                step = self.step0 + (self.wave + 1) * nm
                for key, value in (("loss", loss), ("lr", info.lr), ("grad_norm", info.grad_norm),
                                   ("samples_per_s", rate), ("staleness", staleness)):
                    if value is not None:
                        self.tb.add_scalar(f"train/{key}", value, step)
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}", clock=ex.global_clock,
                                     refresh=False)
            self.callbacks.wave_end(info)
            self.wave += 1

    def _step(self, wave: int) -> int:
        return run_steps(wave, self.plan.minibatches_per_wave, self.accumulate)

    def evaluated(self, wave: int, result: Dict[str, float]) -> bool:
        """The decision hook of VW 0's evaluation points: report, then ask the callbacks."""
        self.update()
        now = time.perf_counter() - self.t0
        info = EvalInfo(self.clock0 + wave, result.get("loss"), result.get("metric"), int(result.get("samples", 0)), now,
                        self._step(self.clock0 + wave))
        event = {"event": "eval", "wave": info.wave, "loss": info.loss, "metric": info.metric, "samples": info.samples,
                 "time_s": now}
        stop = self.callbacks.evaluated(info)
        boundary = self.after_eval.pop(wave, None)
        if boundary is not None:
            boundary()
        if stop:
            event["stop"] = self.callbacks.stop_asked
        self.evals.append(event)
        self._write(event)
        if self.tb is not None:
            step = self.step0 + (wave + 1) * self.plan.nm_of(0)
            for key in ("loss", "metric"):
                if event[key] is not None:
                    self.tb.add_scalar(f"eval/{key}", event[key], step)
        if self.bar is not None and info.loss is not None:
            self.bar.set_postfix(loss=f"{self.ex.losses.get(self.seen - 1, float('nan')):.4f}",
                                 eval_loss=f"{info.loss:.4f}", refresh=False)
        return stop

    def finish(self, result, trace_path: Optional[Path], transport_reason: str) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            per_vw = {vw: sorted(l.items()) for vw, l in result.losses.items()}
            epochs = max(1, self.epochs)
            n = len(next(iter(per_vw.values()))) if per_vw else 0
            per_epoch = max(1, n // epochs)
            for e in range(epochs):
                by_vw = {str(vw): float(np.mean([v for p, v in items if p // per_epoch == e]))
                         for vw, items in per_vw.items() if any(p // per_epoch == e for p, _ in items)}
                if by_vw:
                    self._write({"event": "epoch", "epoch": e, "loss": float(np.mean(list(by_vw.values()))),
                                 "loss_by_vw": by_vw})
            clocks = {str(k): [c for c in log.clocks[-len(self.plan.virtual_workers):]]
                      for k, log in result.shard_logs.items()}
            # A replay's result (ReplayResult) has no timing, transport or plane: those stay out.
            summary = {"nm": self.plan.nm, "d": self.plan.d, "final_clocks": clocks}
            for key in ("samples", "elapsed_s", "samples_per_s", "cpu_s", "transport", "ps_plane", "ps_plane_reason",
                        "stopped"):
                if hasattr(result, key):
                    summary[key] = getattr(result, key)
            if hasattr(result, "emulated"):
                summary.update(emulated_devices=result.emulated, transport_reason=transport_reason)
            self._write({"event": "summary", **summary})
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if trace_path is not None:
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            write_chrome_trace(result.trace, trace_path, emulated=result.emulated)
