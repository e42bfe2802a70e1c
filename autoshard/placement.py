"""SBP placements: how one tensor lies on one mesh axis.

    S(d)  split:        dim d is cut into chunks, coordinate r holds chunk r; a dim that does
                        not divide is cut as torch.chunk and DTensor's Shard cut it (17 rows
                        over 4: 5, 5, 5, 2), every chunk but the last of the largest size
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

import itertools
import math
import re
from typing import Iterable, Sequence, Union


class Split:
    """S(d), or S(d)/g. One object per (dim, groups), made once (``_interned``): placements are
    hashed and compared by the million while a mesh is priced, and one object per value lets
    Python do both by identity, in C, instead of a dataclass's Python-level methods."""
    __slots__ = ("dim", "groups")
    _interned: dict = {}

    def __new__(cls, dim: int, groups: int = 1):
        key = (int(dim), int(groups))
        self = cls._interned.get(key)
        if self is None:
            self = object.__new__(cls)
            object.__setattr__(self, "dim", key[0])
            object.__setattr__(self, "groups", key[1])
            cls._interned[key] = self
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"a placement cannot be changed ({name})")

    def __delattr__(self, name):
        raise AttributeError(f"a placement cannot be changed ({name})")

    def __reduce__(self):   # pickled, copied and unpickled as the one object of its value
        return Split, (self.dim, self.groups)

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim})/{self.groups}"


class _Single:
    """A placement with one value (B, P): one object per class (``_one``, each its own), compared
    and hashed by identity."""
    __slots__ = ()

    def __new__(cls):
        one = cls.__dict__.get("_one")
        if one is None:
            one = object.__new__(cls)
            type.__setattr__(cls, "_one", one)
        return one

    def __reduce__(self):
        return type(self), ()


class Broadcast(_Single):
    __slots__ = ()

    def __repr__(self) -> str:
        return "B"


class Partial(_Single):
    __slots__ = ()

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


_GROUP = re.compile(r"\(((?:[^()]|\([^()]*\))*)\)")


def parse_strategy(text: str) -> tuple:
    """``"(S(2)), (B), (B) -> (S(2))"``: a node's whole strategy, an nd placement per tensor input
    and per output (as ``passes.annotate.Strategy`` prints) -> (inputs, outputs), tuples of nd
    placements."""
    if text.count("->") != 1:
        raise ValueError(f"cannot read strategy {text!r}: write '(placements of input 1), ... -> (of the output)'")
    sides = []
    for side in text.split("->"):
        groups = _GROUP.findall(side)
        if not groups or _GROUP.sub("", side).replace(",", "").strip():
            raise ValueError(f"cannot read strategy {text!r}: each tensor's placements go in parentheses, "
                             "one per mesh axis, e.g. '(S(0), S(2)), (S(0), B) -> (S(0), S(2))'")
        sides.append(tuple(tuple(parse(p) for p in _ITEM.findall(g)) for g in groups))
    naxes = {len(p) for side in sides for p in side}
    if len(naxes) != 1:
        raise ValueError(f"strategy {text!r} gives its tensors different numbers of mesh axes")
    return tuple(sides)


_ITEM = re.compile(r"S\(-?\d+\)(?:/\d+)?|B|P")


def format_nd(pl: Sequence[Placement]) -> str:
    return "(" + ", ".join(repr(p) for p in pl) + ")"


def to_strings(pl: Sequence[Placement]) -> tuple:
    return tuple(repr(p) for p in pl)


