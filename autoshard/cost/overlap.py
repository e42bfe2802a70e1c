"""What the schedule pass hides of the activations' communication, priced.

The schedule pass starts each collective step of an activation's layout conversion right after
its input is made and waits for it right before its first use; backward mirrors it with the dual
step (``passes.schedule``). A conversion's collectives therefore cost only what the compute
running beside them does not cover. Counted here, per conversion, is the compute the schedule
places beside it whatever the rest of the plan:

    forward    a gathered input's own block of the linear that takes it (collective matmul)
    backward   that block's input gradient; or, for a linear not so decomposed, its weight
               gradient, made while the dual step flies (AxoNN's backward,
               ``passes.schedule._weight_grads_later``), where its weight is a parameter (a
               decomposed linear makes its weight gradient before the dual step starts)

Other ops that happen to run between a start and its wait are not counted: they depend on the
whole plan, not on the conversion's layouts.

A conversion by one all-reduce or reduce-scatter of a linear's output that nothing else reads can
also be overdecomposed (Tensor3D; ``passes.overdecompose``): the linear runs on k chunks of its
input, cut on a dim the step does not cut, and each chunk's step starts as soon as the chunk is
made, so chunk i's step runs while chunk i + 1 computes; backward likewise. With chunks of
compute c and communication d, the pipeline overlaps

    k * (c + d) - (c + (k - 1) * max(c, d) + d) = (k - 1) * min(c, d)

Chunking has a price, the drag: k launches and latencies of the step instead of one (a chunk's
``cost.comm.step_time``), k smaller matmuls that each read the whole weight (a chunk's
``cost.compute.op_time``, with each launch on a measured cluster), and the split and the
concatenation. k is the candidate in ``CHUNKS`` that gives the lowest step, 1 where chunking costs
more than it hides. Only ``Cluster.overlap`` of what overlaps is hidden (none on a CPU whose cores
the compute takes), and what is hidden pays ``cost.step.DRAG`` like every overlapped collective.

Every price of a plan adds ``edge_price``, a conversion's ``Overlap.delta`` (its change against
the conversion priced blocking, ``cost.price.Costs.convert``), to the conversion's own: the
solver's program (``planner.solve._pairs``), ``choice_cost``, ``plan.cost``, ``explain`` and
``formula``; a conversion into a block that recomputes gives it back (``unhidden``). It is a
function of the conversion's layouts alone (the covering compute is that of the producer's and
the consumer's least-computing strategies with them, of every strategy the graph offers on the
mesh, pins aside), so a whole solve, a descent's step, the LP bound and a
pinned plan price one choice alike. Each covering compute is counted for one conversion: a
linear's weight gradient covers the dual of its input's conversion (the schedule makes it beside
a bare step of the run of waits before the linear, that one where it is bare), so
a chunk pipeline's backward counts the chunks' input gradients only, and a conversion of several
steps has only its last step's dual covered by it. ``plan`` writes the chunks it chose into
``plan.schedule["chunks"]``, which the schedule pass carries out, and what the conversions hide
into ``plan.breakdown["activations_hidden"]``.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from autoshard import placement as pl
from autoshard.convert import dual_steps
from autoshard.cost import comm, compute, memory
from autoshard.cost.step import DRAG, Cost
from autoshard.ir import per_graph

CHUNKS = (1, 2, 4, 8)
CHUNKED_KINDS = ("all_reduce", "reduce_scatter")
# this module's caches live on the ``Costs`` they price for, as long as it does (``_memo``):
# "overlaps" {edge and layouts: Overlap}, "least" {(node, side): {layout: strategy}}, "steps"
# {shape and layouts: step times}, "kinds" {edge: edge_kind}, "kind_ids" {kind: its number}
_LINEAR = torch.ops.aten.linear.default


@dataclass(frozen=True)
class Overlap:
    producer: str          # the graph node that makes the value
    consumer: str          # the graph node that takes it converted
    kinds: tuple           # its collective steps' kinds
    chunks: int            # k: how many chunks its producer and steps run in (1: not chunked)
    dim: int               # the dim of the producer's input the chunks cut (-1 when not chunked)
    fwd: float             # seconds of its forward collectives, as they run (k chunks each)
    bwd: float             # seconds of their duals in backward
    hidden_fwd: float      # the part of ``fwd`` compute covers
    hidden_bwd: float
    delta: Cost            # its price against the conversion priced blocking: exposed, hidden, drag


def _memo(costs, name: str) -> dict:
    """This module's cache ``name`` (``"_overlap_..."``) on ``costs`` (an attribute: a dict keyed
    by the object would hash it on every look-up)."""
    cache = costs.__dict__.get(name)
    if cache is None:
        cache = costs.__dict__[name] = {}
    return cache


def edge_price(costs, value, src, dst, consumer, slot: int) -> Cost:
    """What the schedule changes of converting ``value`` from ``src`` to ``dst`` for
    ``consumer``'s input ``slot`` against its blocking price (``Costs.convert``): its
    ``Overlap.delta``, nothing where the schedule does not start it early. Every price of a
    plan adds it to the conversion's (the solver's program, ``planner.solve._pairs``;
    ``choice_cost``, ``plan.cost``, ``explain``, ``formula``), so a plan is chosen by what it
    hides and reports the step it was chosen by."""
    o = _cached(costs, value, src, dst, consumer, slot)
    return o.delta if o is not None else Cost()


def conversion_price(costs, value, src, dst, consumer, slot: int) -> Cost:
    """A conversion's price in every plan: blocking (``Costs.convert``), less what the schedule
    hides of it (``edge_price``)."""
    o = _cached(costs, value, src, dst, consumer, slot)
    blocking = costs.convert(value, src, dst, consumer)
    return blocking if o is None else blocking + o.delta


def unhidden(costs, value, src, dst, consumer, slot: int) -> float:
    """Seconds converting ``value`` for ``consumer`` (an op of a block that recomputes) adds to
    its price, once per such block: what the price counts the schedule hiding of it, its drag
    deducted (``-added`` of its ``Overlap``; nothing where it hides nothing). A recomputed block
    runs in a checkpointed submodule, which the schedule pass leaves as it is
    (``passes.checkpoint``), so there its collectives and their duals block where the rewriter
    put them and nothing is chunked. ``planner.recompute`` adds it, as communication, beside the
    forward the block runs again: in the solver's program and in ``plan.cost`` alike."""
    o = _cached(costs, value, src, dst, consumer, slot)
    return -added(o) if o is not None else 0.0


