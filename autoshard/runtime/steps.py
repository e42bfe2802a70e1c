"""The collective and local layout steps the emitted program runs, as autograd functions whose
backward is the dual step (the dual rule, DESIGN.md section 3): raw steps (``_launch``, ``_run``),
the per-kind functions the program calls (``all_gather``, ``reduce_scatter``, ...), a parameter's
low-precision copy cast and gathered (``cast_all_gather``, ``cast_many``), and the activation steps
the schedule pass splits into a start and a wait (``step_start``, ``step_wait``). Backward runs
with the groups saved at forward time.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autoshard._compat import copy_all, functional_collective, wait_collective
from autoshard.runtime.mesh import _mesh
from autoshard.runtime.handles import Pending

# torch 2.13 renamed the dim-0 gather and reduce-scatter; older releases have only the old names.
# The runtime's other modules call these two through this module (``runtime_steps._all_gather``),
# so that a test counting the collectives a program issues replaces them in one place.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- raw steps (no autograd) ------------------------------------------------------------------

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# each step's dual (DESIGN.md section 3): its kind, and which of (dim, dim2) become its (dim, dim2)
DUAL = {"all_gather": ("reduce_scatter", 0, None), "reduce_scatter": ("all_gather", 0, None),
        "all_reduce": ("all_reduce", None, None), "all_to_all": ("all_to_all", 1, 0),
        "slice": ("pad", 0, None), "pad": ("slice", 0, None), "keep": ("keep", None, None)}


def dual_args(kind, dim, dim2):
    """The dual step's kind, dim and dim2."""
    d, i, j = DUAL[kind]
    pick = (dim, dim2)
    return d, (None if i is None else pick[i]), (None if j is None else pick[j])


def dual_sizes(kind, sizes, sizes2):
    """The dual step's chunk sizes: an all_to_all's two dims swap; every other keeps its dim's."""
    return (sizes2, sizes) if kind == "all_to_all" else (sizes, sizes2)


def _launch(x, kind, group, p, dim, dim2, groups=1, sizes=None, sizes2=None):
    """Start one collective step on ``x``: (work, finish), where ``finish()`` gives the result once
    the work is done. Collectives exchange dim-0 blocks: the cut moves to dim 0 and back.
    ``sizes`` (``sizes2``): the group's chunks of ``dim`` (``dim2``) where they are unequal."""
    if sizes is not None or sizes2 is not None:
        return _launch_uneven(x, kind, group, p, dim, dim2, sizes, sizes2)
    if groups != 1:   # a blocked split: the step runs on each block's part, the blocks kept in order
        work, finish = _launch(x.unflatten(dim, (groups, -1)), kind, group, p, dim + 1, None)
        return work, lambda: finish().flatten(dim, dim + 1)
    if kind == "all_gather":
        work, out = _issue(kind, x.contiguous(), group, p)
        return work, out if dim == 0 else (lambda: torch.cat(out().chunk(p, 0), dim=dim))
    if kind == "reduce_scatter":
        inp = x.contiguous() if dim == 0 else torch.cat(x.chunk(p, dim), dim=0).contiguous()
        return _issue(kind, inp, group, p)
    if kind == "all_reduce":
        return _issue(kind, x.contiguous(), group, p)
    if kind == "all_to_all":    # dim: the split it makes, dim2: the split it removes
        work, out = _issue(kind, torch.cat(x.chunk(p, dim2), dim=0).contiguous(), group, p)
        return work, lambda: torch.cat(out().chunk(p, 0), dim=dim)
    raise ValueError(kind)


