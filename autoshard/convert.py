"""Layout conversions as steps: which collectives and local steps turn a tensor held in one nd
placement into another, and in what order. The cost model prices these steps (``cost.comm``), the
rewriter emits them (``passes.rewrite``) and the runtime runs them at the program's edges
(``runtime.edges``): this module is the one place that decides them, below all three.

One mesh axis:

    from -> to     forward           backward (dual)
    S -> B         all_gather        reduce_scatter
    P -> B         all_reduce        all_reduce
    P -> S         reduce_scatter    all_gather
    B -> S         slice (local)     pad (S -> P, zero-filled)
    S(i) -> S(j)   all_to_all        all_to_all back
    B -> P         keep (local)      keep

On several axes the conversion runs one axis at a time: gathers innermost axis first, splits
outermost first, so a dim cut by several axes always holds the contiguous chunk DTensor's order
prescribes. A partial sum over several axes is reduced hierarchically (reduce-scatter inside,
all-reduce across, all-gather).

A conversion whose changing axes A all change alike (all gather a dim, re-split it onto another,
reduce-scatter or all-reduce a partial sum) may instead run as one collective on the group
spanning A (``runtime.RankMesh.group``): a split over A in mesh order cuts a dim as one split over
A's ranks flattened in that order would. Axis by axis, a re-split ``(S(2), S(2)) -> (S(0), S(0))``
gathers the whole of A before slicing (each rank receiving |A| times its share), and a gather over
axes that cross nodes runs one ring per axis, each sharing the node's network. ``transition``
takes the faster of the two when it is given a price for a step (``cost.comm.transition`` prices
them on a cluster's links). Such a step's ``axis`` is the tuple A.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

from autoshard.placement import B, P, Broadcast, Partial, Split, chunk_sizes, rank_shape, uneven_dims

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
_COLLECTIVE = frozenset(COLLECTIVES)
DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "all_reduce",
        "all_to_all": "all_to_all", "slice": "pad", "pad": "slice", "keep": "keep"}


class Step(NamedTuple):
    """One step of a conversion. A named tuple, not a dataclass: a mesh's pricing makes tens of
    thousands, and a frozen dataclass sets each field through a Python call."""
    kind: str
    axis: Union[int, tuple]       # one mesh axis, or a tuple of axes run as one group
    dim: Optional[int] = None     # the tensor dim gathered, scattered or sliced
    dim2: Optional[int] = None    # all_to_all: the dim split after the step
    in_shape: tuple = ()          # this rank's shape before the step
    groups: int = 1               # a blocked split S(dim)/groups: the step runs within each block

    @property
    def is_collective(self) -> bool:
        return self.kind in _COLLECTIVE

    @property
    def axes(self) -> tuple:
        return self.axis if isinstance(self.axis, tuple) else (self.axis,)

    def size(self, mesh_shape) -> int:
        """Ranks in the step's group."""
        axis = self.axis
        return math.prod(mesh_shape[a] for a in axis) if isinstance(axis, tuple) else mesh_shape[axis]

    def __repr__(self) -> str:
        extra = f", dim={self.dim}" if self.dim is not None else ""
        extra += f"->{self.dim2}" if self.dim2 is not None else ""
        extra += f"/{self.groups}" if self.groups != 1 else ""
        return f"{self.kind}(axis={self.axis}{extra})"


def apply_shape(shape, step: Step, p: int):
    """This rank's shape after ``step`` ran on a group of ``p`` ranks (``shape`` before)."""
    s = list(shape)
    if step.kind in ("all_gather", "pad"):
        s[step.dim] *= p
    elif step.kind in ("reduce_scatter", "slice"):
        s[step.dim] = _largest_chunk(s[step.dim], p)
    elif step.kind == "all_to_all":
        s[step.dim] *= p
        s[step.dim2] = _largest_chunk(s[step.dim2], p)
    return tuple(s)


