"""What the schedule pass hides of the activations' communication, priced.

The schedule pass starts each collective step of an activation's layout conversion right after
its input is made and waits for it right before its first use; backward mirrors it with the dual
step (``passes.schedule``). A conversion's collectives therefore cost only what the compute
running beside them does not cover. Counted here, per conversion, is the compute the schedule
places beside it whatever the rest of the plan:

    forward    a gathered input's own block of the linear that takes it (collective matmul)
    backward   that block's input gradient, and the weight gradient of the linear that takes the
               converted value, made while the dual step flies (AxoNN's backward,
               ``passes.schedule._weight_grads_later``), where its weight is a parameter

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

``activation_overlap`` prices the chosen plan: one ``Overlap`` per conversion, with the change
(``delta``) to its price as a blocking conversion (``cost.price.Costs.convert``). ``plan`` writes
the chunks it chose into ``plan.schedule["chunks"]``, which the schedule pass carries out, and
what they hide into ``plan.breakdown["activations_hidden"]``. The estimated step and the solver
still price activation conversions blocking: fed into the solver (every conversion's price less
its ``delta``, computed from its layouts alone, as ``edge_overlap`` does), the mesh search's
descent reached other local optima, some worse than before (a 7.3B block on 256 A100s: 52.2 ms
against 50.7), and AxoNN's hand layout beat the plan it found by 3%.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch

from autoshard import placement as pl
from autoshard.cost import comm, compute, memory
from autoshard.cost.step import DRAG, Cost

CHUNKS = (1, 2, 4, 8)
CHUNKED_KINDS = ("all_reduce", "reduce_scatter")
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


def activation_overlap(graph, strategies: dict, choice: dict, costs) -> list:
    """One ``Overlap`` for each conversion of an activation by collectives that the schedule
    starts early and waits on late, in the plan that picks ``choice`` (node name -> index) of
    ``strategies``: what each hides, reported in the plan's breakdown (the solver does not price it yet)."""
    out = []
    for n in graph.nodes:
        chosen = strategies[n.name][choice[n.name]]
        for slot, value in enumerate(n.inputs):
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            o = edge_overlap(costs, value, src, chosen.inputs[slot], n, slot, strategies[value[0]], strategies[n.name])
            if o is not None:
                out.append(o)
    return out


def edge_overlap(costs, value, src, dst, consumer, slot: int, producers: list, consumers: list):
    """The ``Overlap`` of converting ``value`` from ``src`` to ``dst`` for ``consumer``'s input
    ``slot``; None where the schedule does not start it early (a parameter's, or none of its
    steps a collective). The compute beside it is that of the producer's and the consumer's
    least-computing strategies (of ``producers``, ``consumers``) with these layouts: what a
    conversion's layouts alone guarantee."""
    graph = costs.graph
    producer = graph.by_name[value[0]]
    if producer.kind != "op" or consumer.kind != "op":
        return None
    e = _edge(costs, consumer, slot, value, src, dst,
              lambda: _least(costs, consumer, consumers, lambda st: st.inputs[slot] == dst))
    if e is None:
        return None
    strat = _least(costs, producer, producers, lambda st: st.outputs[value[1]] == src)
    best = None
    for k, dim, drag_f, drag_b, c_f, c_b, d_f, d_b in _chunkings(costs, e, strat, costs.node(producer, strat)):
        o = _price(e, k, dim, e["cover_fwd"], e["cover_bwd"], drag_f, drag_b, c_f, c_b, d_f, d_b,
                   costs.cluster.overlap)
        if best is None or added(o) < added(best) - 1e-15:
            best = o
    return best


_LEAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Costs -> {key: strategy}


def _least(costs, node, strategies: list, fits):
    """The strategy of ``node`` (of ``strategies``) that ``fits`` and computes least."""
    cache = _LEAST.setdefault(costs, {})
    key = (node.name, id(strategies), tuple(i for i, st in enumerate(strategies) if fits(st)))
    if key not in cache:
        cache[key] = min((st for st in strategies if fits(st)), key=lambda st: costs.node(node, st).compute,
                         default=strategies[0])
    return cache[key]


def _readers(graph) -> dict:
    """value -> how many inputs of the graph's nodes read it."""
    readers = graph.cache.get("overlap.readers")
    if readers is None:
        readers = graph.cache["overlap.readers"] = {v: len(u) for v, u in graph.users().items()}
    return readers


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
    if producer.kind != "op" or n.kind == "output" or memory.in_region(graph, value, n):
        return None
    meta = graph.meta(value)
    backward = costs.training and meta.floating and producer.requires_grad
    steps, duals, fwd, bwd, prefetched = costs.step_times(value, src, costs.handed_over(value, src, dst, n), backward)
    if prefetched or not any(st.is_collective for st in steps):
        return None
    e = {"consumer": n, "slot": slot, "value": value, "steps": steps, "duals": duals, "fwd": fwd, "bwd": bwd,
         "cover_fwd": 0.0, "cover_bwd": 0.0}
    if n.target is not _LINEAR or slot != 0:
        return e
    c = costs.node(n, strat())
    # an all-gather on a dim other than the features, into a linear: its own block's rows are made
    # while the gather flies, and their input gradient while the dual reduce-scatter does
    if (len(steps) == 1 and steps[0].kind == "all_gather" and steps[0].groups == 1
            and steps[0].dim % len(meta.shape) != len(meta.shape) - 1):
        p = steps[0].size(costs.mesh_shape)
        e["cover_fwd"], e["cover_bwd"] = c.compute_fwd / p, c.compute_bwd / 2 / p
    # the linear's weight gradient, made while the dual of its input's last step flies (AxoNN's
    # backward: passes.schedule._weight_grads_later), where its weight is a parameter
    weight = graph.by_name[n.inputs[1][0]] if len(n.inputs) > 1 else None
    if duals and weight is not None and weight.kind == "param" and weight.requires_grad:
        e["cover_bwd"] += c.compute_bwd / 2
    return e


def chunk_dim(shape, steps, k: int):
    """The dim of a linear's input (``shape``, this rank's) to cut into ``k`` chunks so that its
    output's steps run on each chunk alone: a leading dim the steps do not cut, at least ``k``
    long; None where there is none."""
    cut = {st.dim % len(shape) for st in steps if st.dim is not None}
    for d in range(len(shape) - 1):
        if d not in cut and shape[d] >= k:
            return d
    return None


def _chunkings(costs, e, strat, whole):
    """(k, dim, forward drag, backward drag, chunk compute forward and backward, chunk steps'
    seconds forward and backward) for every k the conversion can run in, its producer running
    ``strat`` at ``whole`` (its Cost); k = 1 first."""
    d_f, d_b = sum(e["fwd"]), sum(e["bwd"])
    yield 1, -1, 0.0, 0.0, 0.0, 0.0, d_f, d_b
    graph, value, steps = costs.graph, e["value"], e["steps"]
    producer = graph.by_name[value[0]]
    if not (producer.target is _LINEAR and _readers(graph).get(value) == 1 and len(steps) == 1
            and steps[0].kind in CHUNKED_KINDS and steps[0].groups == 1):
        return
    mesh, cluster = costs.mesh_shape, costs.cluster
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
        chunk = dataclasses.replace(steps[0], in_shape=cout)
        s_f = comm.step_time(chunk, meta.itemsize, mesh, costs.links)
        s_b = sum(comm.step_time(st, meta.itemsize, mesh, costs.links) for st in comm.dual_steps([chunk], mesh)) \
            if e["duals"] else 0.0
        yield k, dim, drag_f, drag_b, c_f, c_b, k * s_f, k * s_b


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
