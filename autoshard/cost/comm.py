"""What each step of a layout conversion (``autoshard.convert``) costs, and the collectives an op's
own lowering issues.

One mesh axis of size p, T the bytes of the tensor as that axis sees it:

    from -> to     forward           bytes each rank sends    backward (dual)
    S -> B         all_gather        (p-1)/p * T              reduce_scatter
    P -> B         all_reduce        2(p-1)/p * T             all_reduce
    P -> S         reduce_scatter    (p-1)/p * T              all_gather
    B -> S         slice (local)     0                        pad (S -> P, zero-filled)
    S(i) -> S(j)   all_to_all        (p-1)/p^2 * T            all_to_all back
    B -> P         keep (local)      0                        keep

A ring collective takes (p-1) latency steps; an all-reduce takes the faster of a ring (2(p-1)
steps) and a tree (2 log2 p steps, the whole tensor each way). A step over several axes at once
(``convert``'s joint step) is priced on its group's links (``Cluster.group_link``), and
``transition`` here takes it when that is faster than axis by axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from autoshard import convert
from autoshard.convert import Step
from autoshard.convert import dual_steps  # noqa: F401  (cost.price reads it here)


def transition(local_shape: Sequence[int], src: tuple, dst: tuple, mesh_shape: Sequence[int],
               links=None, itemsize: int = 4, whole: Optional[Sequence[int]] = None) -> list:
    """``convert.transition`` priced on ``links`` (``Cluster.axis_links``) for a tensor of
    ``itemsize`` bytes an element: a conversion one collective over the changing axes' group can
    do runs as that one when it is the faster. Without ``links``, axis by axis."""
    price = None if links is None else (lambda st: step_time(st, itemsize, mesh_shape, links))
    return convert.transition(local_shape, src, dst, mesh_shape, price, whole)


def step_bytes(step: Step, itemsize: int) -> int:
    """Bytes this rank passes into the step (the collective's input)."""
    return math.prod(step.in_shape) * itemsize


def ring_bytes(kind: str, nbytes: float, p: int) -> float:
    """Bytes a ring sends per rank in a collective whose input on each rank is ``nbytes``."""
    if kind == "all_gather":
        return (p - 1) * nbytes                    # T = p * input
    if kind == "all_reduce":
        return 2 * (p - 1) / p * nbytes
    return (p - 1) / p * nbytes                    # reduce_scatter (T = input), all_to_all


def step_time(step: Step, itemsize: int, mesh_shape, links, share: float = 1.0, scale: float = 1.0) -> float:
    """alpha-beta time of one step on its axis (or group of axes), plus the launch overhead of a
    collective; local steps are free of communication. ``links``: ``Cluster.axis_links``. A
    link measured on groups of this shape (``autoshard.measure``) prices the step by its kind's
    fitted latency and bandwidth; otherwise a ring takes p-1 latency steps. ``share`` < 1 when
    the tensor travels in a bucket with others: it pays that part of the launch and latency;
    ``scale``: the bucket's bytes over the tensor's (``fitted_time``)."""
    if not step.is_collective:
        return 0.0
    p = step.size(mesh_shape)
    link = links[step.axis]   # cluster.Links: a tuple of axes gets its group's
    n = step_bytes(step, itemsize)
    if step.kind == "all_reduce":
        return all_reduce_time(n, p, link, share)
    alpha, beta, overhead = link
    fit = _fit(link, step.kind)
    if fit is not None:
        return fitted_time(fit, ring_bytes(step.kind, n, p), overhead, share, scale)
    return share * (overhead + (p - 1) * alpha) + ring_bytes(step.kind, n, p) / beta


def _fit(link, kind: str):
    """(alpha, beta[, points]) of ``kind`` measured on the link's groups, or None."""
    fits = getattr(link, "fits", None)
    return fits.get(kind) if fits else None


def fitted_time(fit, sent: float, overhead: float, share: float = 1.0, scale: float = 1.0) -> float:
    """Seconds of a measured collective sending ``sent`` bytes per rank: its launch and latency
    (``share`` of them in a bucket), and the time its bytes take. With the points it was timed
    at (``autoshard.measure``), that time is read off them, linearly between two, and past the
    last at the slope of the last two: a CPU's collectives slow down per byte as they outgrow
    its caches (gloo's all-gather of 8 MB per rank at world 4 takes three times its 4 MB one),
    which one straight line fitted over all sizes misses at the sizes that carry the bytes.
    ``scale``: the collective sends ``scale`` times ``sent`` (a bucket of which this tensor is a
    part), and this tensor pays its part of that time."""
    alpha, beta = fit[0], fit[1]
    points = fit[2] if len(fit) > 2 else ()
    if not points:
        return share * (overhead + alpha) + sent / beta
    whole = scale * sent
    xs, ts = [0.0], [alpha]
    for x, t in points:
        xs.append(x)
        ts.append(max(t, ts[-1]))   # never faster for more bytes
    i = next((k for k in range(1, len(xs)) if whole <= xs[k]), len(xs) - 1)
    slope = (ts[i] - ts[i - 1]) / (xs[i] - xs[i - 1])
    return share * (overhead + alpha) + (ts[i - 1] - alpha + slope * (whole - xs[i - 1])) / scale


def all_reduce_time(nbytes: int, p: int, link, share: float = 1.0, scale: float = 1.0) -> float:
    """The faster of a ring all-reduce (2(p-1) latency steps, 2(p-1)/p of the tensor sent) and a
    tree (2 log2 p steps, the whole tensor up and down), as NCCL picks by size: small tensors
    (a loss's sum, a norm's statistics) pay log p latency, not p. ``share`` < 1 when the tensor
    rides in a bucket with others and pays only that part of the bucket's launch and latency.
    A measured link (``autoshard.measure``) prices it by the fitted latency and bandwidth of the
    all-reduce its groups ran, whatever algorithm the backend chose; ``scale`` as in
    ``fitted_time`` (a bucket's member moves its bytes at the bucket's rate)."""
    alpha, beta, overhead = link
    fit = _fit(link, "all_reduce")
    if fit is not None:
        return fitted_time(fit, ring_bytes("all_reduce", nbytes, p), overhead, share, scale)
    ring = share * 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta
    tree = share * 2 * math.ceil(math.log2(p)) * alpha + 2 * nbytes / beta
    return share * overhead + min(ring, tree)


def group_all_reduce_time(nbytes: int, axes: Sequence[int], mesh_shape, cluster, share: float = 1.0,
                          scale: float = 1.0) -> float:
    """All-reduce over the ranks of several axes at once (a gradient bucket's group): one
    collective on one communicator spanning them, as the runtime issues it
    (``runtime.RankMesh.group``), so NCCL runs it flat over the whole group, on the group's own
    links (``Cluster.group_link``); ``share`` and ``scale`` as in ``all_reduce_time``."""
    axes = sorted(axes)
    p = math.prod(mesh_shape[a] for a in axes)
    return all_reduce_time(nbytes, p, cluster.group_link(mesh_shape, axes), share, scale)


@dataclass(frozen=True)
class OpCollective:
    kind: str
    axis: int
    nbytes: int          # the collective's input on each rank
    phase: str = "forward"


def op_collective_time(c: OpCollective, mesh_shape, links) -> float:
    """Seconds of one collective an op's lowering issues, by its kind."""
    if c.kind == "all_reduce":
        return all_reduce_time(c.nbytes, mesh_shape[c.axis], links[c.axis])
    return step_time(Step(c.kind, c.axis, in_shape=(c.nbytes,)), 1, mesh_shape, links)


def op_collectives(node, strat, graph, mesh_shape, arrived=()) -> list:
    """Collectives an op's own lowering issues (beyond layout conversions). ``arrived``: the user
    inputs that arrive as each rank's rows (``autoshard.inputs``), which no rank holds whole."""
    from autoshard.rules.conv import norm_collectives
    from autoshard.rules.indexing import scan_collectives
    from autoshard.rules.moe import expert_collectives, sort_collectives
    from autoshard.rules.nn import count_axes, whole_targets
    fx_node = node.fx_node
    axes = count_axes(node.target, fx_node.args, fx_node.kwargs, strat.inputs) if node.kind == "op" else []
    whole = whole_targets(graph, node) if axes else None
    if whole is not None and whole not in arrived:   # counted on the whole targets, every rank alike
        axes = []
    return ([OpCollective("all_reduce", a, 8) for a in axes if mesh_shape[a] > 1]
            + [OpCollective(*c) for c in norm_collectives(node, strat, graph, mesh_shape)]
            + [OpCollective(*c) for c in expert_collectives(node, strat, graph, mesh_shape)]
            + [OpCollective(*c) for c in scan_collectives(node, strat, mesh_shape)]
            + [OpCollective(*c) for c in sort_collectives(node, strat, mesh_shape)])