def overlaps(costs, value, consumer, slot: int) -> bool:
    """Whether converting ``value`` for ``consumer``'s input ``slot`` may hide anything: an
    activation's between two ops, taken by a linear or made by one that nothing else reads
    (only such compute is counted beside it). Where not, ``edge_price`` is nothing whatever
    the layouts."""
    graph = costs.graph
    producer = graph.by_name[value[0]]
    if producer.kind != "op" or consumer.kind != "op" or memory.in_region(graph, value, consumer):
        return False
    taken = consumer.target is _LINEAR and slot == 0
    return taken or (producer.target is _LINEAR and _readers(graph).get(value) == 1)


def edge_overlap(costs, value, src, dst, consumer, slot: int):
    """The ``Overlap`` of converting ``value`` from ``src`` to ``dst`` for ``consumer``'s input
    ``slot``; None where the schedule does not start it early (a parameter's, or none of its
    steps a collective). The compute beside it is that of the producer's and the consumer's
    least-computing strategies with these layouts, of every strategy the graph offers them on
    this mesh, pins aside: what a conversion's layouts alone guarantee, the same for a pinned
    plan, a descent's step and a whole solve."""
    o = _cached(costs, value, src, dst, consumer, slot)
    return None if o is None else dataclasses.replace(o, producer=value[0], consumer=consumer.name)