def _issue(kind, inp, group, p, out_splits=None, in_splits=None):
    """Start the dim-0 collective ``kind`` on the contiguous ``inp``: (work, result), ``result()``
    its output once ``work`` is done. Traced (torch.compile), a functional collective: no work,
    its ``wait_tensor`` where the result is first read."""
    if torch.compiler.is_compiling():
        started = functional_collective(kind, inp, group, p, out_splits, in_splits)
        return None, lambda: wait_collective(started)
    if kind == "all_gather":
        out = inp.new_empty((p * inp.shape[0],) + tuple(inp.shape[1:]))
        return _all_gather(out, inp, group=group, async_op=True), lambda: out
    if kind == "reduce_scatter":
        out = inp.new_empty((inp.shape[0] // p,) + tuple(inp.shape[1:]))
        work = _reduce_scatter(out, inp, group=group, async_op=True)
        return work, lambda: (inp, out)[1]        # the input kept alive until the work is done
    if kind == "all_reduce":   # of a copy: the result is the value at the start, whatever comes after
        out = inp.clone()
        return dist.all_reduce(out, group=group, async_op=True), lambda: out
    if kind == "all_to_all":
        out = inp.new_empty((sum(out_splits),) + tuple(inp.shape[1:])) if out_splits else torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
        return work, lambda: (inp, out)[1]
    raise ValueError(kind)


# An uneven split (17 rows over 4: 5, 5, 5, 2, DTensor's Shard layout) travels padded to its
# largest chunk, as gloo's all-gather and reduce-scatter take equal blocks, and is trimmed after;
# an all-to-all sends each rank its own block's size (all_to_all_single's split sizes).

def _padded(x, dim, n):
    if x.shape[dim] == n:
        return x
    shape = list(x.shape)
    shape[dim] = n
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _launch_uneven(x, kind, group, p, dim, dim2, sizes, sizes2):
    me = dist.get_rank(group)
    if kind == "all_gather":
        c = max(sizes)
        work, finish = _launch(_padded(x, dim, c), kind, group, p, dim, None)
        return work, lambda: torch.cat([b.narrow(dim, 0, n) for b, n in zip(finish().chunk(p, dim), sizes)], dim)
    if kind == "reduce_scatter":
        c = max(sizes)
        blocks = torch.cat([_padded(b, dim, c) for b in x.split(list(sizes), dim)], dim)
        work, finish = _launch(blocks, kind, group, p, dim, None)
        return work, lambda: finish().narrow(dim, 0, sizes[me])
    if kind == "all_to_all":    # dim gathered (its chunks: sizes), dim2 scattered (sizes2)
        sizes = sizes or (x.shape[dim],) * p
        sizes2 = sizes2 or (x.shape[dim2] // p,) * p
        blocks = x.split(list(sizes2), dim2)
        inp = torch.cat([b.reshape(-1) for b in blocks])
        shapes = []
        for r in range(p):
            s = list(x.shape)
            s[dim], s[dim2] = sizes[r], sizes2[me]
            shapes.append(s)
        counts = [math.prod(s) for s in shapes]
        work, out = _issue(kind, inp, group, p, counts, [b.numel() for b in blocks])
        return work, lambda: torch.cat([o.view(s) for o, s in zip(out().split(counts), shapes)], dim)
    raise ValueError(kind)


def _slice(x, p, coord, dim, sizes=None):
    if sizes is not None:
        return x.narrow(dim, sum(sizes[:coord]), sizes[coord]).contiguous()
    return x.chunk(p, dim)[coord].contiguous()


def _pad(x, p, coord, dim, sizes=None):
    shape = list(x.shape)
    shape[dim] = sum(sizes) if sizes is not None else shape[dim] * p
    out = x.new_zeros(shape)
    out.narrow(dim, sum(sizes[:coord]) if sizes is not None else coord * x.shape[dim], x.shape[dim]).copy_(x)
    return out


def _keep(x, coord):
    return x if coord == 0 else torch.zeros_like(x)


class _Step(torch.autograd.Function):
    """One layout step on one axis; backward runs its dual."""

    @staticmethod
    def forward(ctx, x, kind, group, p, coord, dim, dim2, groups, sizes=None, sizes2=None):
        ctx.args = (kind, group, p, coord, dim, dim2, groups, sizes, sizes2)
        return _run(x, kind, group, p, coord, dim, dim2, groups, sizes, sizes2)

    @staticmethod
    def backward(ctx, g):
        kind, group, p, coord, dim, dim2, groups, sizes, sizes2 = ctx.args
        sizes, sizes2 = dual_sizes(kind, sizes, sizes2)
        kind, dim, dim2 = dual_args(kind, dim, dim2)
        return (_run(g, kind, group, p, coord, dim, dim2, groups, sizes, sizes2),) + (None,) * 9


def _run(x, kind, group, p, coord, dim, dim2, groups=1, sizes=None, sizes2=None):
    if kind in COLLECTIVE_KINDS:
        work, finish = _launch(x, kind, group, p, dim, dim2, groups, sizes, sizes2)
        _wait(work)
        return finish()
    if groups != 1:
        x = x.unflatten(dim, (groups, -1))
        return _run(x, kind, group, p, coord, dim + 1, None).flatten(dim, dim + 1)
    if kind == "slice":
        return _slice(x, p, coord, dim, sizes)
    if kind == "pad":
        return _pad(x, p, coord, dim, sizes)
    if kind == "keep":
        return _keep(x, coord)
    raise ValueError(kind)


def _step(x, kind, axis, dim=None, dim2=None, groups=1, sizes=None, sizes2=None):
    m = _mesh()
    args = (kind, m.group(axis), m.size(axis), m.coord(axis), dim, dim2, groups, sizes, sizes2)
    return _Step.apply(x, *args) if x.requires_grad else _run(x, *args)


class _CastGather(torch.autograd.Function):
    """A parameter's share cast to a policy's ``dtype``, then gathered; backward reduce-scatters
    the copy's gradient in the policy's ``reduce_dtype`` (else ``dtype``) and hands it back in the
    master's dtype, as FSDP2 reduces a bf16 copy's gradient in fp32 into the fp32 gradient."""

    @staticmethod
    def forward(ctx, x, dtype, group, p, coord, dim, groups, sizes):
        ctx.args, ctx.master = (group, p, coord, dim, groups, sizes), x.dtype
        ctx.reduce = _mesh().reduce_dtype or dtype
        return _run(x.to(dtype), "all_gather", group, p, coord, dim, None, groups, sizes)

    @staticmethod
    def backward(ctx, g):
        group, p, coord, dim, groups, sizes = ctx.args
        out = _run(g.to(ctx.reduce), "reduce_scatter", group, p, coord, dim, None, groups, sizes)
        return (out.to(ctx.master),) + (None,) * 7


def cast_all_gather(x, axis: int, dim: int, dtype: torch.dtype, groups: int = 1, sizes=None):
    """``all_gather(x.to(dtype))`` with its gradient reduced in ``reduce_dtype``: a split
    parameter's low-precision copy gathered outside the schedule's buckets (passes.schedule.fuse_cast_gathers)."""
    if not x.requires_grad:
        return all_gather(x.to(dtype), axis, dim, groups, sizes)
    m = _mesh()
    return _CastGather.apply(x, dtype, m.group(axis), m.size(axis), m.coord(axis), dim, groups, sizes)


class _CastMany(torch.autograd.Function):
    """Several tensors cast to one ``dtype`` as one autograd node: a policy's copies of the
    parameters, made by one foreach copy instead of an op and an autograd node each (on a GPU
    17 us and 24 us of the host's time apiece, more than the kernel of a small parameter's cast);
    backward hands each gradient back in its master's dtype, as the cast's own backward does."""

    @staticmethod
    def forward(ctx, dtype, *xs):
        ctx.set_materialize_grads(False)
        ctx.dtypes = tuple(x.dtype for x in xs)
        return tuple(_copies(xs, [dtype] * len(xs)))

    @staticmethod
    def backward(ctx, *grads):
        given = [i for i, g in enumerate(grads) if g is not None]
        back = [None] * len(grads)
        for i, g in zip(given, _copies([grads[i] for i in given], [ctx.dtypes[i] for i in given])):
            back[i] = g
        return (None, *back)


def _copies(xs, dtypes) -> list:
    """Each of ``xs`` copied into a new tensor of its ``dtypes`` entry, by one foreach copy."""
    out = [torch.empty_like(x, dtype=d) for x, d in zip(xs, dtypes)]
    if out:
        copy_all(out, list(xs))
    return out


def cast_many(dtype: torch.dtype, *xs) -> tuple:
    """``tuple(aten._to_copy(x, dtype=dtype) for x in xs)`` as one op, and one autograd node for
    those that take a gradient (passes.schedule.batch_casts)."""
    if torch.compiler.is_compiling():   # traced, the compiler fuses the casts
        return tuple(x.to(dtype) for x in xs)
    grad = torch.is_grad_enabled()
    taking = [grad and x.requires_grad for x in xs]
    out = [None] * len(xs)
    for want in (False, True):
        idx = [i for i, t in enumerate(taking) if t is want]
        if not idx:
            continue
        parts = _CastMany.apply(dtype, *(xs[i] for i in idx)) if want else _copies([xs[i] for i in idx],
                                                                                     [dtype] * len(idx))
        for i, c in zip(idx, parts):
            out[i] = c
    return tuple(out)


# the names the emitted program calls, one per step kind; ``groups``: of a blocked split S(dim)/groups;
# ``sizes``: the chunks of an uneven split of ``dim`` over the axis's ranks (``sizes2``: of ``dim2``)
def all_gather(x, axis: int, dim: int, groups: int = 1, sizes=None):
    return _step(x, "all_gather", axis, dim, groups=groups, sizes=sizes)


def reduce_scatter(x, axis: int, dim: int, groups: int = 1, sizes=None):
    return _step(x, "reduce_scatter", axis, dim, groups=groups, sizes=sizes)


def all_reduce(x, axis: int):
    return _step(x, "all_reduce", axis)


def all_to_all(x, axis, dim: int, dim2: int, sizes=None, sizes2=None):   # axis: one, or a tuple of axes as one group
    return _step(x, "all_to_all", axis, dim, dim2, sizes=sizes, sizes2=sizes2)


def slice_shard(x, axis: int, dim: int, groups: int = 1, sizes=None):
    return _step(x, "slice", axis, dim, groups=groups, sizes=sizes)


def pad_shard(x, axis: int, dim: int, groups: int = 1, sizes=None):
    return _step(x, "pad", axis, dim, groups=groups, sizes=sizes)


def keep_partial(x, axis: int):
    if torch.compiler.is_compiling():
        # traced, the rank's coordinate is an input, not a branch: a graph that differs from rank to
        # rank may be partitioned differently (what backward recomputes, what forward makes ahead)
        # and issue its collectives in another order on each rank
        return keep_traced(x, _mesh(), axis)
    return _step(x, "keep", axis)


def keep_traced(x, m, axis):
    """``keep`` traced: the same graph on every rank, whose coordinate is an input."""
    return torch.where(m.is_first(axis), x, 0)


STEP_FUNCTIONS = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce": all_reduce,
                  "all_to_all": all_to_all, "slice": slice_shard, "pad": pad_shard, "keep": keep_partial}


def _wait(work):
    if work is not None:
        work.wait()


# ---- activation steps, started early and waited on late ---------------------------------------
#
# The schedule pass splits each collective step between ops into ``step_start`` (right after its
# input is made) and ``step_wait`` (right before its first use), so the ops between them run while
# it is in flight. Backward mirrors it: the wait's backward starts the dual step, the start's
# backward waits for it. Autograd runs ready nodes latest-made first, so the backward of every op
# made between the two in forward runs while the dual step is in flight.

class _StepStart(torch.autograd.Function):
    """Forward: start the step; its result comes from the matching ``_StepWait``. The token it
    returns only ties the two in autograd. Backward: wait for the dual step, hand on its result."""

    @staticmethod
    def forward(ctx, x, h, args):
        ctx.h, ctx.dtype = h, x.dtype
        h.work, h.finish = _launch(x if h.dtype is None else x.to(h.dtype), *args)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        h = ctx.h
        _wait(h.bwd_work)
        g = h.bwd_finish()
        h.bwd_work = h.bwd_finish = None
        return g.to(ctx.dtype), None, None


class _StepWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, h, args):
        ctx.h, ctx.args = h, args
        # a policy copy's gather: its gradient reduced in reduce_dtype (unset: the copy's own)
        ctx.reduce = None if h.dtype is None else _mesh().reduce_dtype or h.dtype
        _wait(h.work)
        out = h.finish()
        h.work = h.finish = None
        return out

    @staticmethod
    def backward(ctx, g):
        kind, group, p, dim, dim2, groups, sizes, sizes2 = ctx.args
        sizes, sizes2 = dual_sizes(kind, sizes, sizes2)
        kind, dim, dim2 = dual_args(kind, dim, dim2)
        if ctx.reduce is not None:
            g = g.to(ctx.reduce)
        ctx.h.bwd_work, ctx.h.bwd_finish = _launch(g, kind, group, p, dim, dim2, groups, sizes, sizes2)
        return g.new_empty(0), None, None


def step_start(x, h: Pending, kind: str, axis, dim=None, dim2=None, groups: int = 1, sizes=None, sizes2=None,
               dtype=None):
    """Start the collective step ``kind`` (one of ``COLLECTIVE_KINDS``) on ``x``; ``step_wait``
    gives its result. ``dtype``: an all-gather of a parameter's policy copy, ``x.to(dtype)``,
    whose gradient is reduce-scattered in ``reduce_dtype`` and handed back in ``x``'s dtype (as
    ``cast_all_gather``, started early)."""
    m = _mesh()
    h.args, h.dtype = (kind, m.group(axis), m.size(axis), dim, dim2, groups, sizes, sizes2), dtype
    if torch.compiler.is_compiling():
        return _traced_start(x, h, dtype, m.reduce_dtype)
    if x.requires_grad:
        return _StepStart.apply(x, h, h.args)
    h.work, h.finish = _launch(x if dtype is None else x.to(dtype), *h.args)
    return None


def _traced_start(x, h: Pending, dtype, reduce_dtype):
    """``step_start`` traced: a functional collective started here, its wait at ``step_wait``, the
    dual step its autograd. A policy copy whose gradient is reduced in another dtype is cast and
    gathered here whole (``_CastGather``): the functional gather's own gradient keeps the copy's."""
    if dtype is not None and x.requires_grad and (reduce_dtype or dtype) != dtype:
        kind, group, p, dim, _, groups, sizes, _ = h.args
        out = _CastGather.apply(x, dtype, group, p, None, dim, groups, sizes)
        h.work, h.finish = None, lambda: out
    else:
        h.work, h.finish = _launch(x if dtype is None else x.to(dtype), *h.args)
    return None


def step_wait(token, h: Pending):
    """The result of the step ``step_start`` started."""
    if token is not None:
        return _StepWait.apply(token, h, h.args)
    _wait(h.work)
    out = h.finish()
    h.work = h.finish = None
    return out

