"""Checks of what a user passes to autoshard's entry points, made before any work starts: each
names the argument and says what to pass instead (a TypeError for the wrong kind of value, a
ValueError for a value out of range)."""
from __future__ import annotations

import difflib
import math
import numbers


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, *, low=None, high=None, hint: str = "") -> int:
    """``value`` as an int within [low, high]."""
    hint = f" ({hint})" if hint else ""
    if not _is_int(value):
        raise TypeError(f"{name} is a whole number{hint}, got {value!r} ({type(value).__name__})")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}{hint}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}{hint}, got {value}")
    return int(value)


def check_number(name: str, value, *, positive: bool = False, low=None, high=None, hint: str = "") -> float:
    """``value`` as a finite float (> 0 with ``positive``; within [low, high])."""
    hint = f" ({hint})" if hint else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} is a number{hint}, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{hint}, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be greater than 0{hint}, got {value:g}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low:g}{hint}, got {value:g}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high:g}{hint}, got {value:g}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} is True or False, got {value!r} ({type(value).__name__})")
    return value


def check_options(where: str, given, known) -> None:
    """Every name in ``given`` is one of ``known`` (keyword arguments passed on to ``where``)."""
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{where} got an unknown option {name!r}: it takes "
                            f"{', '.join(sorted(known))}{hint}")
