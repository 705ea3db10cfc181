"""A short pilot that measures a model's gradient noise scale, for planning by time to accuracy.

Each measurement takes ``k`` minibatches of ``b`` samples and computes the gradient of each at the same
weights: the ``k`` gradients are the small-batch ones (batch ``b``), their mean the big-batch one (batch
``k x b``), and :class:`hetpipe.plan.efficiency.NoiseScale` turns their squared norms into the simple
estimator's unbiased ``|G|^2`` and ``tr(Sigma)``. ``rounds`` measurements (optionally ``sgd_steps`` plain SGD
steps apart, on a copy of the model, so that the estimate is of the weights training passes through and
the user's model is left as it was) are averaged before their ratio is taken, as Pollux does. The
loss must be a mean over the minibatch's samples (the gradient is then the mean of the per-sample ones).

The estimate is a ratio of means; :attr:`PilotResult.standard_error` is its delta-method standard error
from the measurements' spread, so a caller can tell whether the pilot ran long enough (a few tens of
measurements usually bring it within 10-20%; the planner's choice moves only when it is far off).
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from hetpipe.model.tree import batch_of, to_device
from hetpipe.plan.efficiency import NoiseScale, gradient_estimates
from hetpipe.util.errors import ArgumentError
from hetpipe.util.numbers import whole


@dataclass
class PilotResult:
    """What a pilot measured: the running means (``estimates``), each measurement's ``(|G|^2, tr(Sigma))``
    and the batch sizes ``(b_small, b_big)``."""

    estimates: NoiseScale
    measurements: List[Tuple[float, float]] = field(default_factory=list)
    batches: Tuple[int, int] = (0, 0)

    @property
    def noise_scale(self) -> float:
        """``B_noise`` in samples (inf when the mean ``|G|^2`` is not positive)."""
        return self.estimates.value

    @property
    def standard_error(self) -> float:
        """The delta-method standard error of ``noise_scale``: ``sd(tr_i - B g2_i) / (sqrt(n) mean(g2))``
        (inf with fewer than two measurements or a non-positive mean ``|G|^2``)."""
        n = len(self.measurements)
        if n < 2:
            return math.inf
        g2 = np.array([m[0] for m in self.measurements])
        tr = np.array([m[1] for m in self.measurements])
        if g2.mean() <= 0:
            return math.inf
        b = self.noise_scale
        return float(np.std(tr - b * g2, ddof=1) / (math.sqrt(n) * g2.mean()))


def _layers(model: Union[nn.Module, Sequence[nn.Module]]) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return nn.Sequential(*model)
    raise ArgumentError(f"hetpipe: measure_noise_scale(model) must be an nn.Module or a list of modules, "
                        f"got {type(model).__name__}")


def _flat_gradient(params: List[nn.Parameter]) -> np.ndarray:
    """The parameters' gradients as one float64 vector (zeros for a parameter the loss does not reach)."""
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
             for p in params]
    return torch.cat(parts).numpy()


def _minibatches(data: Iterable) -> Iterator:
    """The data's minibatches, starting over when a re-iterable one (a list, a loader) runs out."""
    while True:
        it = iter(data)
        restartable = it is not data
        got = False
        for item in it:
            got = True
            yield item
        if not (restartable and got):
            return


