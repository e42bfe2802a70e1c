"""Neural-network ops: normalization, softmax, attention, embedding, reductions, losses, dropout."""
from __future__ import annotations

import torch

from autoshard.placement import B, P, Split
from autoshard.rules.registry import OpCtx, Sig, norm_dim, rule

aten = torch.ops.aten

# cross_entropy / mse reduction codes (torch.nn._reduction)
NONE, MEAN, SUM = 0, 1, 2


def _batch_dims_sigs(ctx: OpCtx, ndims_kept: int):
    """Split any of the leading dims of input 0; other tensor inputs (weights) stay B."""
    return [Sig((Split(d),) + (B,) * (ctx.n_in - 1), (Split(d),) * ctx.n_out) for d in range(ndims_kept)]


@rule(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    normalized = ctx.arg(1, "normalized_shape")
    return _batch_dims_sigs(ctx, nd - len(normalized))


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    dim = norm_dim(ctx.arg(1, "dim"), nd)
    return [Sig((Split(d),), (Split(d),)) for d in range(nd) if d != dim]


@rule(aten.tril.default, aten.triu.default)
def triangle(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    return _batch_dims_sigs(ctx, nd - 2) + [Sig((P,), (P,))]


def mask_placement(mask_shape, out_shape, d):
    """The placement of attention's mask (lined up with its output from the right) where output
    dim ``d`` is split: split with it where the mask has that dim whole, else B (broadcast). The
    mask's last dim (the keys) is never split: a sequence split splits its rows."""
    off = len(out_shape) - len(mask_shape)
    di = d - off
    return Split(di) if di >= 0 and mask_shape[di] == out_shape[d] > 1 else B


@rule(aten.scaled_dot_product_attention.default)
def sdpa(ctx: OpCtx):
    """q (..., Lq, E), k (..., Lk, E), v (..., Lk, Ev), optional additive/boolean mask. The batch
    dims broadcast, lined up from the right as for the mask."""
    q, k, v = ctx.in_shapes[:3]
    out = ctx.out_shapes[0]
    nd = len(out)
    has_mask = ctx.n_in == 4
    # dropout: each rank draws the whole op's mask from the generator all ranks share and keeps
    # its part (runtime.attention_dropout), as one device draws it; not in the ring form
    dropped = bool(ctx.arg(4, "dropout_p", 0.0))

    def at(shape, d):  # the dim of ``shape`` lined up with output dim d, if it is not size 1
        di = d - (nd - len(shape))
        return Split(di) if di >= 0 and shape[di] > 1 else B

    sigs = []
    for d in range(nd - 2):  # batch and head dims (q may have more heads than k and v: GQA)
        if at(q, d) == B or at(k, d) == B:
            continue
        ins = [at(q, d), at(k, d), at(v, d)]
        if has_mask:
            ins.append(mask_placement(ctx.in_shapes[3], out, d))
        sigs.append(Sig(tuple(ins), (Split(d),)))
    # query positions: each rank attends its own queries to every key, gathered whole; causal
    # attention offsets its mask by the rank's first query (passes.rewrite.lower_sdpa)
    ins = [Split(len(q) - 2), B, B]
    if has_mask:
        ins.append(mask_placement(ctx.in_shapes[3], out, nd - 2))
    sigs.append(Sig(tuple(ins), (Split(nd - 2),)))
    # ring attention: keys and values split along the sequence too, passed round the ranks and
    # merged by log-sum-exp (runtime.ring_attention); four-dim tensors. A mask's rows split with
    # the queries, its columns whole: each block's cut on the rank, nothing of it sent
    if len(q) == len(k) == len(v) == nd == 4 and not dropped:
        ins = [Split(2), Split(2), Split(2)]
        if has_mask:
            ins.append(mask_placement(ctx.in_shapes[3], out, 2))
        sigs.append(Sig(tuple(ins), (Split(2),)))
    return sigs


@rule(aten.embedding.default)
def embedding(ctx: OpCtx):
    """weight (V, D), indices (...) -> (..., D). Linear in the weight."""
    idx = ctx.in_shapes[1]
    sigs = [Sig((B, Split(d)), (Split(d),)) for d in range(len(idx))]
    sigs.append(Sig((Split(1), B), (Split(len(idx)),)))
    sigs.append(Sig((P, B), (P,)))
    return sigs


def _reduced_dims(ctx: OpCtx):
    nd = len(ctx.in_shapes[0])
    dims = ctx.arg(1, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(nd)), False
    if isinstance(dims, int):
        dims = [dims]
    return sorted(norm_dim(d, nd) for d in dims), bool(ctx.arg(2, "keepdim", False))


@rule(aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim)
def reduction(ctx: OpCtx):
    """A split reduced dim leaves a partial sum; for mean the rewriter scales each rank's mean by
    its share of the elements. A kept dim keeps its split."""
    nd = len(ctx.in_shapes[0])
    reduced, keepdim = _reduced_dims(ctx)
    sigs = []
    for d in range(nd):
        if d in reduced:
            sigs.append(Sig((Split(d),), (P,)))
        else:
            sigs.append(Sig((Split(d),), (Split(d if keepdim else d - sum(r < d for r in reduced)),)))
    sigs.append(Sig((P,), (P,)))
    return sigs


@rule(aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default,
      aten.argmin.default)
def extremum(ctx: OpCtx):
    """A max or min (and its index) over some dims: a kept dim keeps its split; a reduced dim
    cannot be split, for a max of parts is no partial sum (and an index into a part is not one
    into the whole)."""
    nd = len(ctx.in_shapes[0])
    reduced, keepdim = _reduced_dims(ctx)
    sigs = []
    for d in range(nd):
        if d not in reduced:
            out = Split(d if keepdim else d - sum(r < d for r in reduced))
            sigs.append(Sig((Split(d),), (out,) * ctx.n_out))
    return sigs


@rule(aten.cross_entropy_loss.default)
def cross_entropy(ctx: OpCtx):
    """input (N, C, ...), target (N, ...): split the batch. A mean over a split batch divides each
    rank's sum by the global count of counted targets (the rewriter adds that all-reduce)."""
    x = ctx.in_shapes[0]
    if len(x) < 2:
        return []
    reduction = ctx.arg(3, "reduction", MEAN)
    ins = (Split(0), Split(0)) + (B,) * (ctx.n_in - 2)
    return [Sig(ins, (Split(0) if reduction == NONE else P,))]


@rule(aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default)
def pointwise_loss(ctx: OpCtx):
    reduction = ctx.arg(2, "reduction", MEAN)
    out = ctx.in_shapes[0]
    sigs = []
    for d in range(len(out)):
        if out[d] > 1 and all(len(s) == len(out) and s[d] == out[d] for s in ctx.in_shapes):
            sigs.append(Sig((Split(d),) * ctx.n_in, (Split(d) if reduction == NONE else P,)))
    return sigs


@rule(aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default)
def dropout(ctx: OpCtx):
    """Random: the rewriter draws the whole mask from a generator shared by all ranks and keeps
    each rank's part, so replicas agree and the result equals the single-device draw."""
    if ctx.target != aten.dropout.default:
        return []
    return [Sig((Split(d),), (Split(d),)) for d in range(len(ctx.in_shapes[0])) if ctx.in_shapes[0][d] > 1]


# ops that keep every element of their input: a count over their output counts their input
KEEP_ELEMENTS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                 aten.contiguous.default, aten.clone.default)


def whole_targets(graph, node):
    """The user input that a mean cross-entropy's class targets are, through ops that keep every
    element, or None. Every rank is fed the inputs whole, so it can count the counted targets of
    the whole batch itself instead of all-reducing its shard's count (a forward all-reduce fewer:
    a point where every rank waits for the slowest)."""
    if node.target != aten.cross_entropy_loss.default or len(node.inputs) < 2:
        return None
    fx_node = node.fx_node
    weight = fx_node.args[2] if len(fx_node.args) > 2 else fx_node.kwargs.get("weight")
    if weight is not None or graph.meta(node.inputs[1]).floating:   # class weights, or probabilities
        return None
    value = node.inputs[1]
    while True:
        producer = graph.by_name[value[0]]
        if producer.kind == "input":
            return producer.name
        if producer.kind != "op" or producer.target not in KEEP_ELEMENTS or not producer.inputs:
            return None
        value = producer.inputs[0]


def count_axes(target, args, kwargs, in_placements) -> list:
    """Axes over which a mean cross-entropy must all-reduce its count of counted targets: those
    that split the batch. Empty for every other op."""
    if target != aten.cross_entropy_loss.default:
        return []
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", MEAN)
    if reduction != MEAN:
        return []
    return [a for a, p in enumerate(in_placements[1]) if isinstance(p, Split)]
