"""What cutting the batch into k interleaved chunks hides (``passes.interleave``), priced, and the
k a plan runs with.

The ops between two activation collectives form a segment. Interleaved, chunk i's collective
at the end of segment s flies while chunk i + 1 computes segment s, and in backward chunk i's
dual flies while chunk i + 1's backward of segment s + 1 runs. Per boundary s, with E the
communication the plan leaves exposed there (its conversions' seconds less what
``cost.overlap`` already counts hidden, all chunks together) and C the compute that runs beside
it (all chunks together), a pipeline of k chunks hides

    (k - 1) / k * min(E, C)

of it, times the cluster's ``overlap`` (the fraction of a scheduled collective that compute
beside it hides), each hidden second paying ``cost.step.DRAG`` as every overlapped one does.
Chunking costs each collective step k - 1 more launches and latencies, and each op k - 1 more
launches (a measured cluster's ``op_overhead`` and ``backward_overhead``). k is the one of
``CHOICES`` that saves the most, 1 where none saves anything; the batch must divide by it on
every rank.

Each mesh's plan is solved without it; its saving is then taken off the plan's estimated step
(``plan.cost``; ``plan.breakdown``: ``interleave_saved``, moved from ``exposed`` to ``hidden``)
and off the step a mesh search compares meshes by (``planner.make.plan_cost``), so the search prefers
the mesh whose plan interleaves well; the schedule pass carries it out
(``plan.schedule["interleave"]``). ``Plan.explain`` prices a node's alternatives as the solver
does, against the chosen layout's step before the saving. Recomputed blocks run in checkpointed
submodules, which are not cut: their ops and conversions count for nothing here.
"""
from __future__ import annotations

import math

from autoshard import placement as pl
from autoshard.convert import Step
from autoshard.cost import comm
from autoshard.cost.step import DRAG

CHOICES = (1, 2, 4)


def _launch(costs, c) -> float:
    """Seconds the collective ``c`` (``plan.Collective``) costs whatever its size: its launch
    and latency, what each extra chunk pays again."""
    step = Step(c.kind, c.axes if len(c.axes) > 1 else c.axes[0], 0, 1, in_shape=(0,))
    return comm.step_time(step, 4, costs.mesh_shape, costs.links)


def batch_size(graph, strategies, choice, costs):
    """The batch each rank holds: dim 0 of the local shapes of the inputs of two or more dims
    (as ``passes.interleave`` reads it: one-dim inputs, positions say, may be anything), None
    where they disagree."""
    sizes = set()
    for name in graph.user_inputs:
        node = graph.by_name[name]
        if not node.outputs or len(node.outputs[0].shape) < 2:
            continue
        strat = strategies[name][choice[name]]
        sizes.add(pl.local_shape(node.outputs[0].shape, strat.outputs[0], costs.mesh_shape)[0])
    return sizes.pop() if len(sizes) == 1 else None


def choose(graph, strategies, choice, costs, rerun, collectives) -> tuple:
    """(k, seconds saved) for the plan ``choice``; ``rerun``: the nodes of its recomputed blocks;
    ``collectives()``: its collectives (``plan.Collective``) and its conversions'
    ``cost.overlap.Overlap`` records (of the blocks run as they are), asked for only where the
    batch can be cut (a mesh search prices many plans whose batch cannot)."""
    batch = batch_size(graph, strategies, choice, costs)
    if batch is None:
        return 1, 0.0
    colls, overlaps = collectives()
    edges = {(o.producer, o.consumer): o for o in overlaps if o.fwd > 0 and o.chunks == 1}
    if not edges:
        return 1, 0.0
    seg, c_f, c_b, ops = {}, {}, {}, 0
    for n in graph.nodes:
        if n.kind != "op" or n.name in rerun:
            seg[n.name] = 0
            continue
        seg[n.name] = max((seg[u] + ((u, n.name) in edges) for u, _ in n.inputs), default=0)
        cost = costs.node(n, strategies[n.name][choice[n.name]])
        c_f[seg[n.name]] = c_f.get(seg[n.name], 0.0) + cost.compute_fwd
        c_b[seg[n.name]] = c_b.get(seg[n.name], 0.0) + cost.compute_bwd
        ops += 1
    e_f, e_b = {}, {}
    for (producer, _), o in edges.items():
        s = seg[producer]
        e_f[s] = e_f.get(s, 0.0) + max(0.0, o.fwd - o.hidden_fwd)
        e_b[s] = e_b.get(s, 0.0) + max(0.0, o.bwd - o.hidden_bwd)
    consumers = {consumer for _, consumer in edges}
    launches = sum(_launch(costs, c) for c in colls if c.node in consumers)
    cluster = costs.cluster
    best = (1, 0.0)
    for k in CHOICES[1:]:
        if batch % k:
            continue
        hidden = sum(min(e_f[s], c_f.get(s, 0.0)) + min(e_b.get(s, 0.0), c_b.get(s + 1, 0.0)) for s in e_f)
        hidden *= (k - 1) / k * cluster.overlap
        drag = (k - 1) * (launches + ops * (cluster.op_overhead + cluster.backward_overhead))
        saved = hidden * (1 - DRAG) - drag
        if saved > best[1]:
            best = (k, saved)
    return best
