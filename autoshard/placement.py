"""SBP placements: how one tensor lies on one mesh axis.

    S(d)  split:        dim d is cut into even chunks, coordinate r holds chunk r
    S(d)/g  blocked split: dim d is g equal blocks (a fused q, k, v projection's outputs), each
                        cut into even chunks; coordinate r holds chunk r of every block, in block
                        order, so a split of the dim into its g blocks is local
    B     broadcast:    every coordinate holds the whole tensor
    P     partial-sum:  every coordinate holds a full-shaped tensor; the value is their sum

An nd placement is a tuple with one entry per mesh axis, printed ``(S(0), B)``. A dim split over
several axes is cut by the first of them, then each chunk by the next (axis 0 outermost), the same
order DTensor uses. These values carry no communication code.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Sequence, Union


@dataclass(frozen=True)
class Split:
    dim: int
    groups: int = 1     # > 1: a blocked split, S(d)/g

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim})/{self.groups}"


@dataclass(frozen=True)
class Broadcast:
    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    def __repr__(self) -> str:
        return "P"


Placement = Union[Split, Broadcast, Partial]
NdPlacement = tuple  # tuple[Placement, ...], one per mesh axis

B = Broadcast()
P = Partial()


def S(dim: int, groups: int = 1) -> Split:
    return Split(dim, groups)


_SPLIT = re.compile(r"^S\((-?\d+)\)(?:/(\d+))?$")


def parse(text: "str | Placement") -> Placement:
    """``"S(1)"``, ``"S(0)/3"``, ``"B"`` or ``"P"`` (or a placement already) -> placement."""
    if isinstance(text, (Split, Broadcast, Partial)):
        return text
    if not isinstance(text, str):
        raise TypeError(f"a placement is written 'S(d)', 'B' or 'P', got {text!r}")
    t = text.strip()
    if t == "B":
        return B
    if t == "P":
        return P
    m = _SPLIT.match(t)
    if m and (m.group(2) is None or int(m.group(2)) >= 1):
        return Split(int(m.group(1)), int(m.group(2) or 1))
    raise ValueError(f"cannot read placement {text!r}: write 'S(d)' for a split of dim d, 'S(d)/g' for a "
                     "split of each of its g blocks, 'B' or 'P'")


def parse_nd(value: "str | Iterable", naxes: int) -> NdPlacement:
    """A per-axis placement tuple from strings; a single string is one axis."""
    items = (value,) if isinstance(value, (str, Split, Broadcast, Partial)) else tuple(value)
    if len(items) != naxes:
        raise ValueError(
            f"placement {format_nd(tuple(parse(i) for i in items))} names {len(items)} mesh axes, "
            f"but the mesh has {naxes}: give one placement per axis")
    return tuple(parse(i) for i in items)


def format_nd(pl: Sequence[Placement]) -> str:
    return "(" + ", ".join(repr(p) for p in pl) + ")"


def to_strings(pl: Sequence[Placement]) -> tuple:
    return tuple(repr(p) for p in pl)


def split_factor(pl: Sequence[Placement], mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces ``dim`` is cut into by the nd placement ``pl``."""
    return math.prod(n for p, n in zip(pl, mesh_shape) if isinstance(p, Split) and p.dim == dim)


def local_shape(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]):
    """The shape one rank holds, or None when a split dim does not divide evenly (a blocked
    split: each block), or when one dim is split both blocked and not, or in different blocks."""
    out = list(shape)
    groups: dict = {}
    for p, n in zip(pl, mesh_shape):
        if isinstance(p, Split):
            if p.dim >= len(out) or out[p.dim] % (n * p.groups) or groups.setdefault(p.dim, p.groups) != p.groups:
                return None
            out[p.dim] //= n
    return tuple(out)


def is_valid(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int], floating: bool) -> bool:
    if not floating and any(isinstance(p, Partial) for p in pl):
        return False
    return local_shape(shape, pl, mesh_shape) is not None