def edge_kind(costs, value, consumer, slot: int):
    """What a conversion's ``Overlap`` depends on besides its tensor's shape and layouts: its
    producer's and consumer's ops, shapes and strategy lists, whether the value has other
    readers, whether the linears' weight gradients are made later; None where it is never
    started early (``overlaps``); a number stands for it, the same for equal kinds of one
    ``Costs``. Edges of a model's blocks share it, and so their prices."""
    cache = _memo(costs, "_overlap_kinds")
    key = (value, consumer.name, slot)
    if key not in cache:
        graph = costs.graph
        full = _full(costs)

        def side(n):
            return (n.target, id(full[n.name]), tuple(graph.meta(v) for v in n.inputs), n.requires_grad,
                    n.region is not None, n.target is _LINEAR and _weight_grad_later(graph, n))
        kind = (side(graph.by_name[value[0]]), value[1], _readers(graph).get(value) == 1, side(consumer),
                slot, value[0] in costs._copies) if overlaps(costs, value, consumer, slot) else None
        # a small number stands for it: ``_cached`` looks it up by the hundred thousand, and
        # the key is deep
        ids = _memo(costs, "_overlap_kind_ids")
        cache[key] = None if kind is None else ids.setdefault(kind, len(ids))
    return cache[key]


def _cached(costs, value, src, dst, consumer, slot: int):
    """The ``Overlap`` of one edge kind (``edge_kind``) converting its tensor's shape from
    ``src`` to ``dst``, worked out for the first edge of that kind (its names those of that edge)."""
    kind = edge_kind(costs, value, consumer, slot)
    if kind is None:
        return None
    cache = _memo(costs, "_overlap_overlaps")
    key = (kind, costs.graph.meta(value), src, dst)
    if key not in cache:
        # no collective, nothing to hide: its blocking price (cached) says so at once
        moves = costs.convert(value, src, dst, consumer).communication > 0
        cache[key] = _overlap(costs, value, src, dst, consumer, slot) if moves else None
    return cache[key]


def _overlap(costs, value, src, dst, consumer, slot: int):
    """``edge_overlap`` of a conversion between two ops, worked out: its k of least step."""
    producer = costs.graph.by_name[value[0]]
    e = _edge(costs, consumer, slot, value, src, dst, lambda: _least(costs, consumer, ("in", slot), dst))
    if e is None:
        return None
    best = None
    made = lambda: _least(costs, producer, ("out", value[1]), src)   # noqa: E731
    for k, dim, drag_f, drag_b, c_f, c_b, d_f, d_b in _chunkings(costs, e, made):
        o = _price(e, k, dim, e["cover_fwd"], e["cover_bwd"], drag_f, drag_b, c_f, c_b, d_f, d_b,
                   costs.cluster.overlap)
        if best is None or added(o) < added(best) - 1e-15:
            best = o
    return best


def _least(costs, node, side: tuple, layout):
    """The strategy of ``node`` that computes least of those that take (``side`` ("in", slot))
    or make (("out", index)) a tensor in ``layout``, of every strategy the graph offers it on
    this mesh (``passes.annotate``, no pins)."""
    cache = _memo(costs, "_overlap_least")
    key = (node.name, side)
    if key not in cache:
        least: dict = {}
        for st in _full(costs)[node.name]:
            at = st.inputs[side[1]] if side[0] == "in" else st.outputs[side[1]]
            c = costs.node(node, st).compute
            if at not in least or c < least[at][0]:
                least[at] = (c, st)
        cache[key] = {at: st for at, (_, st) in least.items()}
    return cache[key][layout]


def _full(costs) -> dict:
    """Every strategy the graph offers each node on the mesh, pins aside (``passes.annotate``)."""
    cache = _memo(costs, "_overlap_least")
    if "strategies" not in cache:
        from autoshard.passes.annotate import annotate
        with warnings.catch_warnings():   # the planner has warned of ops without a rule already
            warnings.simplefilter("ignore")
            cache["strategies"] = annotate(costs.graph, costs.mesh_shape)
    return cache["strategies"]


