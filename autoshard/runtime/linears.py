"""Linears whose backward the schedule pass reorders around a collective in flight: a weight's
gradient made while a backward step flies (``linear_dw_later``, ``weight_later``), and a linear on
an all-gathered input computed block by block around the gather (``linear_local_part``,
``linear_gathered``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.runtime.mesh import _mesh
from autoshard.runtime.handles import Pending


# ---- weight gradients computed while a backward step is in flight --------------------------------
#
# A linear's backward makes its input's gradient, which the dual of an earlier step must carry on,
# and its weight's gradient, which nothing waits for until the optimizer. ``linear_dw_later``
# makes only the first; the second is made by ``weight_later``'s backward, a node the schedule
# pass places between that earlier step's start and wait in forward, so that autograd runs it
# after the dual step has started and before its wait (AxoNN's backward).

class _LinearDwLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, h):
        ctx.save_for_backward(x, w)
        ctx.h, ctx.bias = h, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g.matmul(w) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        ctx.h.late = (g, x)
        return gx, None, gb, None


class _WeightLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, h):
        ctx.set_materialize_grads(False)
        ctx.h = h
        return w.view_as(w)

    @staticmethod
    def backward(ctx, _):
        g, x = ctx.h.late
        ctx.h.late = None
        return g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])), None


def weight_later(w, h: Pending):
    """``w`` for a ``linear_dw_later`` that hands its gradient here, to be made in this node's backward."""
    # traced (torch.compile), the compiler orders backward: each linear keeps its own weight gradient
    return _WeightLater.apply(w, h) if w.requires_grad and not torch.compiler.is_compiling() else w


def linear_dw_later(x, w, b, h: Pending):
    """``F.linear`` whose weight gradient ``weight_later`` makes."""
    if not (w.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return F.linear(x, w, b)
    return _LinearDwLater.apply(x, w, b, h)


# ---- a linear on an all-gathered input, decomposed (collective matmul) ---------------------------
#
# linear(all_gather(x, dim)) for a dim other than the features: the rows of this rank's own block
# are linear(x), ready before the gather completes. ``linear_local_part`` computes them between
# the gather's start and wait, ``linear_gathered`` the other blocks' rows after the wait, placing
# each block where the gather puts it. In backward, the gathered input's own block gets no
# gradient from the second (it is not read), so the dual reduce-scatter sums the other ranks'
# contributions to this rank's block, and the first adds this rank's own, computed while the
# reduce-scatter flies. The weight's and the bias's gradients come from the second alone, over
# every row of the gathered input at once (whose own block is ``x``, as the gather put it there):
# one matmul as the undecomposed linear's, where two half-height ones and the sum of their
# results, a weight-sized add, would do the same work in three ops.

class _LocalPart(torch.autograd.Function):
    """``linear(x, w, b)`` whose backward gives only ``x``'s gradient (``_Gathered`` gives the
    weight's and the bias's, this block's rows among the others)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        w, = ctx.saved_tensors
        return (g.matmul(w) if ctx.needs_input_grad[0] else None), None, None


class _Gathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole, part, w, b, p, me, dim):
        ctx.save_for_backward(whole, w)
        ctx.p, ctx.me, ctx.dim, ctx.bias = p, me, dim, b is not None
        blocks = whole.chunk(p, dim)
        return torch.cat([part if r == me else F.linear(blk, w, b) for r, blk in enumerate(blocks)], dim=dim)

    @staticmethod
    def backward(ctx, g):
        whole, w = ctx.saved_tensors
        p, me, dim = ctx.p, ctx.me, ctx.dim
        gs = g.chunk(p, dim)
        gwhole = gw = gb = None
        if ctx.needs_input_grad[0]:   # the own block's rows: zero (part's backward gives them)
            gwhole = torch.cat([gs[r].new_zeros(gs[r].shape[:-1] + w.shape[1:]) if r == me else gs[r].matmul(w)
                                for r in range(p)], dim=dim)
        flat = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[2]:
            gw = flat.t().matmul(whole.reshape(-1, whole.shape[-1]))
        if ctx.bias and ctx.needs_input_grad[3]:
            gb = flat.sum(0)
        return gwhole, gs[me], gw, gb, None, None, None


def linear_local_part(x, w, b, dim: int):
    """linear(x, w, b): the rows of this rank's block, or None where ``dim`` is the features'."""
    if dim % x.dim() == x.dim() - 1:
        return None
    if not torch.is_grad_enabled():
        return F.linear(x, w, b)
    return _LocalPart.apply(x, w, b)


def linear_gathered(whole, part, w, b, axis, dim: int):
    """linear(whole, w, b), ``whole`` the all-gather over ``axis`` on ``dim`` whose own block's
    rows are ``part`` (from ``linear_local_part``)."""
    if part is None:
        return F.linear(whole, w, b)
    m = _mesh()
    p, me = m.size(axis), m.coord(axis)
    if not torch.is_grad_enabled():
        blocks = whole.chunk(p, dim)
        return torch.cat([part if r == me else F.linear(blk, w, b) for r, blk in enumerate(blocks)], dim=dim)
    return _Gathered.apply(whole, part, w, b, p, me, dim % whole.dim())
