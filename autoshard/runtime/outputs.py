"""A user output handed back as a DTensor in the layout the plan gave it (``outputs="dtensor"``,
``autoshard.outputs``).

A DTensor output's gradient comes back as a DTensor; ``DTensor.from_local``'s ``grad_placements``
turns it into the dual layout the program's backward expects (DESIGN.md section 3): split stays
split, broadcast becomes a partial sum, partial becomes broadcast.
"""
from __future__ import annotations

from autoshard import placement as pl
from autoshard._compat import blocked_shard


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
    from autoshard.runtime.mesh import _mesh
    if not isinstance(x, torch.Tensor):
        return x
    stride, step = [], 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= max(n, 1)
    return DTensor.from_local(x, _mesh().device_mesh, dtensor_placements(placement), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride),
                              grad_placements=_gradient_placements(placement))
