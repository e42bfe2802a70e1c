"""Advanced indexing, and ops that run along one dim: cumulative sums, differences, padding.

Transformer models build their attention masks and position ids from these (a cumulative sum of
the padding mask, ``x[batch_idx, positions]``, labels padded by one for the shifted loss), so
left replicated they would pin the whole batch at every mask, whatever the plan.

An op that runs along a dim (scans it, differences it, pads it) keeps that dim whole and may
split any other. Each is linear in its tensors, except a pad with a non-zero constant.
"""
from __future__ import annotations

import math

import torch

from autoshard.placement import B, P, Split, local_shape
from autoshard.rules.registry import OpCtx, Sig, norm_dim, rule

aten = torch.ops.aten


def _along(ctx: OpCtx, kept: set) -> list:
    """Split any dim outside ``kept`` on every tensor input that has it at full size."""
    x = ctx.in_shapes[0]
    sigs = []
    for d in range(len(x)):
        if d in kept or x[d] <= 1:
            continue
        if all(len(s) == len(x) and s[d] == x[d] for s in ctx.in_shapes):
            sigs.append(Sig((Split(d),) * ctx.n_in, (Split(d),)))
    return sigs


@rule(aten.cumsum.default)
def cumsum(ctx: OpCtx):
    """Any dim, the scanned one too: split there, each rank's running sum plus the earlier
    ranks' totals (``runtime.scans.cumsum``, priced by ``scan_collectives``)."""
    nd = len(ctx.in_shapes[0])
    if not nd:
        return [Sig((P,), (P,))]
    dim = norm_dim(ctx.arg(1, "dim"), nd)
    sigs = _along(ctx, {dim}) + [Sig((P,), (P,))]
    if ctx.in_shapes[0][dim] > 1:
        sigs.append(Sig((Split(dim),), (Split(dim),)))
    return sigs


def scan_axes(in_placement, dim: int, mesh_shape) -> tuple:
    """The mesh axes that split a cumsum's scanned dim."""
    return tuple(a for a, q in enumerate(in_placement)
                 if isinstance(q, Split) and q.dim == dim and mesh_shape[a] > 1)


def scan_collectives(node, strat, mesh_shape) -> list:
    """(kind, axis, bytes, phase) of a cumsum split along its dim: every rank's total (the
    tensor with that dim cut to 1) all-gathered, and the gradient's again in backward."""
    if node.kind != "op" or node.target != aten.cumsum.default:
        return []
    out, args = node.outputs[0], node.fx_node.args
    if not out.shape:
        return []
    dim = norm_dim(args[1] if len(args) > 1 else node.fx_node.kwargs["dim"], len(out.shape))
    axes = scan_axes(strat.inputs[0], dim, mesh_shape)
    if not axes:
        return []
    local = list(local_shape(out.shape, strat.outputs[0], mesh_shape))
    local[dim] = 1
    nbytes = math.prod(local) * out.itemsize
    phases = ("forward", "backward") if node.requires_grad else ("forward",)
    return [("all_gather", a, nbytes, ph) for a in axes for ph in phases]


@rule(aten.diff.default)
def diff(ctx: OpCtx):
    """diff(x, n, dim, prepend, append): prepend and append, when given, are tensor inputs too;
    they match x on every dim but ``dim``, and the difference is linear in all of them at once."""
    nd = len(ctx.in_shapes[0])
    kept = {norm_dim(ctx.arg(2, "dim", -1), nd)}
    return _along(ctx, kept) + [Sig((P,) * ctx.n_in, (P,))]


