"""What a parallel module hands back: every output whole on every rank (``outputs="whole"``, the
default), or each user output as a DTensor in the layout the plan gave it (``outputs="dtensor"``).

Whole outputs cost a conversion to broadcast on every axis, which the plan prices: the logits of a
large vocabulary gathered onto every rank can take more of the step than the model's layers. A
user who computes the loss outside the model keeps them split instead (``loss_parallel`` takes
logits split over the vocabulary), and the plan prices no conversion for them.

A DTensor output's gradient comes back as a DTensor; ``DTensor.from_local``'s ``grad_placements``
turns it into the dual layout the program's backward expects (DESIGN.md section 3): split stays
split, broadcast becomes a partial sum, partial becomes broadcast.
"""
from __future__ import annotations

from autoshard import placement as pl
from autoshard._compat import blocked_shard

WHOLE, DTENSOR = "whole", "dtensor"
MODES = (WHOLE, DTENSOR)


def check_outputs(outputs) -> str:
    if not isinstance(outputs, str) or outputs not in MODES:
        raise ValueError(f"outputs is {WHOLE!r} (every output whole on every rank, the default) or {DTENSOR!r} "
                         f"(each output a DTensor in its planned layout, e.g. logits split over the vocabulary "
                         f"for loss_parallel), got {outputs!r}")
    return outputs


def kept_split(graph, outputs: str) -> frozenset:
    """The values of ``graph`` handed back in their planned layouts: with ``outputs="dtensor"``,
    every user output that is not also a buffer's new value (buffers are always written whole)."""
    if outputs != DTENSOR:
        return frozenset()
    from torch.export.graph_signature import OutputKind
    specs = graph.exported.graph_signature.output_specs
    returned = graph.output.fx_node.args[0]   # one per spec, in order
    user = {a for s, a in zip(specs, returned) if s.kind == OutputKind.USER_OUTPUT}
    written = {a for s, a in zip(specs, returned) if s.kind != OutputKind.USER_OUTPUT}
    values = set()
    for fx_node in user - written:
        value = graph.value_of.get(fx_node)
        if isinstance(value, tuple):
            values.add(value)
    return frozenset(values)


def dtensor_placements(placement) -> tuple:
    """torch DTensor placements of an nd placement (strings or parsed)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    out = []
    for q in map(pl.parse, placement):
        if isinstance(q, pl.Split):
            out.append(Shard(q.dim) if q.groups == 1 else blocked_shard(q.dim, q.groups))
        else:
            out.append(Partial() if isinstance(q, pl.Partial) else Replicate())
    return tuple(out)


def _gradient_placements(placement) -> tuple:
    """The dual of each axis's placement, where the program's backward takes the gradient."""
    dual = {pl.Broadcast: pl.P, pl.Partial: pl.B}
    return dtensor_placements(tuple(dual.get(type(q), q) for q in map(pl.parse, placement)))


def to_dtensor(x, placement: tuple, shape: tuple):
    """The emitted program's call for a user output kept in its planned layout: this rank's share
    ``x`` as a DTensor of the global ``shape`` on the module's DeviceMesh."""
    import torch
    from torch.distributed.tensor import DTensor
    from autoshard.runtime import _mesh
    if not isinstance(x, torch.Tensor):
        return x
    stride, step = [], 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= max(n, 1)
    return DTensor.from_local(x, _mesh().device_mesh, dtensor_placements(placement), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride),
                              grad_placements=_gradient_placements(placement))
