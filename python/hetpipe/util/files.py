"""Reading a user's text files (plans, profiles, cluster specs) with errors that name the file."""

from __future__ import annotations

from pathlib import Path
from typing import Union


def read_text(path: Union[str, Path], what: str) -> str:
    """The text of ``path``; a ValueError starting with ``what`` names the file when it cannot be read,
    and the first byte that is not text when it is binary."""
    p = Path(path)
    try:
        return p.read_text()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {p}: {e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {p} is not a text (JSON) file: byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}") from None