@rule(aten.pad.default, aten.constant_pad_nd.default)
def pad(ctx: OpCtx):
    """``pad`` lists (before, after) pairs from the last dim backwards; a dim with a non-zero
    pair is kept whole. Reflect, replicate and circular pads copy elements and a zero constant
    adds zeros: linear. A non-zero constant would be added once per rank."""
    nd = len(ctx.in_shapes[0])
    amounts = list(ctx.arg(1, "pad"))
    kept = {nd - 1 - i // 2 for i, a in enumerate(amounts) if a != 0}
    if ctx.target == aten.constant_pad_nd.default:
        mode, value = "constant", ctx.arg(2, "value", 0)
    else:
        mode, value = ctx.arg(2, "mode", "constant"), ctx.arg(3, "value", None)
    sigs = _along(ctx, kept)
    if mode != "constant" or not value:
        sigs.append(Sig((P,), (P,)))
    return sigs


def _broadcast_shape(shapes) -> tuple:
    nb = max(len(s) for s in shapes)
    out = [1] * nb
    for s in shapes:
        for i, n in enumerate(s):
            j = nb - len(s) + i
            out[j] = n if out[j] == 1 else out[j]
    return tuple(out)


def _is_mask(node) -> bool:
    """A bool or uint8 index selects by mask, not by position (its dtype is known when planning)."""
    val = getattr(node, "meta", {}).get("val")
    return isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8)


@rule(aten.index.Tensor)
def index(ctx: OpCtx):
    """``x[i0, i1, ...]`` with integer index tensors (None for a whole dim). The index tensors
    broadcast to one shape; the result holds that shape where the indexed dims were (or first,
    when they are not adjacent), and x's other dims as they were.

    Split one of x's dims that no index touches (indices B); or split a dim of the broadcast
    index shape on every index that has it at full size, x B: each rank gathers its own
    positions from the whole x. Linear in x. A mask index gives a shape that depends on the
    data, so it has no split.

    One whole 1-d index on dim 0 of a split x (a mixture of experts' tokens taken in the order
    of their experts, and put back): each rank takes its chunk of the index's positions, the
    rows fetched from the ranks that hold them by all-to-all (``experts.gather_rows``). On
    several axes the index may be split too, but only by axes before those that split x: the
    rank takes its chunk of the positions it holds, which is its chunk of the output when the
    index's axes are the major ones. Split by a later axis, rank (i, j) of (2, 2) would hold
    positions 2j + i for the output's 2i + j (``Sig.whole_after``; the planner never offers it)."""
    x = ctx.in_shapes[0]
    indices = list(ctx.arg(1, "indices"))
    at = [i for i, t in enumerate(indices) if t is not None]
    if not at or any(_is_mask(indices[i]) for i in at):
        return []
    idx_shapes = ctx.in_shapes[1:]
    bshape = _broadcast_shape(idx_shapes)
    nb = len(bshape)
    rest = [d for d in range(len(x)) if d not in at]
    first = at[0] if at == list(range(at[0], at[-1] + 1)) else 0   # where the index dims land
    before, after = rest[:first], rest[first:]
    out_dim = {d: i for i, d in enumerate(before)}
    out_dim.update({d: first + nb + i for i, d in enumerate(after)})
    expected = [x[d] for d in before] + list(bshape) + [x[d] for d in after]
    if tuple(expected) != tuple(ctx.out_shapes[0]):
        return []   # a mask index this rule could not see as one
    n_idx = len(idx_shapes)
    sigs = [Sig((Split(d),) + (B,) * n_idx, (Split(out_dim[d]),)) for d in rest if x[d] > 1]
    for j in range(nb):
        if bshape[j] <= 1:
            continue
        places = []
        for s in idx_shapes:
            di = j - (nb - len(s))
            places.append(Split(di) if di >= 0 and s[di] == bshape[j] else B)
        sigs.append(Sig((B,) + tuple(places), (Split(first + j),)))
    if at == [0] and len(idx_shapes[0]) == 1 and x[0] > 1 and idx_shapes[0][0] > 1:
        sigs.append(Sig((Split(0), B), (Split(0),), whole_after=(1,)))
    sigs.append(Sig((P,) + (B,) * n_idx, (P,)))
    return sigs
