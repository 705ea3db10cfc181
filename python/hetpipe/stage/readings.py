"""Device values a stage reads on the host once per wave, not once per minibatch (docs/design.md,
"Host-device synchronisations").

Reading a device value on the host (``float(t)``) makes the host wait for every kernel queued
before it: the pipeline then stops feeding the device until it drained. What a stage reads only to
report or to check — each minibatch's loss, the finiteness of its gradients when nothing else needs
their norm — is therefore kept on the device as a tensor and read at the end of the wave (the
stage's ``Push``, and ``Done`` for what is left), all of it with one synchronisation; each value
then goes to its callback, in the order they were added. A check that raises stops the reading
there: the values after it are dropped with the run.
Thread role: the stage's executor thread.
"""

from __future__ import annotations

from typing import Callable, List, Tuple, Union

import torch


class WaveReadings:
    """The device scalars waiting for the stage's next wave boundary, each with what to do with its value."""

    def __init__(self) -> None:
        self._pending: List[Tuple[Union[torch.Tensor, float], Callable[[float], None]]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, value: Union[torch.Tensor, float], then: Callable[[float], None]) -> None:
        """Read the one-element tensor ``value`` at the next :meth:`read` and call ``then`` with it
        (a Python float, exactly ``float(value)``); a float already on the host waits its turn too."""
        self._pending.append((value.detach().reshape(()) if isinstance(value, torch.Tensor) else value, then))

    def read(self) -> None:
        """Read every pending value with one host-device synchronisation and hand each to its callback,
        in the order they were added. float64 holds every float32, bfloat16 and float16 exactly, so
        each value is the float ``float(value)`` would have given."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        tensors = [v.to(torch.float64) for v, _ in pending if isinstance(v, torch.Tensor)]
        read = iter(torch.stack(tensors).tolist() if tensors else [])
        for value, then in pending:
            then(next(read) if isinstance(value, torch.Tensor) else value)
