"""Views and shape ops through a small dimension map.

A reshape groups input dims and output dims into runs of equal product; a split of the first
(major) dim of an input run is the same contiguous cut as a split of the first dim of its output
run, as long as both divide evenly (the expansion checks that). Permutes move splits with their
dims. Ops that cut along a dim (split, cat, slice, select) keep that dim whole; ops that copy
along a dim (repeat, repeat_interleave) keep it whole too, unless each element stays in its chunk.
"""
from __future__ import annotations

import torch

from autoshard.placement import B, P, Split
from autoshard.rules.registry import OpCtx, Sig, norm_dim, register

aten = torch.ops.aten


def view_groups(a, b):
    """Runs of dims of shape ``a`` and shape ``b`` with equal products: [(a dims, b dims)]."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            return None
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i += 1
        j += 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    return None
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                if j >= len(b):
                    return None
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((gi, gj))
    return groups


def dim_map_sigs(pairs, n_in=1, n_out=1, linear=True):
    sigs = [Sig((Split(i),) + (B,) * (n_in - 1), (Split(o),) * n_out) for i, o in pairs]
    if linear:
        sigs.append(Sig((P,) + (B,) * (n_in - 1), (P,) * n_out))
    return sigs


def reshape(ctx: OpCtx):
    a, b = ctx.in_shapes[0], ctx.out_shapes[0]
    groups = view_groups(a, b)
    if groups is None:
        return []
    pairs = [(gi[0], gj[0]) for gi, gj in groups if gi and gj and a[gi[0]] > 1 and b[gj[0]] > 1]
    return dim_map_sigs(pairs, n_in=ctx.n_in)


def expand(ctx: OpCtx):
    a, b = ctx.in_shapes[0], ctx.out_shapes[0]
    off = len(b) - len(a)
    return dim_map_sigs([(i, i + off) for i in range(len(a)) if a[i] == b[i + off] > 1], n_in=ctx.n_in)


def permute(ctx: OpCtx):
    """permute(x, dims); numpy_T(x), ``x.T``, every dim reversed (Falcon's ``self.weight.T``)."""
    nd = len(ctx.in_shapes[0])
    if ctx.target == aten.numpy_T.default:
        dims = list(reversed(range(nd)))
    else:
        dims = [norm_dim(d, nd) for d in ctx.arg(1, "dims")]
    return dim_map_sigs([(d, k) for k, d in enumerate(dims)])


def transpose(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    if nd < 2 and ctx.target in (aten.t.default,):
        return dim_map_sigs([(0, 0)]) if nd == 1 else dim_map_sigs([])
    if ctx.target == aten.t.default:
        d0, d1 = 0, 1
    else:
        d0, d1 = norm_dim(ctx.arg(1, "dim0"), nd), norm_dim(ctx.arg(2, "dim1"), nd)
    swap = {d0: d1, d1: d0}
    return dim_map_sigs([(d, swap.get(d, d)) for d in range(nd)])


def split_like(ctx: OpCtx):
    """split, chunk, unbind: every output keeps the other dims' splits."""
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(2 if ctx.target not in UNBIND else 1, "dim", 0), nd)
    pairs = []
    for d in range(nd):
        if d == dim:
            continue
        pairs.append((d, d - 1 if ctx.target in UNBIND and d > dim else d))
    return dim_map_sigs(pairs, n_out=ctx.n_out)


def cat(ctx: OpCtx):
    nd = len(ctx.out_shapes[0])
    dim = norm_dim(ctx.arg(1, "dim", 0), nd)
    sigs = []
    for d in range(nd):
        if d != dim and all(len(s) == nd for s in ctx.in_shapes):
            sigs.append(Sig((Split(d),) * ctx.n_in, (Split(d),)))
    sigs.append(Sig((P,) * ctx.n_in, (P,)))
    return sigs


def stack(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(1, "dim", 0), nd + 1)
    sigs = [Sig((Split(d),) * ctx.n_in, (Split(d if d < dim else d + 1),)) for d in range(nd)]
    sigs.append(Sig((P,) * ctx.n_in, (P,)))
    return sigs


def slice_(ctx: OpCtx):
    shape = ctx.in_shapes[0]
    nd = len(shape)
    dim = norm_dim(ctx.arg(1, "dim", 0), nd)
    start, end, step = ctx.arg(2, "start", None), ctx.arg(3, "end", None), ctx.arg(4, "step", 1)
    whole = (start in (None, 0)) and (end is None or end >= shape[dim]) and step == 1
    return dim_map_sigs([(d, d) for d in range(nd) if d != dim or whole])


def select(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(1, "dim"), nd)
    return dim_map_sigs([(d, d - (d > dim)) for d in range(nd) if d != dim])


def slice_scatter(ctx: OpCtx):
    """input, src (input's shape cut along ``dim``) -> input with src written in: split on any
    other dim, both alike; a sum of partial inputs and partial sources is the sum written in."""
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(2, "dim", 0), nd)
    return [Sig((Split(d), Split(d)), (Split(d),)) for d in range(nd) if d != dim] + [Sig((P, P), (P,))]


