"""Output paths of the command line: checked before any work, each file written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Union

from hetpipe.util.errors import HetpipeError

PathLike = Union[str, Path]


class OutputError(HetpipeError):
    """An output path that cannot be written; the message names the flag and the path on one line."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def check_file(flag: str, path: PathLike) -> None:
    """Raise OutputError unless a file can be created at ``path`` (by creating and removing a
    scratch file beside it, which also catches read-only file systems and missing directories)."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{flag} {p}: is a directory, expected a file name")
    parent = p.parent
    try:
        fd, scratch = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.", suffix=".check")
    except OSError as e:
        raise OutputError(f"{flag} {p}: cannot write in directory {parent}: {_reason(e)}") from e
    os.close(fd)
    os.unlink(scratch)
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"{flag} {p}: the existing file is not writable")


def check_dir(flag: str, path: PathLike) -> Path:
    """Create directory ``path`` if needed and check that files can be written in it; return it.
    Raise OutputError otherwise (a directory it had to create is left in place only on success)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {p}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{flag} {p}: cannot create directory: {_reason(e)}") from e
    check_file(flag, p / "output")
    return p


def write_file(flag: str, path: PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(scratch)`` on a scratch file beside ``path`` (same suffix), then rename it over
    ``path``: a failure leaves no partial file. Raise OutputError naming ``flag`` and ``path``."""
    p = Path(path)
    try:
        fd, name = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=p.suffix)
    except OSError as e:
        raise OutputError(f"{flag} {p}: cannot write in directory {p.parent}: {_reason(e)}") from e
    os.close(fd)
    scratch = Path(name)
    try:
        write(scratch)
        os.chmod(scratch, 0o666 & ~_umask())        # mkstemp makes 0600; give the file the usual mode
        os.replace(scratch, p)
    except OSError as e:
        raise OutputError(f"{flag} {p}: cannot write: {_reason(e)}") from e
    finally:
        if scratch.exists():
            scratch.unlink()
