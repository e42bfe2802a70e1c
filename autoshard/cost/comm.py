"""Layout conversions as steps, and what each step costs.

One mesh axis of size p, T the bytes of the tensor as that axis sees it:

    from -> to     forward           bytes each rank sends    backward (dual)
    S -> B         all_gather        (p-1)/p * T              reduce_scatter
    P -> B         all_reduce        2(p-1)/p * T             all_reduce
    P -> S         reduce_scatter    (p-1)/p * T              all_gather
    B -> S         slice (local)     0                        pad (S -> P, zero-filled)
    S(i) -> S(j)   all_to_all        (p-1)/p^2 * T            all_to_all back
    B -> P         keep (local)      0                        keep

A ring collective takes (p-1) latency steps; an all-reduce takes the faster of a ring (2(p-1)
steps) and a tree (2 log2 p steps, the whole tensor each way). On several axes the conversion
runs one axis at a time: gathers innermost axis first, splits outermost first, so a dim cut by
several axes always holds the contiguous chunk DTensor's order prescribes. A partial sum over
several axes is reduced hierarchically (reduce-scatter inside, all-reduce across, all-gather). This module is the one
place that decides which steps a conversion takes; the cost model and the rewriter both use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from autoshard.placement import B, P, Broadcast, Partial, Split

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "all_reduce",
        "all_to_all": "all_to_all", "slice": "pad", "pad": "slice", "keep": "keep"}


@dataclass(frozen=True)
class Step:
    kind: str
    axis: int
    dim: Optional[int] = None     # the tensor dim gathered, scattered or sliced
    dim2: Optional[int] = None    # all_to_all: the dim split after the step
    in_shape: tuple = ()          # this rank's shape before the step
    groups: int = 1               # a blocked split S(dim)/groups: the step runs within each block

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    def __repr__(self) -> str:
        extra = f", dim={self.dim}" if self.dim is not None else ""
        extra += f"->{self.dim2}" if self.dim2 is not None else ""
        extra += f"/{self.groups}" if self.groups != 1 else ""
        return f"{self.kind}(axis={self.axis}{extra})"


def _apply_shape(shape, step: Step, p: int):
    s = list(shape)
    if step.kind in ("all_gather", "pad"):
        s[step.dim] *= p
    elif step.kind in ("reduce_scatter", "slice"):
        s[step.dim] //= p
    elif step.kind == "all_to_all":
        s[step.dim] *= p
        s[step.dim2] //= p
    return tuple(s)


def transition(local_shape: Sequence[int], src: tuple, dst: tuple, mesh_shape: Sequence[int]) -> list:
    """Steps that turn a tensor held as ``src`` (with this rank's ``local_shape``) into ``dst``."""
    n = len(mesh_shape)
    if tuple(src) == tuple(dst):
        return []
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
        nonlocal shape
        st = Step(kind, a, dim, dim2, shape, groups)
        steps.append(st)
        shape = _apply_shape(shape, st, mesh_shape[a])

    # partial sums that end broadcast: reduce while the tensor is smallest. Over several axes,
    # the inner ones reduce-scatter, the outermost all-reduces what is left, and the inner ones
    # gather it back: 2(p-1)/p of the tensor on each inner axis, as an all-reduce there would
    # cost, but the outer all-reduce moves only a 1/(inner ranks) piece
    summed = [a for a in range(n) if isinstance(cur[a], Partial) and isinstance(dst[a], Broadcast)]
    inner = summed[1:]
    q = math.prod(mesh_shape[a] for a in inner)
    dims = [d for d in range(len(shape)) if shape[d] % q == 0] if inner else []
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
    return steps


def dual_steps(steps: list, mesh_shape) -> list:
    """The backward of a conversion: each step's dual, in reverse order."""
    out = []
    for st in reversed(steps):
        after = _apply_shape(st.in_shape, st, mesh_shape[st.axis])
        if st.kind == "all_to_all":
            out.append(Step("all_to_all", st.axis, st.dim2, st.dim, after))
        else:
            out.append(Step(DUAL[st.kind], st.axis, st.dim, None, after, st.groups))
    return out


def step_bytes(step: Step, itemsize: int) -> int:
    """Bytes this rank passes into the step (the collective's input)."""
    return math.prod(step.in_shape) * itemsize


def step_time(step: Step, itemsize: int, mesh_shape, links) -> float:
    """alpha-beta time of one step on its axis, plus the launch overhead of a collective; local
    steps are free of communication."""
    if not step.is_collective:
        return 0.0
    p = mesh_shape[step.axis]
    alpha, beta, overhead = links[step.axis]
    n = step_bytes(step, itemsize)
    if step.kind == "all_gather":
        sent, hops = (p - 1) * n, p - 1            # T = p * input
    elif step.kind == "reduce_scatter":
        sent, hops = (p - 1) / p * n, p - 1        # T = input
    elif step.kind == "all_reduce":
        return all_reduce_time(n, p, links[step.axis])
    else:  # all_to_all, T = p * input as seen on the axis
        sent, hops = (p - 1) / p * n, p - 1
    return overhead + hops * alpha + sent / beta


def all_reduce_time(nbytes: int, p: int, link, share: float = 1.0) -> float:
    """The faster of a ring all-reduce (2(p-1) latency steps, 2(p-1)/p of the tensor sent) and a
    tree (2 log2 p steps, the whole tensor up and down), as NCCL picks by size: small tensors
    (a loss's sum, a norm's statistics) pay log p latency, not p. ``share`` < 1 when the tensor
    rides in a bucket with others and pays only that part of the bucket's launch and latency."""
    alpha, beta, overhead = link
    ring = share * 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta
    tree = share * 2 * math.ceil(math.log2(p)) * alpha + 2 * nbytes / beta
    return share * overhead + min(ring, tree)


def group_all_reduce_time(nbytes: int, axes: Sequence[int], mesh_shape, cluster, share: float = 1.0) -> float:
    """All-reduce over the ranks of several axes at once (a gradient bucket's group): one
    collective on one communicator spanning them, as the runtime issues it
    (``runtime.RankMesh.group``), so NCCL runs it flat over the whole group, on the group's own
    links (``Cluster.group_link``); ``share`` as in ``all_reduce_time``."""
    axes = sorted(axes)
    p = math.prod(mesh_shape[a] for a in axes)
    return all_reduce_time(nbytes, p, cluster.group_link(mesh_shape, axes), share)


@dataclass(frozen=True)
class OpCollective:
    kind: str
    axis: int
    nbytes: int


def op_collectives(node, strat, graph, mesh_shape) -> list:
    """Collectives an op's own lowering issues (beyond layout conversions)."""
    from autoshard.rules.conv import norm_collectives
    from autoshard.rules.nn import count_axes
    fx_node = node.fx_node
    axes = count_axes(node.target, fx_node.args, fx_node.kwargs, strat.inputs) if node.kind == "op" else []
    return ([OpCollective("all_reduce", a, 8) for a in axes if mesh_shape[a] > 1]
            + [OpCollective(*c) for c in norm_collectives(node, strat, graph, mesh_shape)])
