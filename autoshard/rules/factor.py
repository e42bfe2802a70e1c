"""Matmul-like ops as factor strings: ``"m k, k n -> m n"``.

A factor every side has may be split on all of them (-> S). A contracted factor split on the
operands that have it makes the output a partial sum (-> P); additive operands that lack it (a
bias) must then be P too. The op is linear in each multiplicative operand, so one of them P with
the others B gives P.
"""
from __future__ import annotations

from autoshard.placement import B, P, Split
from autoshard.rules.registry import OpCtx, Sig, rule

import torch

aten = torch.ops.aten


def factor_sigs(operands, output, shapes, out_shape, additive=(), whole=()):
    """operands: per tensor input, a factor name per dim (None: an operand with no factors).
    ``additive``: indices of operands that are added to the product rather than multiplied.
    ``whole``: factor names never split."""
    sigs = []
    names = []
    for ops in operands:
        for f in ops or ():
            if f not in names and f not in whole:
                names.append(f)
    for f in names:
        placements = []
        for i, ops in enumerate(operands):
            if ops and f in ops:
                d = ops.index(f)
                placements.append(Split(d) if shapes[i][d] > 1 else B)
            else:
                placements.append(B)
        if f in output:
            od = output.index(f)
            if out_shape[od] <= 1 or not any(isinstance(p, Split) for p in placements):
                continue
            sigs.append(Sig(tuple(placements), (Split(od),)))
        else:
            if not any(isinstance(p, Split) for p in placements):
                continue
            placements = [P if i in additive else p for i, p in enumerate(placements)]
            sigs.append(Sig(tuple(placements), (P,)))
    mult = [i for i in range(len(operands)) if i not in additive]
    for i in mult:
        placements = tuple(P if j == i or j in additive else B for j in range(len(operands)))
        sigs.append(Sig(placements, (P,)))
    return sigs


def _batch_names(n: int) -> list:
    return [f"b{i}" for i in range(n)]


def matmul_factors(a_shape, b_shape, out_shape):
    """Factor names for torch.matmul's broadcasting semantics."""
    if len(a_shape) == 1 and len(b_shape) == 1:
        return [["k"], ["k"]], []
    if len(a_shape) == 1:
        batch = _batch_names(len(b_shape) - 2)
        return [["k"], batch + ["k", "n"]], batch + ["n"]
    if len(b_shape) == 1:
        batch = _batch_names(len(a_shape) - 2)
        return [batch + ["m", "k"], ["k"]], batch + ["m"]
    nb = len(out_shape) - 2
    batch = _batch_names(nb)
    a_batch = batch[nb - (len(a_shape) - 2):]
    b_batch = batch[nb - (len(b_shape) - 2):]
    return [a_batch + ["m", "k"], b_batch + ["k", "n"]], batch + ["m", "n"]


@rule(aten.mm.default)
def mm(ctx: OpCtx):
    return factor_sigs([["m", "k"], ["k", "n"]], ["m", "n"], ctx.in_shapes, ctx.out_shapes[0])


@rule(aten.bmm.default)
def bmm(ctx: OpCtx):
    return factor_sigs([["b", "m", "k"], ["b", "k", "n"]], ["b", "m", "n"], ctx.in_shapes, ctx.out_shapes[0])


@rule(aten.matmul.default)
def matmul(ctx: OpCtx):
    ops, out = matmul_factors(ctx.in_shapes[0], ctx.in_shapes[1], ctx.out_shapes[0])
    return factor_sigs(ops, out, ctx.in_shapes, ctx.out_shapes[0])


@rule(aten.linear.default)
def linear(ctx: OpCtx):
    x = ctx.in_shapes[0]
    batch = _batch_names(len(x) - 1)
    ops = [batch + ["k"], ["n", "k"]]
    additive = ()
    if ctx.n_in == 3:
        ops.append(["n"])
        additive = (2,)
    return factor_sigs(ops, batch + ["n"], ctx.in_shapes, ctx.out_shapes[0], additive)


@rule(aten.addmm.default)
def addmm(ctx: OpCtx):
    bias = ctx.in_shapes[0]
    bias_f = ["m", "n"][2 - len(bias):] if len(bias) else []
    return factor_sigs([bias_f, ["m", "k"], ["k", "n"]], ["m", "n"], ctx.in_shapes, ctx.out_shapes[0], additive=(0,))


@rule(aten.baddbmm.default)
def baddbmm(ctx: OpCtx):
    bias = ctx.in_shapes[0]
    bias_f = ["b", "m", "n"][3 - len(bias):]
    return factor_sigs([bias_f, ["b", "m", "k"], ["b", "k", "n"]], ["b", "m", "n"], ctx.in_shapes,
                       ctx.out_shapes[0], additive=(0,))


@rule(aten.einsum.default)
def einsum(ctx: OpCtx):
    eq = ctx.arg(0, "equation").replace(" ", "")
    if "..." in eq or "->" not in eq:
        return []
    lhs, out = eq.split("->")
    ops = [list(t) for t in lhs.split(",")]
    if len(ops) != ctx.n_in or any(len(o) != len(s) for o, s in zip(ops, ctx.in_shapes)):
        return []
    if any(len(set(o)) != len(o) for o in ops):  # a repeated index is a diagonal: no rule
        return []
    return factor_sigs(ops, list(out), ctx.in_shapes, ctx.out_shapes[0])