def pilot_noise_scale(model: Union[nn.Module, Sequence[nn.Module]], loss_fn: Callable[[Any, Any], torch.Tensor],
                      data: Iterable, *, k: int = 8, rounds: int = 16, sgd_steps: int = 0, lr: float = 0.01,
                      device: Any = None) -> PilotResult:
    """The pilot (see the module docstring). ``model``: a module or its layers (run one after the other);
    ``loss_fn(output, y)``: a scalar mean over the minibatch; ``data``: (x, y) minibatches of one size
    (re-iterated when it runs out); ``k >= 2`` minibatches per measurement; ``rounds >= 1``
    measurements; ``sgd_steps >= 0`` plain SGD steps at ``lr`` between two measurements; ``device``:
    where to run (default: where the model's first parameter is)."""
    whole("measure_noise_scale(k)", k, 2)
    whole("measure_noise_scale(rounds)", rounds, 1)
    whole("measure_noise_scale(sgd_steps)", sgd_steps, 0)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ArgumentError(f"hetpipe: measure_noise_scale(lr) must be a finite number > 0, got {lr!r}")
    if not callable(loss_fn):
        raise ArgumentError(f"hetpipe: measure_noise_scale(loss_fn) must be a function (output, y) -> loss, "
                            f"got {loss_fn!r}")
    net = _layers(model)
    if sgd_steps:
        net = copy.deepcopy(net)            # the steps train a copy: the caller's model stays as it was
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise ArgumentError("hetpipe: measure_noise_scale: the model has no parameter that requires a gradient")
    if device is None:
        device = params[0].device
    kept = [p.grad for p in params]
    source = _minibatches(data)

    def next_batch() -> Tuple[Any, Any, int]:
        try:
            x, y = next(source)
        except StopIteration:
            raise ArgumentError(f"hetpipe: measure_noise_scale: the data ran out after {done} measurement(s); "
                                f"it needs {rounds} x ({k} + {sgd_steps}) minibatches, or a re-iterable source") \
                from None
        except (TypeError, ValueError):
            raise ArgumentError("hetpipe: measure_noise_scale(data) must yield (x, y) minibatches") from None
        return to_device(x, device), to_device(y, device), batch_of(x)

    def gradient(x: Any, y: Any) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss = loss_fn(net(x), y)
        loss.backward()
        return loss

    acc = NoiseScale()
    result = PilotResult(acc)
    done = 0
    try:
        for r in range(rounds):
            if r and sgd_steps:
                for _ in range(sgd_steps):
                    x, y, _b = next_batch()
                    gradient(x, y)
                    with torch.no_grad():
                        for p in params:
                            if p.grad is not None:
                                p.add_(p.grad, alpha=-lr)
            smalls, sizes = [], set()
            for _ in range(k):
                x, y, b = next_batch()
                gradient(x, y)
                smalls.append(_flat_gradient(params))
                sizes.add(b)
            if len(sizes) != 1:
                raise ArgumentError(f"hetpipe: measure_noise_scale: the minibatches of one measurement differ in "
                                    f"size ({sorted(sizes)}); give minibatches of one size (drop the last)")
            b = sizes.pop()
            if result.batches != (0, 0) and result.batches != (b, k * b):
                raise ArgumentError(f"hetpipe: measure_noise_scale: minibatches of {b} samples after ones of "
                                    f"{result.batches[0]}; give minibatches of one size")
            result.batches = (b, k * b)
            big = np.mean(smalls, axis=0)
            small_sq = float(np.mean([g @ g for g in smalls]))
            big_sq = float(big @ big)
            acc.add_norms(small_sq, big_sq, b, k * b)
            result.measurements.append(gradient_estimates(small_sq, big_sq, b, k * b))
            done += 1
    finally:
        if not sgd_steps:
            for p, g in zip(params, kept):
                p.grad = g
    return result


def measure_noise_scale(model: Union[nn.Module, Sequence[nn.Module]], loss_fn: Callable[[Any, Any], torch.Tensor],
                        data: Iterable, *, k: int = 8, rounds: int = 16, sgd_steps: int = 0, lr: float = 0.01,
                        device: Any = None) -> float:
    """The gradient noise scale ``B_noise`` (samples) of ``model`` on ``data`` by a short pilot
    (:func:`pilot_noise_scale`, same arguments); what ``make_plan(objective="time-to-accuracy",
    noise_scale=...)`` and ``hetpipe plan --noise-scale`` take."""
    return pilot_noise_scale(model, loss_fn, data, k=k, rounds=rounds, sgd_steps=sgd_steps, lr=lr,
                             device=device).noise_scale


def job_noise_scale(work: Any, planning: Any, *, k: int = 8, rounds: int = 16) -> float:
    """The noise scale a job plans with under ``Planning(objective="time-to-accuracy")``: the one given
    (``planning.noise_scale``), else a pilot on the job's layers, loss and the data's first
    ``k x rounds`` minibatches (in VW 0's order of a one-VW run, over as many epochs as that takes), on
    the layers' own device, before any training; the layers are left as they were."""
    if planning.noise_scale is not None:
        return float(planning.noise_scale)
    per_epoch = work.data.minibatches_per_epoch(1)
    if per_epoch < 1:
        raise ArgumentError("hetpipe: the noise-scale pilot found no minibatch in the data")
    epochs = -(-k * rounds // per_epoch)
    result = pilot_noise_scale(list(work.layers), work.loss_fn, work.data.vw_stream(0, 1, epochs), k=k,
                               rounds=rounds)
    sys.stderr.write(f"hetpipe: noise-scale pilot: {result.noise_scale:.4g} samples (standard error "
                     f"{result.standard_error:.2g}, {rounds} measurements of {k} minibatches of "
                     f"{result.batches[0]})\n")
    return result.noise_scale


def planning_arguments(work: Any, planning: Any) -> Dict[str, Any]:
    """``make_plan``'s ``objective``, ``noise_scale`` and ``waves`` for a job's ``planning``: nothing for the
    defaults; for time-to-accuracy the noise scale of :func:`job_noise_scale` (an infinite one, a gradient
    the pilot finds all noise, makes every batch as efficient: the job then plans for throughput, and
    says so)."""
    waves = getattr(planning, "waves", "equal")
    extra = {} if waves == "equal" else {"waves": waves}
    if planning.objective == "throughput":
        return extra
    if planning.objective != "time-to-accuracy":
        return {"objective": planning.objective, **extra}
    noise = job_noise_scale(work, planning)
    if not math.isfinite(noise):
        sys.stderr.write("hetpipe: the noise-scale pilot found no gradient above the noise (an infinite noise "
                         "scale, every batch as efficient): planning for throughput\n")
        return {"objective": "throughput", **extra}
    return {"objective": planning.objective, "noise_scale": noise, **extra}
