"""Which signatures may hold a split that does not divide by its axes.

An uneven split lies as DTensor's ``Shard`` lays it (``torch.chunk``): 17 rows over 4 ranks are
5, 5, 5, 2, every chunk the largest but the last; over (2, 2) the dim is cut by axis 0 and each
part again by axis 1 (9 -> 5, 4 and 8 -> 4, 4). Following DTensor's layout, not "the first ranks
hold one more row" (5, 4, 4, 4 over 4), keeps a tensor the program hands back
(``outputs="dtensor"``), a DTensor made with ``from_local`` and a checkpoint in one layout.

A rule's signature is checked for even splits, where chunk r of every tensor lines up with
chunk r of every other. Uneven, that holds only where the tensors cut on one axis cut a dim of the
same size over the same axes (``aligned``): a view that merges the uneven dim with another (17
tokens into 17 x 4 rows), or attention whose query heads outnumber its key heads, would pair
chunks of different bounds, and those signatures are refused. So are ops whose local form
uses a chunk's offset (an index into a split dim, a grouped matmul's rows, a convolution's
groups): only the op families below, whose local form is the op on the chunk (or, for a cumsum
or a stable argsort along the split dim, works from the sizes the ranks hold: ``runtime.scans``),
take uneven splits.
A mean over an uneven split is scaled by each rank's own share (``passes.rewrite._mean_scale``).
"""
from __future__ import annotations

from autoshard import placement as pl
from autoshard.rules import factor, indexing, moe, nn, pointwise, views
from autoshard.rules.registry import rule_for

UNEVEN_RULES = {
    pointwise.nonlinear, pointwise.linear_unary, pointwise.additive, pointwise.multiplicative,
    pointwise.numerator, pointwise.copy_values, pointwise.broadcast_tensors,
    factor.mm, factor.bmm, factor.matmul, factor.linear, factor.addmm, factor.baddbmm, factor.einsum,
    nn.layer_norm, nn.softmax, nn.sdpa, nn.reduction, nn.cross_entropy, nn.pointwise_loss, nn.dropout,
    views.reshape, views.expand, views.permute, views.transpose, views.split_like, views.cat, views.stack,
    views.slice_, views.select, views.view_as_complex, views.view_as_real, views.assert_metadata,
    # split along their dim too: each rank's sizes from what it holds (runtime.scans)
    indexing.cumsum, moe.sort,
}


def allows_uneven(target) -> bool:
    """Whether the op's rule is one whose local form is the op on each rank's chunk."""
    return rule_for(target) in UNEVEN_RULES


_CUTS: dict = {}   # (shape, placement, mesh) -> ``_cuts``: annotate asks by the hundred thousand


def _cuts(shape, placement, mesh_shape) -> tuple:
    """Per mesh axis, None where it does not split the tensor, else ((the size of the dim it
    cuts, every axis that cuts that dim), whether they cut it unevenly)."""
    key = (shape, placement, mesh_shape)
    hit = _CUTS.get(key)
    if hit is None:
        out = []
        uneven = pl.uneven_dims(shape, placement, mesh_shape)
        for q in placement:
            if not isinstance(q, pl.Split):
                out.append(None)
                continue
            axes = tuple(b for b, r in enumerate(placement) if isinstance(r, pl.Split) and r.dim == q.dim)
            out.append(((shape[q.dim], axes), q.dim in uneven))
        if len(_CUTS) > 1 << 16:
            _CUTS.clear()
        hit = _CUTS[key] = tuple(out)
    return hit


def aligned(shapes, placements, mesh_shape) -> bool:
    """Whether, on every axis that cuts some tensor unevenly, every tensor it cuts has a dim of
    the same size cut by the same axes: then their chunks have the same bounds on every rank."""
    mesh_shape = tuple(mesh_shape)
    cuts = [_cuts(tuple(shape), placement, mesh_shape) for shape, placement in zip(shapes, placements)]
    for a in range(len(mesh_shape)):
        cut = {c[a][0] for c in cuts if c[a] is not None}
        if len(cut) > 1 and any(c[a][1] for c in cuts if c[a] is not None):
            return False
    return True
