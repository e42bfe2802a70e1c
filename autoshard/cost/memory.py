"""Memory one rank holds, by storage placement.

    parameters   each parameter's local share
    gradients    the same shape as the share (fp32 or the parameter's dtype)
    optimizer    Adam keeps two fp32 moments per parameter element of the share
    activations  every op output saved for backward, at its planned local size (an upper bound:
                 the whole forward's outputs are live at the start of backward); views of
                 another tensor take no memory of their own
"""
from __future__ import annotations

import math

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
    elif node.kind == "op" and training and node.requires_grad and not _is_view(node.target):
        out["activations"] = sum(math.prod(pl.local_shape(meta.shape, p, mesh_shape)) * meta.itemsize
                                 for meta, p in zip(node.outputs, strat.outputs))
    return out


def _is_view(target) -> bool:
    """An op whose result aliases its input (view, transpose, split, ...) allocates nothing."""
    schema = getattr(target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def rank_memory(graph, strategies, choice, mesh_shape, training: bool) -> dict:
    """Bytes per rank: parameters, gradients, optimizer state, activations, total."""
    total = dict.fromkeys(PARTS, 0)
    for n in graph.nodes:
        for k, v in node_bytes(n, strategies[n.name][choice[n.name]], mesh_shape, training).items():
            total[k] += v
    total["total"] = sum(total[k] for k in PARTS)
    return total
