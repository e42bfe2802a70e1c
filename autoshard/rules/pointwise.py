"""Elementwise ops: any dim of the (broadcast) output may be split, each input split on the dim
that lines up with it, or broadcast where it has size 1 there. Partial sums pass only through ops
that are linear in that input."""
from __future__ import annotations

import torch

from autoshard.placement import B, P, Split
from autoshard.rules.registry import OpCtx, Sig, register, replicated_only

aten = torch.ops.aten


def broadcast_sigs(ctx: OpCtx, in_shapes=None, n_out=None):
    in_shapes = ctx.in_shapes if in_shapes is None else in_shapes
    out = ctx.out_shapes[0]
    n_out = ctx.n_out if n_out is None else n_out
    sigs = []
    for d in range(len(out)):
        if out[d] <= 1:
            continue
        ins = []
        for s in in_shapes:
            off = len(out) - len(s)
            di = d - off
            ins.append(Split(di) if di >= 0 and s[di] == out[d] else B)
        sigs.append(Sig(tuple(ins), (Split(d),) * n_out))
    return sigs


def nonlinear(ctx: OpCtx):
    return broadcast_sigs(ctx)


def linear_unary(ctx: OpCtx):
    """Ops linear in their only tensor input: clone, neg, dtype casts."""
    return broadcast_sigs(ctx) + ([Sig((P,), (P,) * ctx.n_out)] if ctx.n_in == 1 else [])


def _scalar_operand(ctx: OpCtx) -> bool:
    return any(isinstance(a, (int, float, bool)) and not isinstance(a, bool) for a in ctx.args[:2])


def additive(ctx: OpCtx):
    """add, sub: linear when every operand is a partial tensor; a scalar operand would be counted
    once per rank, so then no partial signature."""
    sigs = broadcast_sigs(ctx)
    if ctx.n_in >= 2 and not _scalar_operand(ctx):
        sigs.append(Sig((P,) * ctx.n_in, (P,)))
    elif ctx.n_in == 1 and not _scalar_operand(ctx):
        sigs.append(Sig((P,), (P,)))
    return sigs


def multiplicative(ctx: OpCtx):
    """mul: linear in each operand with the others fixed."""
    sigs = broadcast_sigs(ctx)
    for i in range(ctx.n_in):
        sigs.append(Sig(tuple(P if j == i else B for j in range(ctx.n_in)), (P,)))
    return sigs


def numerator(ctx: OpCtx):
    """div: linear in the numerator only."""
    sigs = broadcast_sigs(ctx)
    if ctx.n_in >= 1 and len(ctx.args) and isinstance(ctx.args[0], torch.fx.Node):
        sigs.append(Sig((P,) + (B,) * (ctx.n_in - 1), (P,)))
    return sigs


def copy_values(ctx: OpCtx):
    """copy(self, src): src's values in self's shape and dtype (an in-place ``copy_`` once
    functionalized): split as an elementwise op; linear in src, self giving only its shape."""
    return broadcast_sigs(ctx) + [Sig((B, P), (P,))]


def new_sized(ctx: OpCtx):
    """new_zeros / new_ones / new_full / new_empty(x, size): a tensor of the given size whose
    values do not depend on x's, so any dim of it may be split, each rank making its share (the
    rewriter gives the op this rank's size: ``rewrite.lower_sized``). x is held split on a dim
    of the same size where it has one (at the same place, as in ``x.new_zeros(*x.shape[:2], n)``,
    else lined up from the right, as zeros_like's), or whole. Made whole, x may lie any way: only
    its dtype and device are read."""
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    sigs = []
    for d in range(len(out)):
        if out[d] <= 1:
            continue
        right = d - (len(out) - len(x))
        at = d if d < len(x) and x[d] == out[d] else right if 0 <= right < len(x) and x[right] == out[d] else None
        if at is not None:
            sigs.append(Sig((Split(at),), (Split(d),)))
        sigs.append(Sig((B,), (Split(d),)))
    sigs += [Sig((Split(k),), (B,)) for k in range(len(x)) if x[k] > 1]
    return sigs + [Sig((P,), (B,))]


def broadcast_tensors(ctx: OpCtx):
    """Each output is its input expanded to the common shape; linear in it."""
    return broadcast_sigs(ctx) + [Sig((P,) * ctx.n_in, (P,) * ctx.n_out)]


NONLINEAR = [
    aten.relu, aten.gelu, aten.silu, aten.tanh, aten.sigmoid, aten.rsqrt, aten.sqrt, aten.exp,
    aten.log, aten.pow, aten.abs, aten.erf, aten.sin, aten.cos, aten.reciprocal, aten.square,
    aten.where, aten.masked_fill, aten.minimum, aten.maximum, aten.clamp, aten.eq, aten.ne,
    aten.lt, aten.le, aten.gt, aten.ge, aten.logical_not, aten.logical_and, aten.logical_or,
    aten.hardtanh, aten.leaky_relu, aten.elu, aten.softplus, aten.mish, aten.log1p, aten.expm1,
    aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like, aten.bitwise_not,
    aten.fill, aten.zero,   # fill_ and zero_ once functionalized: a tensor of self's shape
    aten.relu6, aten.hardswish, aten.hardsigmoid, aten.sign, aten.floor, aten.ceil, aten.round,
    aten.remainder, aten.fmod, aten.lerp, aten.addcmul, aten.addcdiv, aten.atan2,
    aten.div.Tensor_mode, aten.div.Scalar_mode, aten.view.dtype, aten.floor_divide,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor, aten.logical_xor,
    aten.__and__, aten.__or__, aten.__xor__,   # what x & y calls in a traced graph
]
LINEAR_UNARY = [
    aten.neg, aten.clone, aten.contiguous, aten.alias, aten.detach, aten._to_copy, aten.to,
    aten.type_as, aten.lift_fresh_copy, aten.real, aten.positive,
]
ADDITIVE = [aten.add, aten.sub]
MULTIPLICATIVE = [aten.mul]
NUMERATOR = [aten.div.Tensor, aten.div.Scalar]  # rounding modes are not linear
# right only when replicated: each rank must build the same whole tensor
FACTORIES = [
    aten.arange, aten.zeros, aten.ones, aten.full, aten.empty, aten.scalar_tensor, aten.rand,
    aten.randn, aten.randint, aten.rand_like, aten.randn_like, aten.randint_like, aten.tensor,
    aten.linspace, aten.eye, aten.empty_strided, aten.new_zeros, aten.new_ones, aten.new_full,
    aten.new_empty, aten.bernoulli,
]
# their default overloads may be split (their out= overloads stay replicated)
NEW_SIZED = [aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default]

register(LINEAR_UNARY, linear_unary)
register(ADDITIVE, additive)
register(MULTIPLICATIVE, multiplicative)
register(NUMERATOR, numerator)
register(NONLINEAR, nonlinear)
register(FACTORIES, replicated_only)
register(NEW_SIZED, new_sized)
register([aten.broadcast_tensors], broadcast_tensors)
register([aten.copy], copy_values)
