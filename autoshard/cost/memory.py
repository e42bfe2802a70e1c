"""Memory one rank holds, by storage placement.

    parameters   each parameter's local share
    gradients    the same shape as the share (fp32 or the parameter's dtype)
    optimizer    Adam keeps two fp32 moments per parameter element of the share
    activations  every op output saved for backward, at its planned local size (an upper bound:
                 the whole forward's outputs are live at the start of backward); views of
                 another tensor take no memory of their own. And every input an op takes in
                 another layout than its producer's: the conversion makes a new tensor, which
                 the op keeps for backward (a weight gathered for a matmul stays gathered
                 until the matmul's backward, as the runtime runs it). Not what a user's
                 torch.utils.checkpoint region makes for itself alone: its outputs that only
                 the region reads, and the conversions of activations for its ops, are made
                 again in its backward. One region's worth of them is back while its backward
                 runs (``region_peak``): the largest region's counts on top of what is kept.
"""
from __future__ import annotations

import math
from typing import Optional

from autoshard import placement as pl

ADAM_STATE_BYTES = 8  # two fp32 moments per element
PARTS = ("parameters", "gradients", "optimizer", "activations")


def node_bytes(node, strat, mesh_shape, training: bool) -> dict:
    """Bytes one node's chosen layout keeps on a rank, by part."""
    out = dict.fromkeys(PARTS, 0)
    if node.kind == "param" and node.outputs:
        meta = node.outputs[0]
        numel = math.prod(pl.local_shape(meta.shape, strat.outputs[0], mesh_shape))
        out["parameters"] = numel * meta.itemsize
        if training and node.requires_grad:
            out["gradients"] = numel * meta.itemsize
            out["optimizer"] = numel * ADAM_STATE_BYTES
    elif node.kind == "op" and training and node.requires_grad and not _is_view(node.target) and not node.recomputed:
        out["activations"] = _output_bytes(node, strat, mesh_shape)
    return out


def back_bytes(node, strat, mesh_shape) -> int:
    """Bytes an op of a user checkpoint region makes again in backward, not kept from forward:
    its output, where only the region reads it."""
    if node.kind != "op" or not node.recomputed or not node.requires_grad or _is_view(node.target):
        return 0
    return _output_bytes(node, strat, mesh_shape)


def _output_bytes(node, strat, mesh_shape) -> int:
    return sum(math.prod(pl.local_shape(meta.shape, p, mesh_shape)) * meta.itemsize
               for meta, p in zip(node.outputs, strat.outputs))


def conversion_bytes(consumer, meta, src, dst, mesh_shape, training: bool, regathered: bool = False) -> int:
    """Bytes a rank keeps for the input ``meta`` of op ``consumer`` converted from ``src`` to
    ``dst`` (activations; none when the layouts agree, nothing is kept for backward, or the
    input is a parameter converted again in backward: ``regathered``)."""
    if src == dst or regathered or not training or consumer.kind != "op" or not consumer.requires_grad:
        return 0
    return math.prod(pl.local_shape(meta.shape, dst, mesh_shape)) * meta.itemsize


def in_region(graph, value, consumer) -> bool:
    """Whether ``consumer`` takes ``value`` converted inside a user's checkpoint region: an
    activation's conversion is made again in backward, not kept; a parameter's is made before
    the region and kept (passes.checkpoint)."""
    return consumer.region is not None and graph.by_name[value[0]].kind != "param"


def _is_view(target) -> bool:
    """An op whose result aliases its input (view, transpose, split, ...) allocates nothing."""
    schema = getattr(target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def rank_memory(graph, strategies, choice, mesh_shape, training: bool, reshard: bool = False,
                tied: Optional[tuple] = None) -> dict:
    """Bytes per rank: parameters, gradients, optimizer state, activations, total. ``reshard``:
    a parameter converted for an op is converted again in backward, not kept. ``tied``: ({node:
    how many nodes take its layout}, [(producer, value, consumer, slot, how many such edges)])
    of a plan whose repeated blocks take their twins' layouts (``planner.repeat.tied_plan``),
    priced twin by twin."""
    total = dict.fromkeys(PARTS, 0)
    count, edges = tied if tied is not None else (None, None)
    for n in graph.nodes:
        times = 1 if count is None else count.get(n.name, 0)
        if not times:
            continue
        strat = strategies[n.name][choice[n.name]]
        for k, v in node_bytes(n, strat, mesh_shape, training).items():
            total[k] += times * v
    if edges is None:
        edges = ((None, value, n, slot, 1) for n in graph.nodes for slot, value in enumerate(n.inputs))
    for _, value, n, slot, times in edges:
        src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
        regathered = reshard and graph.by_name[value[0]].kind == "param" or in_region(graph, value, n)
        total["activations"] += times * conversion_bytes(n, graph.meta(value), src,
                                                         strategies[n.name][choice[n.name]].inputs[slot],
                                                         mesh_shape, training, regathered)
    total["activations"] += region_peak(graph, strategies, choice, mesh_shape, training)
    total["total"] = sum(total[k] for k in PARTS)
    return total


def region_peak(graph, strategies, choice, mesh_shape, training: bool) -> int:
    """The most bytes one user checkpoint region makes again while its backward runs: the
    outputs only it reads and the conversions of activations for its ops, which its forward,
    run again, holds until its backward has used them. Regions run their backward one at a
    time: the largest one's."""
    if not training:
        return 0
    back: dict = {}
    for n in graph.nodes:
        if n.region is None or n.kind != "op" or not n.requires_grad:
            continue
        strat = strategies[n.name][choice[n.name]]
        b = back_bytes(n, strat, mesh_shape)
        for slot, value in enumerate(n.inputs):
            if in_region(graph, value, n):
                src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
                b += conversion_bytes(n, graph.meta(value), src, strat.inputs[slot], mesh_shape, training)
        back[n.region] = back.get(n.region, 0) + b
    return max(back.values(), default=0)
