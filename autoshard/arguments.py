"""Checks of what a user passes to autoshard's entry points, made before any work starts: each
names the argument and says what to pass instead (a TypeError for the wrong kind of value, a
ValueError for a value out of range)."""
from __future__ import annotations

import difflib
import math
import numbers

MAX_AXES = 4   # the most mesh axes a plan has
# planner.recompute's modes: the solver chooses, none, every repeated block, every block's cheap ops
RECOMPUTE_MODES = ("auto", "none", "blocks", "selective")
# a pipeline's schedules: torch.distributed.pipelining's, by their class names less "Schedule"
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"
ZBV = "ZBVZeroBubble"   # zero bubble on two chunks per rank placed in a V: rank r holds r and 2k - 1 - r
SCHEDULES = (ONE_F_ONE_B, GPIPE, INTERLEAVED, ZERO_BUBBLE, ZBV)
SPLIT_BACKWARD = (ZERO_BUBBLE, ZBV)   # the schedules that run input and weight gradients apart


def stage_coordinate(schedule: str, c: int, k: int) -> int:
    """The pipeline coordinate that runs chunk ``c`` of ``k`` ranks' chunks: ``c % k`` (looped), or
    in a V under ZBV (``c``, then ``2k - 1 - c``)."""
    if schedule == ZBV:
        return c if c < k else 2 * k - 1 - c
    return c % k


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


def check_module(name: str, value) -> None:
    import torch.nn as nn
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def check_mesh(mesh, max_axes: int = MAX_AXES) -> tuple:
    """A mesh shape: an int or a tuple of up to ``max_axes`` axis sizes, each at least 2 when
    there are several."""
    if _is_int(mesh):
        mesh = (mesh,)
    if not isinstance(mesh, (tuple, list)) or not mesh or not all(_is_int(a) for a in mesh):
        raise TypeError(f"mesh is a tuple of axis sizes such as (4, 2), got {mesh!r}")
    mesh = tuple(int(a) for a in mesh)
    if len(mesh) > max_axes:
        raise ValueError(f"a mesh has at most {max_axes} axes, got {len(mesh)}: {mesh}")
    if any(a < 1 for a in mesh) or (len(mesh) > 1 and any(a < 2 for a in mesh)):
        raise ValueError(f"every axis of mesh {mesh} needs at least 2 devices; drop axes of size 1")
    return mesh


def check_budget(memory_budget) -> float:
    if (isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real)
            or not 0 < memory_budget < math.inf):
        raise ValueError(f"memory_budget is a positive number of bytes per device (finite), or None for the "
                         f"cluster's device memory; got {memory_budget!r}")
    return float(memory_budget)
