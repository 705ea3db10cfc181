"""Checks of the numbers a user passes (Trainer arguments, CLI options, environment variables): each
bad one is one line naming the argument and the value, never a traceback or a silent surprise
(``--timeout nan`` turning the peer timeout off, ``--timeout -5`` failing every rank at once).

``whole(name, value, least)`` and ``seconds(name, value, least)`` check Python values; ``number(flag, text)``
reads a command-line option's text; the ``arg_*`` functions are argparse ``type=`` converters built on
them. Torch-free.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional

from hetpipe.util.errors import ArgumentError


def whole(name: str, value: Any, least: int = 1, most: Optional[int] = None, why: str = "") -> int:
    """``value`` as an int >= ``least`` (and <= ``most`` when given; ``why`` says why that bound) (a bool
    or a float is refused); else :class:`ArgumentError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(f"hetpipe: {name} must be a whole number >= {least}, got {value!r}")
    if most is not None and value > most:
        raise ArgumentError(f"hetpipe: {name} must be at most {most}{why}, got {value!r}")
    return value


def seconds(name: str, value: Any, least: float = 0.0, inclusive: bool = False) -> float:
    """``value`` as a finite float > ``least`` (>= with ``inclusive``); else :class:`ArgumentError` naming
    ``name``."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"hetpipe: {name} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(x) or x < least or (x == least and not inclusive):
        bound = f">= {least:g}" if inclusive else f"> {least:g}"
        raise ArgumentError(f"hetpipe: {name} must be a finite number {bound}, got {value!r}")
    return x


def number(flag: str, text: str, *, integer: bool = False, positive: bool = False) -> float:
    """``text`` as a finite number >= 0 (> 0 with ``positive``; a whole number with ``integer``,
    ``1e3`` included), else :class:`ArgumentError` naming ``flag``."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentError(f"{flag} must be a number, got {text!r}") from None
    kind = "a whole number" if integer else "a finite number"
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or (integer and value != int(value)):
        raise ArgumentError(f"{flag} must be {kind} {'> 0' if positive else '>= 0'}, got {text!r}")
    return int(value) if integer else value


def _converter(check: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("hetpipe: ")) from None
    return convert


def arg_whole(name: str, least: int = 1) -> Callable[[str], int]:
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ArgumentError(f"{name} must be a whole number >= {least}, got {text!r}") from None
        return whole(name, value, least)
    return _converter(check)


def arg_seconds(name: str, least: float = 0.0, inclusive: bool = False) -> Callable[[str], float]:
    return _converter(lambda text: seconds(name, text, least, inclusive))


def arg_fraction(name: str) -> Callable[[str], float]:
    def check(text: str) -> float:
        x = seconds(name, text, 0.0, inclusive=True)
        if x > 1:
            raise ArgumentError(f"{name} must be between 0 and 1, got {text!r}")
        return x
    return _converter(check)
