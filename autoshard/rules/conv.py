"""Convolutional-network ops: convolution, batch and group norm, pooling, upsampling.

Every one of them is local in the batch dim and, but for batch norm's statistics, in the channel
dim; none is offered a spatial split, which would need halo exchanges (batch norm excepted: its
statistics run over the spatial dims as over the batch, and are made global the same way).

    convolution     batch        (S(0), B, B) -> S(0)
                    out channels (B, S(0), S(0)) -> S(1)        groups == 1
                    in channels  (S(1), S(1), P) -> P           groups == 1: a contraction; the
                                                                bias must be P, or it counts p times
                    whole groups (S(1), S(0), S(0)) -> S(1)     groups > 1; the local op has
                                                                groups / q of them (rewrite)
                    linear       (P, B, P) -> P, (B, P, P) -> P
    batch norm      any dim but the channels, in training: statistics of the global batch (the
                    rewriter's ``runtime.batch_norm_train``); channels: exact locally, the
                    running statistics kept whole and each rank's update of them gathered
    pooling, upsampling   batch and channels; P through the linear ones (average, upsample)

A transposed convolution's weight is (in, out / groups, k...): the channel roles of its dims swap.
"""
from __future__ import annotations

import math
import re

import torch

from autoshard.placement import B, P, Split
from autoshard.rules.registry import OpCtx, Sig, register, rule

aten = torch.ops.aten

# convolution overload -> (index of its groups argument, index of its transposed flag or a constant)
CONV_ARGS = {
    aten.conv1d.default: (6, False), aten.conv2d.default: (6, False), aten.conv3d.default: (6, False),
    aten.conv1d.padding: (6, False), aten.conv2d.padding: (6, False), aten.conv3d.padding: (6, False),
    aten.conv_transpose1d.default: (6, True), aten.conv_transpose2d.input: (6, True),
    aten.conv_transpose3d.input: (6, True),
    aten.convolution.default: (8, 6), aten._convolution.default: (8, 6),
}