def split_factor(pl: Sequence[Placement], mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces ``dim`` is cut into by the nd placement ``pl``."""
    return math.prod(n for p, n in zip(pl, mesh_shape) if isinstance(p, Split) and p.dim == dim)


def chunk_sizes(n: int, p: int) -> tuple:
    """The sizes ``p`` ranks hold of a dim of ``n``: DTensor's Shard layout (``torch.chunk``),
    chunks of ceil(n / p) and a smaller last one; 17 over 4 is 5, 5, 5, 2. Ranks past the end
    hold 0."""
    c = -(-n // p)
    return tuple(max(0, min(c, n - r * c)) for r in range(p))


def _cut(shape, pl, mesh_shape, pick):
    """Cut ``shape`` axis by axis, outermost first (DTensor's order); ``pick(sizes, axis)`` chooses
    the chunk kept (None: the first, the largest, without listing every rank's). None where a
    blocked split does not divide, a dim is split both blocked and not (or in different blocks),
    or some rank would hold an empty chunk."""
    out = list(shape)
    groups: dict = {}
    for a, (p, n) in enumerate(zip(pl, mesh_shape)):
        if isinstance(p, Split):
            if p.dim >= len(out) or groups.setdefault(p.dim, p.groups) != p.groups:
                return None
            if p.groups > 1:
                if out[p.dim] % (n * p.groups):
                    return None
                out[p.dim] //= n
                continue
            # chunk_sizes' first chunk (the largest), and its last: size - (n - 1) c, empty below 1
            c = -(-out[p.dim] // n)
            if out[p.dim] - (n - 1) * c <= 0:
                return None
            out[p.dim] = c if pick is None else pick(chunk_sizes(out[p.dim], n), a)
    return tuple(out)


def local_shape(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]):
    """The largest shape one rank holds (every rank's, where each split divides evenly): what
    compute, memory and collectives are priced by. None where no rank's shape exists (``_cut``).
    Remembered (``_LOCAL``): a mesh's pricing asks for the same few hundred thousand times."""
    key = (tuple(shape), tuple(pl), tuple(mesh_shape))
    hit = _LOCAL.get(key, _LOCAL)
    if hit is _LOCAL:
        if len(_LOCAL) >= LOCAL_KEPT:
            _LOCAL.clear()
        hit = _LOCAL[key] = _cut(*key, None)   # the tuples: an iterator given is read once
    return hit


_LOCAL: dict = {}
LOCAL_KEPT = 1 << 18   # shapes kept before the memo starts again


def uneven_dims(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]) -> frozenset:
    """The dims of ``shape`` that ``pl`` splits unevenly, each checked alone (the splits of that
    dim, in mesh order). Remembered (``_UNEVEN``): a mesh's pricing and annotation ask for the
    same few hundred layouts by the hundred thousand."""
    key = (tuple(shape), tuple(pl), tuple(mesh_shape))
    hit = _UNEVEN.get(key)
    if hit is None:
        if len(_UNEVEN) >= LOCAL_KEPT:
            _UNEVEN.clear()
        shape, pl, mesh_shape = key
        # a dim no axis splits is even; only the split ones are checked
        hit = _UNEVEN[key] = frozenset(
            d for d in {p.dim for p in pl if isinstance(p, Split)} if 0 <= d < len(shape)
            and not is_even(shape, tuple(p if isinstance(p, Split) and p.dim == d else B for p in pl), mesh_shape))
    return hit


_UNEVEN: dict = {}


def rank_shape(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int], coords: Sequence[int]):
    """The shape the rank at mesh coordinate ``coords`` holds."""
    return _cut(shape, pl, mesh_shape, lambda sizes, a: sizes[coords[a]])


def rank_start(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int], coords: Sequence[int],
               dim: int) -> int:
    """Where the chunk of ``dim`` that the rank at ``coords`` holds starts in the whole dim: the
    axes that split it cut it in mesh order, each chunk as ``chunk_sizes`` cuts it (``_cut``)."""
    start, size = 0, shape[dim]
    for p, n, c in zip(pl, mesh_shape, coords):
        if isinstance(p, Split) and p.dim == dim:
            if p.groups > 1:
                raise ValueError(f"dim {dim} split in {p.groups} blocks holds no one run of positions")
            sizes = chunk_sizes(size, n)
            start, size = start + sum(sizes[:c]), sizes[c]
    return start


def is_even(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """Whether every rank holds the same shape (each split divides its dim)."""
    out = list(shape)
    for p, n in zip(pl, mesh_shape):
        if isinstance(p, Split):
            if p.dim >= len(out) or out[p.dim] % n:
                return False
            out[p.dim] //= n
    return True


def uneven_splits(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int]) -> dict:
    """dim -> the sizes its ranks hold along it, for each dim some axis cuts unevenly (in the
    order of the ranks flattened over the axes that cut it): what a plan shows."""
    out = {}
    dims = {p.dim for p in pl if isinstance(p, Split)}
    for d in sorted(dims):
        axes = [a for a, p in enumerate(pl) if isinstance(p, Split) and p.dim == d]
        one = tuple(B if a not in axes else p for a, p in enumerate(pl))
        if is_even(shape, one, mesh_shape):
            continue
        sizes = []
        for c in itertools.product(*(range(mesh_shape[a]) for a in axes)):
            coords = [0] * len(mesh_shape)
            for a, x in zip(axes, c):
                coords[a] = x
            got = rank_shape(shape, one, mesh_shape, coords)
            sizes.append(got[d] if got else 0)
        out[d] = tuple(sizes)
    return out


def is_valid(shape: Sequence[int], pl: Sequence[Placement], mesh_shape: Sequence[int], floating: bool,
             uneven: bool = False) -> bool:
    """Whether a tensor may be held so: no partial sum of a non-float tensor, and every split
    even (with ``uneven``: every rank holds some of each split dim)."""
    if not floating and any(isinstance(p, Partial) for p in pl):
        return False
    if not uneven and not is_even(shape, pl, mesh_shape):
        return False
    return local_shape(shape, pl, mesh_shape) is not None