@per_graph
def _readers(graph) -> dict:
    """value -> how many inputs of the graph's nodes read it."""
    return {v: len(u) for v, u in graph.users().items()}


def added(o: Overlap) -> float:
    """What the conversion adds to the step against its blocking price: the drag, the exposed
    collectives, and the overlap's own drag on what is hidden (the compute that hides it counts
    already)."""
    d = o.delta
    return d.compute + d.comm + DRAG * (d.hidden_fwd + d.hidden_bwd)


def _edge(costs, n, slot, value, src, dst, strat):
    """The conversion of ``value`` from ``src`` to ``dst`` for ``n``'s input ``slot`` (``n``
    running ``strat()``), when the schedule runs its collectives as start/wait pairs around
    compute: an activation's, not made again in backward."""
    graph = costs.graph
    producer = graph.by_name[value[0]]
    meta = graph.meta(value)
    backward = costs.training and meta.floating and producer.requires_grad
    steps, duals, fwd, bwd, prefetched = _step_times(costs, value, src, costs.handed_over(value, src, dst, n), backward)
    if prefetched or not any(st.is_collective for st in steps):
        return None
    e = {"consumer": n, "slot": slot, "value": value, "steps": steps, "duals": duals, "fwd": fwd, "bwd": bwd,
         "cover_fwd": 0.0, "cover_bwd": 0.0}
    if n.target is not _LINEAR or slot != 0:
        return e
    c = costs.node(n, strat())
    # an all-gather on a dim other than the features, into a linear: its own block's rows are made
    # while the gather flies, and their input gradient while the dual reduce-scatter does
    gathered = (len(steps) == 1 and steps[0].kind == "all_gather" and steps[0].groups == 1
                and steps[0].dim % len(meta.shape) != len(meta.shape) - 1)
    if gathered:
        p = steps[0].size(costs.mesh_shape)
        e["cover_fwd"], e["cover_bwd"] = c.compute_fwd / p, c.compute_bwd / 2 / p
    # the linear's weight gradient, made while the dual of its input's last step flies (AxoNN's
    # backward: passes.schedule._weight_grads_later), where its weight is a parameter. Not a
    # gathered linear's (a collective matmul, ``runtime.linear_gathered``): the schedule leaves it
    # to that linear's own backward, which makes the weight's gradient before the dual
    # reduce-scatter starts, so only its own block's input gradient flies beside it
    if duals and not gathered and _weight_grad_later(graph, n):
        # it flies beside the dual of the last step only, the first of backward
        e["cover_bwd"] += c.compute_bwd / 2 if len(duals) == 1 else min(c.compute_bwd / 2, bwd[0])
    return e


def _weight_grad_later(graph, linear) -> bool:
    """Whether the schedule makes a linear's weight gradient while the dual of a step before it
    flies (``passes.schedule._weight_grads_later``): where its weight is a parameter. That half
    of its backward is then no cover for anything else."""
    weight = graph.by_name[linear.inputs[1][0]] if len(linear.inputs) > 1 else None
    return weight is not None and weight.kind == "param" and weight.requires_grad


def _step_times(costs, value, src, dst, backward: bool) -> tuple:
    """``Costs.step_times``, once per tensor shape and layouts: the edges of a model's blocks
    convert the same shapes between the same layouts over and over."""
    cache = _memo(costs, "_overlap_steps")
    key = (costs.graph.meta(value), value[0] in costs._copies, src, dst, backward)
    if key not in cache:
        cache[key] = costs.step_times(value, src, dst, backward)
    return cache[key]


def chunk_dim(shape, steps, k: int):
    """The dim of a linear's input (``shape``, this rank's) to cut into ``k`` chunks so that its
    output's steps run on each chunk alone: a leading dim the steps do not cut, at least ``k``
    long; None where there is none."""
    cut = {st.dim % len(shape) for st in steps if st.dim is not None}
    for d in range(len(shape) - 1):
        if d not in cut and shape[d] >= k:
            return d
    return None


