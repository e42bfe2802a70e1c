"""Mixture-of-experts: the router's ops (top-k, sort, histogram, scatter, gather, index_put) and
the grouped expert matmul.

A router picks each token's experts row by row, so its ops split any dim but the one they run
along. The dispatch then sorts the (token, expert) pairs of the whole batch by expert, counts
the rows of each expert (``histc``) and multiplies each expert's rows by its own weight: the
grouped matmul ``y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]`` (``torch._grouped_mm``,
transformers' ``grouped_mm_fallback``), with x (rows, k), w (experts, k, n) and offs the running
count of rows per expert. Its signatures on one axis:

    (B, S(2), B) -> S(1)     each rank its share of every expert's columns (tensor parallel)
    (S(1), S(1), B) -> P     each rank its share of every expert's inner dim (tensor parallel)
    (B, S(0), B) -> P        each rank its experts, computed on their rows; others' rows zero
    (S(0), B, B) -> S(0)     each rank its rows, whatever their experts
    (S(0), S(0), B) -> S(0)  expert parallel: each rank sends the rows it holds to the ranks
                             of their experts and gets their products back (all-to-all with
                             per-rank split sizes, both ways; ``autoshard.experts``)
    (P, B, B) -> P, (B, P, B) -> P   linear in each of x and w

offs is always whole: every rank knows where each expert's rows are, so the sizes each rank
sends and receives need no exchange. The last three run through ``autoshard.experts.grouped_mm``
(their local form is not the op on local tensors).
"""
from __future__ import annotations

import torch

from autoshard.placement import B, P, Split
from autoshard.rules.pointwise import numerator
from autoshard.rules.registry import OpCtx, Sig, norm_dim, register, register_by_name, rule

aten = torch.ops.aten

# transformers' grouped matmul (transformers.integrations.moe), a custom op that exists only once
# transformers is imported: found by its name
TRANSFORMERS_GROUPED_MM = "transformers::grouped_mm_fallback"


def _along(ctx: OpCtx, dim: int) -> list:
    """Split any dim but ``dim`` on every input and output that has it at the same size."""
    x = ctx.in_shapes[0]
    sigs = []
    for d in range(len(x)):
        if d == dim or x[d] <= 1:
            continue
        shapes = list(ctx.in_shapes) + list(ctx.out_shapes)
        if all(len(s) == len(x) and s[d] == x[d] for s in shapes):
            sigs.append(Sig((Split(d),) * ctx.n_in, (Split(d),) * ctx.n_out))
    return sigs


@rule(aten.topk.default)
def topk(ctx: OpCtx):
    return _along(ctx, norm_dim(ctx.arg(2, "dim", -1), len(ctx.in_shapes[0])))


@rule(aten.sort.default, aten.argsort.default)
def sort(ctx: OpCtx):
    return _along(ctx, norm_dim(ctx.arg(1, "dim", -1), len(ctx.in_shapes[0])))


@rule(aten.sort.stable, aten.argsort.stable)
def sort_stable(ctx: OpCtx):
    return _along(ctx, norm_dim(ctx.kwargs.get("dim", -1), len(ctx.in_shapes[0])))


@rule(aten.histc.default)
def histc(ctx: OpCtx):
    """Counts add up: the histogram of a split tensor is the sum of its shares' (a partial sum,
    so only where the counts are floating)."""
    return [Sig((Split(d),), (P,)) for d, n in enumerate(ctx.in_shapes[0]) if n > 1]


@rule(aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
      aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_reduce.two)
def scatter_gather(ctx: OpCtx):
    """gather(x, dim, index) and scatter(x, dim, index, src): any dim but ``dim`` where every
    tensor has x's size. scatter_add is linear in x and src together; gather in x."""
    dim = norm_dim(ctx.arg(1, "dim"), len(ctx.in_shapes[0]))
    sigs = _along(ctx, dim)
    if ctx.target == aten.gather.default:
        sigs.append(Sig((P, B), (P,)))
    elif ctx.target == aten.scatter_add.default:
        sigs.append(Sig((P, B, P), (P,)))
    return sigs


@rule(aten.index_put.default, aten.index_put_.default)
def index_put(ctx: OpCtx):
    """x[i0, i1, ...] = values: split a dim of x that no index touches, the indices whole and
    values split on the dim that lines up with it (values are broadcast to x[indices]'s shape:
    the indexed dims' broadcast shape where they were, x's other dims as they were). With
    ``accumulate`` linear in x and values together."""
    x = ctx.in_shapes[0]
    indices = list(ctx.arg(1, "indices"))
    at = [i for i, t in enumerate(indices) if t is not None]
    idx_shapes = ctx.in_shapes[1:1 + len(at)]
    values = ctx.in_shapes[-1]
    if not at or len(idx_shapes) != len(at):
        return []
    nb = max(len(s) for s in idx_shapes)
    rest = [d for d in range(len(x)) if d not in at]
    first = at[0] if at == list(range(at[0], at[-1] + 1)) else 0
    before, after = rest[:first], rest[first:]
    at_out = {d: i for i, d in enumerate(before)}
    at_out.update({d: first + nb + i for i, d in enumerate(after)})
    n_out = len(before) + nb + len(after)
    sigs = []
    for d in rest:
        if x[d] <= 1:
            continue
        vd = at_out[d] - (n_out - len(values))    # values broadcast from the right
        vp = Split(vd) if vd >= 0 and values[vd] == x[d] else B
        if vp == B and vd >= 0 and values[vd] != 1:
            continue
        sigs.append(Sig((Split(d),) + (B,) * len(at) + (vp,), (Split(d),)))
    if ctx.arg(3, "accumulate", False):
        sigs.append(Sig((P,) + (B,) * len(at) + (P,), (P,)))
    return sigs


# the router's top-k weights normalized in place (``w /= w.sum(-1, keepdim=True)``): as div
register([aten.div_.Tensor], numerator)


def grouped_mm_sigs(ctx: OpCtx) -> list:
    """x (rows, k) by w (experts, k, n) at offsets offs (experts,): the signatures of the module
    docstring. Other forms (3-d by 3-d, a bias) run replicated."""
    if ctx.n_in != 3 or len(ctx.in_shapes[0]) != 2 or len(ctx.in_shapes[1]) != 3:
        return []
    (m, k), (g, _, n) = ctx.in_shapes[0], ctx.in_shapes[1]
    sigs = []
    if n > 1:
        sigs.append(Sig((B, Split(2), B), (Split(1),)))
    if k > 1:
        sigs.append(Sig((Split(1), Split(1), B), (P,)))
    if g > 1:
        sigs.append(Sig((B, Split(0), B), (P,)))
    if m > 1:
        sigs.append(Sig((Split(0), B, B), (Split(0),)))
    if m > 1 and g > 1:
        sigs.append(Sig((Split(0), Split(0), B), (Split(0),)))
    sigs += [Sig((P, B, B), (P,)), Sig((B, P, B), (P,))]
    return sigs


@rule(aten._grouped_mm.default)
def grouped_mm(ctx: OpCtx):
    if ctx.arg(3, "bias") is not None:
        return []
    return grouped_mm_sigs(ctx)


register_by_name([TRANSFORMERS_GROUPED_MM], grouped_mm_sigs)
