"""Checks of the arguments a user passes that are not numbers (:mod:`hetpipe.util.numbers` checks those):
flags, choices and paths. Each bad one is one :class:`~hetpipe.util.errors.ArgumentError` naming the
argument, the value and what is allowed, raised before anything is started or written. Torch-free.

The path checks look, never create: a directory setting may name a directory to be made (its nearest
existing ancestor must then be a directory), but never an existing file; a file setting never an
existing directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional

from hetpipe.util.errors import ArgumentError


def flag(name: str, value: Any, optional: bool = False) -> Optional[bool]:
    """``value`` as a bool (None too with ``optional``): a truthy string such as ``"no"`` is refused."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        allowed = "True, False or None" if optional else "True or False"
        raise ArgumentError(f"hetpipe: {name} must be {allowed}, got {value!r}")
    return value


def one_of(name: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed`` (strings)."""
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise ArgumentError(f"hetpipe: {name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def path_of(name: str, value: Any) -> Optional[Path]:
    """``value`` (a str or os.PathLike; None and "" for none) as a Path."""
    if value is None or (isinstance(value, str) and not value):
        return None
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(f"hetpipe: {name} must be a path (a str or os.PathLike), got {value!r}")
    return Path(value)


def directory_path(name: str, value: Any, must_exist: bool = False) -> Optional[Path]:
    """``value`` as the Path of a directory that exists (``must_exist``) or can be made: not an existing
    file, nor below one."""
    path = path_of(name, value)
    if path is None:
        return None
    if path.exists():
        if not path.is_dir():
            raise ArgumentError(f"hetpipe: {name} {str(path)!r} is a file, not a directory")
        return path
    if must_exist:
        raise ArgumentError(f"hetpipe: {name} {str(path)!r} does not exist")
    above = _existing_ancestor(path)
    if not above.is_dir():
        raise ArgumentError(f"hetpipe: {name} {str(path)!r} cannot be made: {str(above)!r} is a file, not a directory")
    return path


def file_path(name: str, value: Any) -> Optional[Path]:
    """``value`` as the Path of a file to write: not an existing directory, nor below a file."""
    path = path_of(name, value)
    if path is None:
        return None
    if path.is_dir():
        raise ArgumentError(f"hetpipe: {name} {str(path)!r} is a directory, expected a file name")
    above = _existing_ancestor(path.parent)
    if not above.is_dir():
        raise ArgumentError(f"hetpipe: {name} {str(path)!r} cannot be written: {str(above)!r} is a file, "
                            "not a directory")
    return path


def _existing_ancestor(path: Path) -> Path:
    """The nearest of ``path`` and its ancestors that exists (the working directory at worst)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