def _largest_chunk(n, p):
    """An uneven split is priced by its largest chunk; a size named by a symbol (``autoshard.report.formula``)
    is taken to divide."""
    return -(-n // p) if isinstance(n, int) else n // p


def transition(local_shape: Sequence[int], src: tuple, dst: tuple, mesh_shape: Sequence[int],
               price: Optional[Callable[[Step], float]] = None, whole: Optional[Sequence[int]] = None) -> list:
    """Steps that turn a tensor held as ``src`` (with this rank's ``local_shape``, the largest
    where a split is uneven) into ``dst``.
    With ``price`` (a step's seconds), a conversion one collective over the changing axes'
    group can do (``_joint_step``) runs as that one when it is the faster; without, axis by axis
    (the runtime's own conversions at the program's edges, which need no group spanning axes).
    ``whole``: the tensor's whole shape. A dim split unevenly is cut axis by axis (DTensor's
    nested chunks), which one split over the ranks flattened is not: no joint step then, and
    no partial sum reduced in pieces of such a dim."""
    if tuple(src) == tuple(dst):
        return []
    uneven = _uneven_dims(whole, src, dst, mesh_shape)
    steps = _axis_by_axis(local_shape, src, dst, mesh_shape, uneven)
    joint = _joint_step(src, dst, len(mesh_shape)) if price is not None and not uneven else None
    if joint:
        kind, axes, d, d2, groups = joint
        one = [Step(kind, axes, d, d2, tuple(local_shape), groups)]
        if sum(price(st) for st in one) < sum(price(st) for st in steps):
            return one
    return steps


def _uneven_dims(whole, src: tuple, dst: tuple, mesh_shape) -> frozenset:
    if whole is None:
        return frozenset()
    return uneven_dims(whole, src, mesh_shape) | uneven_dims(whole, dst, mesh_shape)


def _after(step: Step, p):
    """An axis's placement after ``step`` ran on it (``p`` before)."""
    if step.kind in ("all_gather", "all_reduce"):
        return B
    if step.kind in ("reduce_scatter", "slice"):
        return Split(step.dim, step.groups)
    if step.kind == "all_to_all":
        return Split(step.dim2)
    return P   # pad, keep


def rank_sizes(whole: Sequence[int], src: tuple, steps: list, mesh_shape: Sequence[int], coords) -> list:
    """Per step, what the rank at ``coords`` must tell it of an uneven split: ``sizes``, the
    chunks of the dim the step gathers, scatters, slices or pads, one per rank of its group in
    group order (an all_to_all's ``sizes2``: of the dim it scatters); ``{}`` where every chunk is
    equal. The group's whole of that dim is this rank's, which the axes outer to the step cut."""
    cur, out = tuple(src), []
    for st in steps:
        after = tuple(_after(st, cur[a]) if a in st.axes else cur[a] for a in range(len(cur)))
        kw = {}
        p = st.size(mesh_shape)
        if st.groups == 1 and st.kind in ("all_gather", "pad", "reduce_scatter", "slice", "all_to_all"):
            held = after if st.kind in ("all_gather", "pad", "all_to_all") else cur
            sizes = chunk_sizes(rank_shape(whole, held, mesh_shape, coords)[st.dim], p)
            if len(set(sizes)) > 1:
                kw["sizes"] = sizes
            if st.kind == "all_to_all":
                sizes2 = chunk_sizes(rank_shape(whole, cur, mesh_shape, coords)[st.dim2], p)
                if len(set(sizes2)) > 1:
                    kw["sizes2"] = sizes2
            if kw and isinstance(st.axis, tuple):
                raise AssertionError(f"{st} over several axes cuts an uneven dim")
        out.append(kw)
        cur = after
    return out


def _axis_by_axis(local_shape, src: tuple, dst: tuple, mesh_shape, uneven=frozenset()) -> list:
    """The conversion's steps one axis at a time (``transition``'s rules), each with this rank's
    shape before it. Which steps, on which axes and dims, depends on the two layouts, the
    number of axes and the uneven dims alone, but for a partial sum over several axes (which
    dim its inner axes reduce-scatter): that plan is remembered (``_PLANS``) and each call only
    walks the shape through it, a mesh's pricing asking for the same pairs of layouts for
    every tensor, and every mesh of as many axes for the same ones again."""
    src, dst, uneven = tuple(src), tuple(dst), frozenset(uneven)
    key = (src, dst, len(mesh_shape), uneven)
    plan = _PLANS.get(key)
    if plan is None:
        plan, shaped = _plan(local_shape, src, dst, mesh_shape, uneven)
        if not shaped:
            if len(_PLANS) >= PLANS_KEPT:
                _PLANS.clear()
            _PLANS[key] = plan
    steps: list = []
    shape = tuple(local_shape)
    for kind, a, dim, dim2, groups in plan:
        st = Step(kind, a, dim, dim2, shape, groups)
        steps.append(st)
        shape = apply_shape(shape, st, mesh_shape[a])
    return steps


_PLANS: dict = {}
PLANS_KEPT = 1 << 16   # plans kept before the memo starts again


def _plan(local_shape, src: tuple, dst: tuple, mesh_shape, uneven) -> tuple:
    """(the steps of ``_axis_by_axis`` as (kind, axis, dim, dim2, groups), whether they depend
    on the shape and the axes' sizes: a partial sum over several axes)."""
    n = len(mesh_shape)
    unshard, reshard = set(), set()
    for a in range(n):
        if src[a] != dst[a]:
            if isinstance(src[a], Split):
                unshard.add(a)
            if isinstance(dst[a], Split):
                reshard.add(a)
    # a dim cut by an outer axis that changes must first be gathered on every inner axis cutting it
    changed = True
    while changed:
        changed = False
        for a in sorted(unshard | reshard):
            dims = {p.dim for p in (src[a], dst[a]) if isinstance(p, Split)}
            for b in range(a + 1, n):
                if isinstance(src[b], Split) and src[b].dim in dims and b not in unshard:
                    unshard.add(b)
                    changed = True
                if isinstance(dst[b], Split) and dst[b].dim in dims and b not in reshard:
                    reshard.add(b)
                    changed = True
    steps: list = []
    cur = list(src)
    shape = tuple(local_shape)

    def emit(kind, a, dim=None, dim2=None, groups=1):
        steps.append((kind, a, dim, dim2, groups))

    # partial sums that end broadcast: reduce while the tensor is smallest. Over several axes,
    # the inner ones reduce-scatter, the outermost all-reduces what is left, and the inner ones
    # gather it back: 2(p-1)/p of the tensor on each inner axis, as an all-reduce there would
    # cost, but the outer all-reduce moves only a 1/(inner ranks) piece
    summed = [a for a in range(n) if isinstance(cur[a], Partial) and isinstance(dst[a], Broadcast)]
    inner = summed[1:]
    q = math.prod(mesh_shape[a] for a in inner)
    dims = [d for d in range(len(shape)) if shape[d] % q == 0 and d not in uneven] if inner else []
    if dims:
        d = max(dims, key=lambda i: shape[i])
        for a in reversed(inner):
            emit("reduce_scatter", a, d)
        emit("all_reduce", summed[0])
        for a in inner:
            emit("all_gather", a, d)
    else:
        for a in summed:
            emit("all_reduce", a)
    for a in summed:
        cur[a] = B
    for a in sorted(unshard, reverse=True):
        d, groups = cur[a].dim, cur[a].groups
        other = [b for b in range(n) if b != a and any(isinstance(x, Split) and x.dim in (d, getattr(dst[a], "dim", None))
                                                       for x in (cur[b], dst[b]))]
        if isinstance(dst[a], Split) and not other and a in reshard and dst[a].dim != d and groups == dst[a].groups == 1:
            emit("all_to_all", a, d, dst[a].dim)
            cur[a] = dst[a]
            reshard.discard(a)
        elif isinstance(dst[a], Partial) and not other:
            emit("pad", a, d, groups=groups)
            cur[a] = P
        else:
            emit("all_gather", a, d, groups=groups)
            cur[a] = B
    for a in sorted(reshard):
        d = dst[a].dim
        emit("reduce_scatter" if isinstance(cur[a], Partial) else "slice", a, d, groups=dst[a].groups)
        cur[a] = dst[a]
    for a in range(n):
        if isinstance(dst[a], Partial) and isinstance(cur[a], Broadcast):
            emit("keep", a)
            cur[a] = P
    if tuple(cur) != tuple(dst):
        raise AssertionError(f"conversion {src} -> {dst} ended at {tuple(cur)}")
    return tuple(steps), bool(inner)


def _joint_step(src: tuple, dst: tuple, n: int):
    """(kind, axes, dim, dim2, groups) of the one collective over the group spanning the axes
    that change, when there are two or more and they all change alike:

        S(d) -> B       all_gather       S(d) -> S(d2)   all_to_all (plain splits)
        P -> S(d)       reduce_scatter   P -> B          all_reduce

    and no unchanged axis inner to the first of them cuts a dim they cut: then they cut it last,
    as one split over their group's ranks flattened in mesh order would. None otherwise."""
    axes = tuple(a for a in range(n) if src[a] != dst[a])
    if len(axes) < 2 or len({src[a] for a in axes}) != 1 or len({dst[a] for a in axes}) != 1:
        return None
    s, t = src[axes[0]], dst[axes[0]]
    if isinstance(s, Split) and isinstance(t, Broadcast):
        kind, d, d2, groups = "all_gather", s.dim, None, s.groups
    elif isinstance(s, Split) and isinstance(t, Split) and s.dim != t.dim and s.groups == t.groups == 1:
        kind, d, d2, groups = "all_to_all", s.dim, t.dim, 1
    elif isinstance(s, Partial) and isinstance(t, Split):
        kind, d, d2, groups = "reduce_scatter", t.dim, None, t.groups
    elif isinstance(s, Partial) and isinstance(t, Broadcast):
        kind, d, d2, groups = "all_reduce", None, None, 1
    else:
        return None
    cut = {d, d2} - {None}
    for b in range(axes[0] + 1, n):
        if b not in axes and isinstance(src[b], Split) and src[b].dim in cut:
            return None
    return kind, axes, d, d2, groups


def dual_steps(steps: list, mesh_shape) -> list:
    """The backward of a conversion: each step's dual, in reverse order."""
    out = []
    for st in reversed(steps):
        after = apply_shape(st.in_shape, st, st.size(mesh_shape))
        if st.kind == "all_to_all":
            out.append(Step("all_to_all", st.axis, st.dim2, st.dim, after))
        else:
            out.append(Step(DUAL[st.kind], st.axis, st.dim, None, after, st.groups))
    return out