def _chunkings(costs, e, strat):
    """(k, dim, forward drag, backward drag, chunk compute forward and backward, chunk steps'
    seconds forward and backward) for every k the conversion can run in, its producer running
    ``strat()``; k = 1 first."""
    d_f, d_b = sum(e["fwd"]), sum(e["bwd"])
    yield 1, -1, 0.0, 0.0, 0.0, 0.0, d_f, d_b
    graph, value, steps = costs.graph, e["value"], e["steps"]
    producer = graph.by_name[value[0]]
    if not (producer.target is _LINEAR and _readers(graph).get(value) == 1 and len(steps) == 1
            and steps[0].kind in CHUNKED_KINDS and steps[0].groups == 1):
        return
    mesh, cluster = costs.mesh_shape, costs.cluster
    strat = strat()
    whole = costs.node(producer, strat)
    metas = [graph.meta(v) for v in producer.inputs]
    ins = [pl.local_shape(m.shape, p, mesh) for m, p in zip(metas, strat.inputs)]
    out = pl.local_shape(producer.outputs[0].shape, strat.outputs[0], mesh)
    itemsize = max([m.itemsize for m in metas + producer.outputs if m.floating] or [4])
    meta = graph.meta(value)
    for k in CHUNKS[1:]:
        dim = chunk_dim(ins[0], steps, k)
        if dim is None:
            continue
        rows = math.ceil(ins[0][dim] / k)
        cin = [tuple(rows if i == dim else s for i, s in enumerate(ins[0]))] + ins[1:]
        cout = tuple(rows if i == dim else s for i, s in enumerate(out))
        c_f = compute.op_time(producer.target, cin, [cout], itemsize, cluster)
        c_b = (compute.backward_time(producer.target, cin, [cout], itemsize, cluster)
               if e["duals"] else 0.0)
        # the split, the concatenation and each chunk's start and wait: launches
        ops = 2 + 2 * k
        drag_f = k * c_f - whole.compute_fwd + ops * cluster.op_overhead
        drag_b = (k * c_b - whole.compute_bwd + ops * cluster.backward_overhead) if e["duals"] else 0.0
        chunk = steps[0]._replace(in_shape=cout)
        s_f = comm.step_time(chunk, meta.itemsize, mesh, costs.links)
        s_b = sum(comm.step_time(st, meta.itemsize, mesh, costs.links) for st in dual_steps([chunk], mesh)) \
            if e["duals"] else 0.0
        # what covers the pipeline in backward: a chunk's input gradient only, where its
        # weight's is made later, beside another step
        yield k, dim, drag_f, drag_b, c_f, c_b / 2 if _weight_grad_later(graph, producer) else c_b, k * s_f, k * s_b


def _price(e, k, dim, cover_f, cover_b, drag_f, drag_b, c_f, c_b, d_f, d_b, hide: float) -> Overlap:
    """The conversion in ``k`` chunks: its collectives (``d_f``, ``d_b`` seconds in all) hidden
    by the pipeline and the compute that covers them, and what chunking adds."""
    def hidden(d, c, cover):
        piped = (k - 1) * min(c, d / k) if k > 1 else 0.0
        return hide * min(d, piped + cover)
    h_f = hidden(d_f, c_f, cover_f)
    h_b = hidden(d_b, c_b, cover_b) if e["duals"] else 0.0
    blocking = sum(e["fwd"]) + sum(e["bwd"])
    delta = Cost(compute_fwd=drag_f, compute_bwd=drag_b, comm=d_f + d_b - h_f - h_b - blocking,
                 hidden_fwd=h_f, hidden_bwd=h_b)
    return Overlap(e["value"][0], e["consumer"].name, tuple(st.kind for st in e["steps"] if st.is_collective),
                   k, dim, d_f, d_b, h_f, h_b, delta)