def _arg(args, kwargs, index, name, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


def conv_groups(target, args, kwargs) -> tuple:
    """(groups, transposed) of a convolution call."""
    gi, ti = CONV_ARGS[target]
    transposed = ti if isinstance(ti, bool) else bool(_arg(args, kwargs, ti, "transposed", False))
    return int(_arg(args, kwargs, gi, "groups", 1)), transposed


@rule(*CONV_ARGS)
def convolution(ctx: OpCtx):
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    groups, transposed = conv_groups(ctx.target, ctx.args, ctx.kwargs)
    batched = len(x) == len(w)               # an unbatched input is (C, *spatial)
    c = 1 if batched else 0
    w_out, w_in = (1, 0) if transposed else (0, 1)
    c_in, c_out = x[c], ctx.out_shapes[0][c]

    def sig(xp, wp, bp, out):
        return Sig((xp, wp) + ((bp,) if ctx.n_in == 3 else ()), (out,))

    sigs = []
    if batched and x[0] > 1:
        sigs.append(sig(Split(0), B, B, Split(0)))
    if groups == 1:
        if c_out > 1:
            sigs.append(sig(B, Split(w_out), Split(0), Split(c)))
        if c_in > 1:
            sigs.append(sig(Split(c), Split(w_in), P, P))
    elif math.gcd(c_in // groups, c_out // groups) == 1:
        # q ranks each hold whole groups only if q divides groups. The expansion checks that q
        # divides both channel counts, g*a and g*b, so q divides g*gcd(a, b): safe when gcd is 1
        # (depthwise convolutions among them).
        sigs.append(sig(Split(c), Split(0), Split(0), Split(c)))
    sigs.append(sig(P, B, P, P))
    sigs.append(sig(B, P, P, P))
    return sigs


# ---- normalization ---------------------------------------------------------------------------------

def _bn_present(args, kwargs) -> list:
    """Which of weight, bias, running_mean, running_var a batch_norm call passes."""
    names = ("weight", "bias", "running_mean", "running_var")
    return [_arg(args, kwargs, i + 1, n) is not None for i, n in enumerate(names)]


@rule(aten.batch_norm.default)
def batch_norm(ctx: OpCtx):
    """input (N, C, *). Split any dim but C: in training the statistics over the split dims are
    made global by the rewriter; in eval the running statistics make every dim local. Split C:
    each rank normalizes its channels; in training the running statistics stay whole (B) and
    the rewriter gathers each rank's update of them."""
    x = ctx.in_shapes[0]
    if len(x) < 2:
        return []
    weight, bias, rmean, rvar = _bn_present(ctx.args, ctx.kwargs)
    training = bool(_arg(ctx.args, ctx.kwargs, 5, "training"))
    rest = (B,) * (ctx.n_in - 1)
    sigs = [Sig((Split(d),) + rest, (Split(d),)) for d in range(len(x)) if d != 1 and x[d] > 1]
    if x[1] > 1:
        stats = B if training else Split(0)
        ins = (Split(1),) + (Split(0),) * (weight + bias) + (stats,) * (rmean + rvar)
        sigs.append(Sig(ins, (Split(1),)))
    return sigs


def batch_norm_axes(target, args, kwargs, x_placement) -> tuple:
    """Mesh axes on which a batch norm in training needs the runtime (``runtime.batch_norm_train``):
    (axes splitting a dim its statistics run over, whose statistics it gathers; axes splitting
    the channels while it keeps running statistics, whose updates it gathers). Both empty for
    every other op and for eval mode."""
    if target != aten.batch_norm.default or not _arg(args, kwargs, 5, "training"):
        return [], []
    stat = [a for a, q in enumerate(x_placement) if isinstance(q, Split) and q.dim != 1]
    tracked = _bn_present(args, kwargs)[2]
    channel = [a for a, q in enumerate(x_placement) if isinstance(q, Split) and q.dim == 1] if tracked else []
    return stat, channel


def norm_collectives(node, strat, graph, mesh_shape) -> list:
    """(kind, axis, bytes) of the collectives ``runtime.batch_norm_train`` issues: one gather of
    (mean, M2) per axis the statistics span, one gather of the running-statistics update per
    axis splitting the channels."""
    if node.kind != "op" or not strat.inputs:
        return []
    stat, channel = batch_norm_axes(node.target, node.fx_node.args, node.fx_node.kwargs, strat.inputs[0])
    if not stat and not channel:
        return []
    meta = graph.meta(node.inputs[0])
    local_c = meta.shape[1] // math.prod(mesh_shape[a] for a in channel)
    nbytes = 2 * local_c * max(meta.itemsize, 4)
    return [("all_gather", a, nbytes) for a in stat + channel if mesh_shape[a] > 1]


@rule(aten.group_norm.default)
def group_norm(ctx: OpCtx):
    """input (N, C, *): statistics per sample and group, so only the batch splits."""
    x = ctx.in_shapes[0]
    return [Sig((Split(0),) + (B,) * (ctx.n_in - 1), (Split(0),))] if len(x) >= 2 and x[0] > 1 else []


# ---- pooling and upsampling -----------------------------------------------------------------------

def _spatial(target) -> int:
    """How many trailing spatial dims: the digit of max_pool2d, upsample_trilinear3d, ..."""
    return int(re.search(r"(\d)d", target.overloadpacket.__name__).group(1))


def _leading_sigs(ctx: OpCtx):
    """Batch and channel dims (all but the trailing spatial ones) of input 0, any outputs alike."""
    x = ctx.in_shapes[0]
    keep = len(x) - _spatial(ctx.target)
    return [Sig((Split(d),) + (B,) * (ctx.n_in - 1), (Split(d),) * ctx.n_out) for d in range(keep) if x[d] > 1]


def pool_nonlinear(ctx: OpCtx):
    return _leading_sigs(ctx)


def pool_linear(ctx: OpCtx):
    """Average pooling and upsampling are fixed linear maps of their input: P passes through."""
    return _leading_sigs(ctx) + [Sig((P,), (P,) * ctx.n_out)]


MAX_POOLS = [aten.max_pool1d, aten.max_pool2d, aten.max_pool3d, aten.max_pool1d_with_indices,
             aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.adaptive_max_pool1d,
             aten.adaptive_max_pool2d, aten.adaptive_max_pool3d]
LINEAR_POOLS = [aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d, aten.adaptive_avg_pool1d,
                aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d, aten._adaptive_avg_pool2d,
                aten._adaptive_avg_pool3d]
UPSAMPLES = [aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
             aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d,
             aten.upsample_linear1d, aten.upsample_bilinear2d, aten.upsample_bicubic2d,
             aten.upsample_trilinear3d, aten._upsample_bilinear2d_aa]
register(MAX_POOLS, pool_nonlinear)
register(LINEAR_POOLS + UPSAMPLES, pool_linear)
