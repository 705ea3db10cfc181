"""The one error an adapter raises for a model it cannot split, naming the module or attribute."""

from __future__ import annotations

from typing import Iterable

from torch import nn

from hetpipe.util.errors import HetpipeError


class AdapterError(HetpipeError, ValueError):
    """A model an adapter cannot turn into layers; the message names the culprit."""


def has_attrs(model: nn.Module, attrs: Iterable[str]) -> bool:
    """Whether ``model`` has every one of ``attrs`` (dotted paths)."""
    for dotted in attrs:
        obj = model
        for part in dotted.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
    return True


def require(model: nn.Module, attrs: Iterable[str], adapter: str) -> None:
    """Raise :class:`AdapterError` naming the first of ``attrs`` (dotted) that ``model`` lacks."""
    for dotted in attrs:
        obj = model
        for part in dotted.split("."):
            if not hasattr(obj, part):
                raise AdapterError(f"hetpipe.adapters.{adapter}: {type(model).__name__} has no attribute "
                                   f"{dotted!r}, which the {adapter} layout needs")
            obj = getattr(obj, part)