def select_scatter(ctx: OpCtx):
    """input, src (input without ``dim``) -> input with src written in at ``index`` along ``dim``."""
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(2, "dim"), nd)
    return ([Sig((Split(d), Split(d - (d > dim))), (Split(d),)) for d in range(nd) if d != dim]
            + [Sig((P, P), (P,))])


def view_as_complex(ctx: OpCtx):
    """(..., 2) real -> (...) complex: the pair of a complex number's parts is never split."""
    return dim_map_sigs([(d, d) for d in range(len(ctx.in_shapes[0]) - 1)])


def view_as_real(ctx: OpCtx):
    """(...) complex -> (..., 2) real: every dim keeps its split, the new pair dim is whole."""
    return dim_map_sigs([(d, d) for d in range(len(ctx.in_shapes[0]))])


def repeat(ctx: OpCtx):
    """repeat(x, repeats): the output lays whole copies of x side by side on each dim, new dims in
    front; a split dim's copies are not its chunks, so only the dims repeated once keep a split."""
    x = ctx.in_shapes[0]
    repeats = list(ctx.arg(1, "repeats"))
    off = len(repeats) - len(x)
    return dim_map_sigs([(d, d + off) for d in range(len(x)) if repeats[d + off] == 1 and x[d] > 1])


def repeat_interleave(ctx: OpCtx):
    """repeat_interleave(x, repeats, dim): each element repeated in place along ``dim`` (along x
    flattened where dim is None). The other dims keep their splits. One count for every element
    (an int, or a tensor of one) keeps each element's copies beside it, so chunk r of x gives
    chunk r of the output along ``dim`` too (the flat output's chunks follow x's dim 0), unless
    an ``output_size`` names the whole output's size. Per-element counts keep ``dim`` whole."""
    x = ctx.in_shapes[0]
    nd = len(x)
    dim = ctx.arg(2, "dim", None)
    one_count = ctx.n_in == 1 or all(n == 1 for n in ctx.in_shapes[1])
    along = one_count and ctx.kwargs.get("output_size") is None
    if dim is None:
        pairs = [(0, 0)] if along and nd and x[0] > 1 else []
    else:
        dim = norm_dim(dim, nd)
        pairs = [(d, d) for d in range(nd) if x[d] > 1 and (d != dim or along)]
    return dim_map_sigs(pairs, n_in=ctx.n_in)


def assert_metadata(ctx: OpCtx):
    """A check of dtype or device, which hold for any share; a check of the size or strides holds
    only for the whole tensor."""
    if ctx.arg(1, "size") is not None or ctx.arg(2, "stride") is not None:
        return []
    return [Sig((Split(d),), ()) for d in range(len(ctx.in_shapes[0]))] + [Sig((P,), ())]


UNBIND = {aten.unbind.int}
RESHAPES = [aten.view.default, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
            aten.squeeze, aten.unsqueeze, aten.view_as]
register(RESHAPES, reshape)
register([aten.expand, aten.expand_as], expand)
register([aten.permute, aten.numpy_T.default], permute)
register([aten.transpose, aten.t], transpose)
register([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
          aten.tensor_split.sections, aten.tensor_split.indices], split_like)
register([aten.cat], cat)
register([aten.stack], stack)
register([aten.slice.Tensor], slice_)
register([aten.select.int], select)
register([aten.slice_scatter.default], slice_scatter)
register([aten.select_scatter.default], select_scatter)
register([aten.view_as_complex], view_as_complex)
register([aten.view_as_real], view_as_real)
register([aten._assert_tensor_metadata], assert_metadata)
register([aten.repeat], repeat)
register([aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor], repeat_interleave)
