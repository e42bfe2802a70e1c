"""Memory one rank holds, by storage placement.

    parameters   each parameter's local share
    gradients    the same shape as the share (fp32 or the parameter's dtype)
    optimizer    Adam keeps two fp32 moments per parameter element of the share
    activations  every op output saved for backward, at its planned local size (an upper bound:
                 the whole forward's outputs are live at the start of backward)
"""
from __future__ import annotations

import math

from autoshard import placement as pl

ADAM_STATE_BYTES = 8  # two fp32 moments per element


def rank_memory(graph, strategies, choice, mesh_shape, training: bool) -> dict:
    """Bytes per rank: parameters, gradients, optimizer state, activations, total."""
    params = grads = optim = acts = 0
    for n in graph.nodes:
        strat = strategies[n.name][choice[n.name]]
        if n.kind == "param" and n.outputs:
            meta = n.outputs[0]
            numel = math.prod(pl.local_shape(meta.shape, strat.outputs[0], mesh_shape))
            params += numel * meta.itemsize
            if training and n.requires_grad:
                grads += numel * meta.itemsize
                optim += numel * ADAM_STATE_BYTES
        elif n.kind == "op" and training and n.requires_grad:
            for meta, p in zip(n.outputs, strat.outputs):
                acts += math.prod(pl.local_shape(meta.shape, p, mesh_shape)) * meta.itemsize
    return {"parameters": params, "gradients": grads, "optimizer": optim, "activations": acts,
            "total": params + grads + optim + acts}
