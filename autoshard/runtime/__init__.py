"""What the emitted per-rank program calls: collectives and local layout steps as autograd
functions whose backward is the dual step (the dual rule, DESIGN.md section 3), and the few ops
whose local form differs from the global one.

The program names mesh axes by index; the process groups come from the ``RankMesh`` that the
parallel module activates around each call. Backward runs with the groups saved at forward time.
"""
from __future__ import annotations

import contextlib
import math
import threading
import weakref
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from autoshard import placement as pl
from autoshard._compat import copy_all, dtensor_like, local_tensor, tree_map_only

_state = threading.local()

# torch 2.13 renamed the dim-0 gather and reduce-scatter; older releases have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RankMesh:
    """This rank's view of the device mesh: a process group and a coordinate per axis, and the
    generator every rank shares for random ops."""

    def __init__(self, device_mesh, generator: torch.Generator, joint: Optional[dict] = None):
        self.device_mesh = device_mesh
        self.shape = tuple(device_mesh.shape)
        self.groups = [device_mesh.get_group(a) for a in range(len(self.shape))]
        self.coords = list(device_mesh.get_coordinate())
        self.generator = generator
        self.kept: dict = {}    # key -> what a scheduled collective keeps from call to call
        self.hybrid: list = []  # backward: hybrid gather buckets reduce-scattered, their all-reduces not started
        self.sync_grads = True  # False under ParallelModule.no_sync(): gradients kept unreduced
        self.reduce_dtype = None  # a mixed-precision policy's: parameter gradients all-reduced in it
        # axes -> the group spanning them; ``joint`` shares them between modules on one mesh
        self._joint: dict = {} if joint is None else joint

    def all_groups(self) -> list:
        """Every process group this rank's collectives may run on: one per axis, and those made
        for several axes at once."""
        return [*self.groups, *self._joint.values()]

    def group(self, axes):
        """The process group of this rank's devices along ``axes`` together (one axis: its own)."""
        if isinstance(axes, int) or len(axes) == 1:
            return self.groups[axes if isinstance(axes, int) else axes[0]]
        if tuple(axes) not in self._joint:
            raise RuntimeError(f"the group spanning mesh axes {tuple(axes)} was not created: the program's "
                               "meta['joint_axes'] must list it (passes.rewrite)")
        return self._joint[tuple(axes)]

    def size(self, axes) -> int:
        return self.shape[axes] if isinstance(axes, int) else math.prod(self.shape[a] for a in axes)

    def coord(self, axes) -> int:
        """This rank's place in the group spanning ``axes``: its coordinates flattened in mesh
        order, as a dim split over those axes orders its chunks."""
        if isinstance(axes, int):
            return self.coords[axes]
        c = 0
        for a in axes:
            c = c * self.shape[a] + self.coords[a]
        return c

    def prepare_groups(self, axis_sets) -> None:
        """Create the groups spanning several axes at once. Collective: every rank calls it with
        the same sets in the same order (the same program gives them)."""
        for axes in axis_sets:
            axes = tuple(axes)
            if len(axes) < 2 or axes in self._joint:
                continue
            ranks = self.device_mesh.mesh
            rest = [a for a in range(ranks.ndim) if a not in axes]
            lists = ranks.permute(*rest, *axes).reshape(-1, math.prod(self.shape[a] for a in axes)).tolist()
            self._joint[axes], _ = dist.new_subgroups_by_enumeration(lists)


@contextlib.contextmanager
def active(mesh: RankMesh):
    prev = getattr(_state, "mesh", None)
    _state.mesh = mesh
    try:
        yield
    finally:
        _state.mesh = prev


def _mesh() -> RankMesh:
    m = getattr(_state, "mesh", None)
    if m is None:
        raise RuntimeError("an autoshard program ran outside its parallel module")
    return m


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
        inp = x.contiguous()
        out = inp.new_empty((p * inp.shape[0],) + tuple(inp.shape[1:]))
        work = _all_gather(out, inp, group=group, async_op=True)
        return work, (lambda: out) if dim == 0 else (lambda: torch.cat(out.chunk(p, 0), dim=dim))
    if kind == "reduce_scatter":
        inp = x.contiguous() if dim == 0 else torch.cat(x.chunk(p, dim), dim=0).contiguous()
        out = inp.new_empty((inp.shape[0] // p,) + tuple(inp.shape[1:]))
        work = _reduce_scatter(out, inp, group=group, async_op=True)
        return work, lambda: (inp, out)[1]        # the input kept alive until the work is done
    if kind == "all_reduce":
        out = x.contiguous().clone()
        return dist.all_reduce(out, group=group, async_op=True), lambda: out
    if kind == "all_to_all":    # dim: the split it makes, dim2: the split it removes
        inp = torch.cat(x.chunk(p, dim2), dim=0).contiguous()
        out = torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, group=group, async_op=True)
        return work, lambda: (inp, torch.cat(out.chunk(p, 0), dim=dim))[1]
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
        out = inp.new_empty(sum(counts))
        work = dist.all_to_all_single(out, inp, counts, [b.numel() for b in blocks], group=group, async_op=True)
        return work, lambda: (inp, torch.cat([o.view(s) for o, s in zip(out.split(counts), shapes)], dim))[1]
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
        work.wait()
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
    return _step(x, "keep", axis)


STEP_FUNCTIONS = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce": all_reduce,
                  "all_to_all": all_to_all, "slice": slice_shard, "pad": pad_shard, "keep": keep_partial}


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


def step_start(x, h: "Pending", kind: str, axis, dim=None, dim2=None, groups: int = 1, sizes=None, sizes2=None,
               dtype=None):
    """Start the collective step ``kind`` (one of ``COLLECTIVE_KINDS``) on ``x``; ``step_wait``
    gives its result. ``dtype``: an all-gather of a parameter's policy copy, ``x.to(dtype)``,
    whose gradient is reduce-scattered in ``reduce_dtype`` and handed back in ``x``'s dtype (as
    ``cast_all_gather``, started early)."""
    m = _mesh()
    h.args, h.dtype = (kind, m.group(axis), m.size(axis), dim, dim2, groups, sizes, sizes2), dtype
    if x.requires_grad:
        return _StepStart.apply(x, h, h.args)
    h.work, h.finish = _launch(x if dtype is None else x.to(dtype), *h.args)
    return None


def step_wait(token, h: "Pending"):
    """The result of the step ``step_start`` started."""
    if token is not None:
        return _StepWait.apply(token, h, h.args)
    _wait(h.work)
    out = h.finish()
    h.work = h.finish = None
    return out


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


def weight_later(w, h: "Pending"):
    """``w`` for a ``linear_dw_later`` that hands its gradient here, to be made in this node's backward."""
    return _WeightLater.apply(w, h) if w.requires_grad else w


def linear_dw_later(x, w, b, h: "Pending"):
    """``F.linear`` whose weight gradient ``weight_later`` makes."""
    if not (w.requires_grad and torch.is_grad_enabled()):
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


def _convert(x, src, dst, m: RankMesh, whole=None, arriving: bool = False):
    """Raw conversion between nd placements (no autograd), by the shared step planner. ``whole``:
    the tensor's whole shape, which an uneven split's chunk sizes come from (None: every split
    is even). ``arriving``: a last step that is a collective is started and not waited for; the
    result is an ``Arriving`` tensor, which waits when it is first read."""
    from autoshard.cost.comm import rank_sizes, transition
    if whole is not None and pl.is_even(whole, src, m.shape) and pl.is_even(whole, dst, m.shape):
        whole = None    # the even path: no chunk sizes to work out on every call
    if whole is None:   # every split even
        steps = transition(tuple(x.shape), src, dst, m.shape)
        sizes = [{}] * len(steps)
    else:
        steps = transition(pl.local_shape(whole, src, m.shape), src, dst, m.shape, whole=whole)
        sizes = rank_sizes(whole, src, steps, m.shape, m.coords)
    for i, (st, kw) in enumerate(zip(steps, sizes)):
        args = (st.kind, m.group(st.axis), m.size(st.axis))
        # an all-reduce works on a copy (``_launch``) of x's shape, so the result is the value at
        # this point whatever the caller does to ``x`` after; the other kinds read ``x`` while they run
        if arriving and i == len(steps) - 1 and st.kind == "all_reduce" and not kw:
            work, finish = _launch(x, *args, st.dim, st.dim2, st.groups)
            return Arriving(work, finish, tuple(x.shape), x.dtype, x.device)
        x = _run(x, *args, m.coord(st.axis), st.dim, st.dim2, st.groups, kw.get("sizes"), kw.get("sizes2"))
    return x


# ---- outputs still arriving ---------------------------------------------------------------------
#
# A returned output made whole by an all-reduce (a data-parallel loss) would make every rank wait
# at the end of its forward for the slowest: a barrier DDP's step does not have (each rank returns
# its own loss). Backward never reads the loss's value (autograd starts from ones of its shape),
# so the all-reduce, of a copy, is started and the output returned at once, a tensor that waits
# for it when anything reads it: loss.item(), printing, arithmetic. Backward, started from it,
# runs meanwhile (GPT world 2, data parallel: 1-2% of the step, the difference from DDP). Only an
# all-reduce: the other collectives read their input while they run.

_ARRIVING = threading.Lock()   # one reader waits for an Arriving tensor's collective at a time
# ops that make a tensor of an output's shape without reading it (backward's first gradient)
_SHAPED_LIKE = {torch.ops.aten.ones_like.default: torch.ones, torch.ops.aten.zeros_like.default: torch.zeros,
                torch.ops.aten.empty_like.default: torch.empty}


class Arriving(torch.Tensor):
    """A returned output whose last collective (an all-reduce, of a copy) may still be running:
    every op that reads it, and ``format``, ``tolist``, ``numpy`` and pickling, wait for the
    collective first, then use the whole value (a plain tensor). Its autograd history is the
    output's own; ``detach()`` gives the plain value. What reads a tensor's memory without an op
    (``data_ptr()``, ``share_memory_()``, ``torch.tensor([t])``) does not wait: read
    ``t.detach()`` there."""

    @staticmethod
    def __new__(cls, work, finish, shape, dtype, device):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        out._work, out._finish, out._value = work, finish, None
        return out

    @property
    def pending(self) -> bool:
        """Whether nothing has read it yet, so its collective may still be running."""
        return self._value is None

    def arrived(self) -> torch.Tensor:
        """The value, once the collective is done (waiting for it the first time; one thread
        waits, any other reading at once waits for it)."""
        if self._value is None:
            with _ARRIVING:
                if self._value is None:
                    self._work.wait()
                    self._value, self._work, self._finish = self._finish(), None, None
        return self._value

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made = _SHAPED_LIKE.get(func)
        if made is not None and isinstance(args[0], Arriving):
            like = args[0]
            kw = {k: v for k, v in kwargs.items() if k != "memory_format"}
            return made(like.shape, dtype=kw.pop("dtype", None) or like.dtype,
                        device=kw.pop("device", None) or like.device, **kw)
        # nested too: torch.stack([loss, ...]), the foreach ops, an index
        args, kwargs = tree_map_only(Arriving, Arriving.arrived, (args, kwargs))
        return func(*args, **kwargs)

    # the Python methods that read the data without an op
    def tolist(self):
        return self.arrived().tolist()

    def __format__(self, spec):
        return self.arrived().__format__(spec)

    def numpy(self, *, force: bool = False):
        return self.arrived().numpy(force=force)

    def __repr__(self, *, tensor_contents=None):
        return repr(self.arrived())

    def __reduce_ex__(self, proto):
        return self.arrived().__reduce_ex__(proto)


def _dual(placements):
    return tuple(pl.P if isinstance(p, pl.Broadcast) else pl.B if isinstance(p, pl.Partial) else p
                 for p in placements)


class _ToLocal(torch.autograd.Function):
    """A whole tensor cut to this rank's share; backward turns the gradient, which arrives in the
    dual placement, back into the whole gradient on every rank."""

    @staticmethod
    def forward(ctx, x, dst, mesh):
        ctx.dst, ctx.mesh, ctx.shape = dst, mesh, tuple(x.shape)
        return _convert(x, _whole(len(dst)), dst, mesh, ctx.shape)

    @staticmethod
    def backward(ctx, g):
        return _convert(g, _dual(ctx.dst), _whole(len(ctx.dst)), ctx.mesh, ctx.shape), None, None


def _whole(n):
    return (pl.B,) * n


def to_local(x, placement: tuple):
    """A user input, whole on every rank, cut to this rank's share."""
    m = _mesh()
    dst = tuple(pl.parse(p) for p in placement)
    if not isinstance(x, torch.Tensor):
        return x
    if x.requires_grad:
        return _ToLocal.apply(x, dst, m)
    return _convert(x, _whole(len(dst)), dst, m, tuple(x.shape))


def to_whole(x, placement: tuple, shape: tuple = None):
    """A returned tensor, made whole on every rank. Its gradient arrives whole on every rank,
    which is the dual of each placement after a slice (S), as is (P) or kept on one rank (B).
    ``shape``: the whole shape (needed where a split is uneven)."""
    m = _mesh()
    src = tuple(pl.parse(p) for p in placement)
    if x.requires_grad:
        return _ToWhole.apply(x, src, m, shape)
    return _convert(x, src, _whole(len(src)), m, shape)


class _ToWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, mesh, shape=None):
        ctx.src, ctx.mesh = src, mesh
        return _convert(x, src, _whole(len(src)), mesh, shape, arriving=True)

    @staticmethod
    def backward(ctx, g):
        # g is the true gradient on every rank (B); turn it into dual(src) with local steps only
        return _convert(g, _whole(len(ctx.src)), _dual(ctx.src), ctx.mesh), None, None, None


# ---- gradient accumulation without reduction (ParallelModule.no_sync) ---------------------------
#
# A backward whose forward ran under no_sync reduces no parameter gradient: each reduction point
# adds its unreduced gradient to a sum kept in the rank's mesh and hands nothing on. The first
# backward after it adds that sum to what it reduces, so the gradients reach the parameters
# reduced once, summed over every micro-batch. Reductions are linear: a gradient reduced late is
# the gradient reduced every time.

def _unsynced(kept: dict, g):
    """Add ``g`` to the unreduced sum kept in ``kept``."""
    held = kept.get("unsynced")
    kept["unsynced"] = g.clone() if held is None else held.add_(g)


def _with_unsynced(kept: dict, g, inplace: bool = False):
    """``g`` plus the unreduced sum kept in ``kept`` (which is then gone); ``inplace``: added into ``g``."""
    held = kept.pop("unsynced", None)
    if held is None:
        return g
    return g.add_(held) if inplace else g + held


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kept):
        ctx.group, ctx.kept, ctx.sync, ctx.reduce = group, kept, _mesh().sync_grads, _mesh().reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce is not None:   # reduced in the policy's dtype; autograd casts it back to the master's
            g = g.to(ctx.reduce)
        if not ctx.sync:
            _unsynced(ctx.kept, g)
            return None, None, None
        return _run(_with_unsynced(ctx.kept, g), "all_reduce", ctx.group, None, None, None, None), None, None


def grad_sync(x, axes: tuple, key: str = None):
    """A parameter stored broadcast on ``axes``: its gradient arrives as partial sums there and is
    all-reduced (data parallelism). ``key`` names the parameter's unreduced sum under no_sync."""
    m = _mesh()
    if not x.requires_grad or not axes:
        return x
    kept = m.kept.setdefault(("grad_sync", key), {})
    return _GradSync.apply(x, m.group(tuple(axes)), kept)   # one all-reduce on the group spanning them


# ---- parameters fed to the program --------------------------------------------------------------
#
# A DTensor parameter's ``to_local()`` is an autograd function whose backward wraps the local
# gradient back into a DTensor: a Python autograd node and a DTensor built through
# ``from_local``'s own autograd function, for every parameter at every step (a fifth of the
# step of a small model). The program needs no DTensor: it takes each share as a leaf of its own,
# aliasing the parameter's local tensor, and hands the gradient to ``param.grad`` once autograd
# has accumulated it there.

def param_share(p: torch.Tensor) -> torch.Tensor:
    """This rank's share of the DTensor parameter ``p``, as a leaf tensor aliasing its storage,
    whose gradient goes to ``p.grad`` (a DTensor of ``p``'s placements) when backward completes it.
    The same leaf from step to step while ``p`` holds the same local tensor (``_SHARES``; the
    optimizer and a checkpoint's load write into it in place, and the leaf sees what they
    write): a view, a detach and a hook per parameter at every step were half of the ops a small
    model's program added to the plain model's forward."""
    local = local_tensor(p)
    if not p.requires_grad:
        return local.detach()
    hit = _SHARES.get(p)
    if hit is not None and hit[0] is local:
        return hit[1]
    leaf = local.detach().requires_grad_()
    owner = weakref.ref(p)   # the leaf's hook keeps no parameter alive

    def hand_back(leaf):
        p = owner()
        if p is not None:
            _hand_back(leaf, p)

    leaf.register_post_accumulate_grad_hook(hand_back)
    _SHARES[p] = (local, leaf)
    return leaf


# parameter -> (its local tensor, its leaf); keyed by identity, as tensors compare elementwise
_SHARES = WeakIdKeyDictionary()


def _hand_back(leaf: torch.Tensor, p: torch.Tensor) -> None:
    g, leaf.grad = leaf.grad, None
    if g is None:   # its reduction held back (no_sync): nothing to hand on
        return
    # the gradient is in the parameter's placement (the program reduced it there: grad_sync), and
    # in its share's strides (autograd's layout contract for a leaf's gradient)
    if g.stride() == leaf.stride():
        grad = dtensor_like(p, g)
    else:
        from torch.distributed.tensor import DTensor
        grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
    if p.grad is None:
        p.grad = grad
    else:   # accumulation over several backward passes
        p.grad.add_(grad)


# ---- scheduled collectives: start/wait pairs (built by passes.schedule) ----------------------
#
# A gradient all-reduce or a parameter gather need not block where the rewriter put it. The
# schedule pass splits it into a start and a wait. In forward, a gather starts ahead of its use
# and is waited on at the use. In backward, a parameter's gradient collective starts as soon as
# its gradient is complete, and its wait is an autograd node made at the program's very start:
# autograd runs ready nodes latest-made first, so every wait runs after the backward compute
# that is ready, and the collectives overlap it.

class Pending:
    """One scheduled collective's handles for one call of the program (a fresh one per call)."""

    def __init__(self):
        self.work = self.keep = None            # forward: the started gather, its input kept alive
        self.bwd_work, self.bwd_result = None, None
        self.args = self.finish = self.bwd_finish = None   # an activation step's (step_start)
        self.late = None                        # a linear's (gradient, input) for weight_later
        # a gather bucket's, for gathering it again in backward (regather_member)
        self.shares = self.group = self.p = self.layout = self.again = None
        self.dtype = None                       # a gather bucket's or a cast step's: the dtype gathered in
        self.start = self.reduced = None        # a gather bucket's: how it is reduced; its started reduce-scatter
        self.sync_group = self.reduced_out = None   # a hybrid gather bucket's: its all-reduce's group and buffer
        self.mesh = None                        # a gather bucket's RankMesh (backward runs outside ``active``)
        self.packs = 0
        self.copy_out = False
        self.kept: dict = {}                      # what outlives the call: a gradient bucket's buffer


def pending(key: str = None) -> Pending:
    """A fresh Pending; ``key`` names what it keeps from call to call (in this rank's mesh)."""
    h = Pending()
    if key is not None:
        h.kept = _mesh().kept.setdefault(key, {})
    return h


def _wait(work):
    if work is not None:
        work.wait()


class _GradWait(torch.autograd.Function):
    """Identity in forward; in backward, waits for the gradient collective the matching start
    launched and hands on its results."""

    @staticmethod
    def forward(ctx, h, *xs):
        ctx.h = h
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        h = ctx.h
        if h.reduced_out is not None:   # a hybrid bucket whose all-reduce no later bucket started
            _all_reduce_after(h)
            h.mesh.hybrid = [e for e in h.mesh.hybrid if e is not h]
        _wait(h.bwd_work)
        out = h.bwd_result if h.bwd_result is not None else list(gs)
        if h.copy_out:
            out = [None if g is None else g.clone() for g in out]
        h.bwd_work = h.bwd_result = None
        return (None,) + tuple(out)


class _GradBucket(torch.autograd.Function):
    """Identity in forward; in backward, one all-reduce of the whole bucket of gradients, started
    and not waited on (the bucket's _GradWait waits)."""

    @staticmethod
    def forward(ctx, h, group, *xs):
        ctx.h, ctx.group, ctx.sync, ctx.reduce = h, group, _mesh().sync_grads, _mesh().reduce_dtype
        ctx.metas = [(x.shape, x.dtype, x.device) for x in xs]
        ctx.dtypes = [x.dtype for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        if ctx.reduce is not None:   # all-reduced in the policy's dtype; autograd casts it back to the masters'
            gs = tuple(None if g is None else g.to(ctx.reduce) for g in gs)
            ctx.metas = [(s, ctx.reduce, dev) for s, _, dev in ctx.metas]
        if not ctx.sync:    # kept unreduced (no_sync): nothing reaches the parameters
            _unsynced(ctx.h.kept, torch.cat([(g if g is not None else torch.zeros(s, dtype=d, device=dev)).reshape(-1)
                                             for g, (s, d, dev) in zip(gs, ctx.metas)]))
            ctx.h.bwd_result = [None] * len(gs)
            return (None, None) + (None,) * len(gs)
        numel = sum(math.prod(s) for s, _, _ in ctx.metas)
        _, dtype, device = ctx.metas[0]
        # kept from step to step: a fresh one each step costs the page faults of new memory
        # (a seventh of a data-parallel step on 4 CPU ranks), and the bucket's every use ends at
        # its wait, within the step
        flat = ctx.h.kept.get("buffer")
        if flat is None or flat.numel() != numel or flat.dtype != dtype or flat.device != device:
            flat = ctx.h.kept["buffer"] = torch.empty(numel, dtype=dtype, device=device)
        torch.cat([(g if g is not None else torch.zeros(s, dtype=d, device=dev)).reshape(-1)
                   for g, (s, d, dev) in zip(gs, ctx.metas)], out=flat)
        _with_unsynced(ctx.h.kept, flat, inplace=True)   # what micro-batches under no_sync left
        ctx.h.bwd_work = dist.all_reduce(flat, group=ctx.group, async_op=True)
        # each gradient a tensor of its own once reduced (_GradWait): the bucket is written again
        # next step, and a gradient the optimizer or the user holds must not change with it
        ctx.h.bwd_result = [v.view(s) for v, (s, _, _) in zip(flat.split([math.prod(s) for s, _, _ in ctx.metas]), ctx.metas)]
        ctx.h.copy_out = True
        return (None, None) + _handed_late(ctx.h.bwd_result, ctx.dtypes)


def grad_wait(h: Pending, *xs):
    return _GradWait.apply(h, *xs)


def grad_bucket(h: Pending, axes: tuple, *xs):
    """Parameters stored broadcast on ``axes`` whose gradients are all-reduced together."""
    return _GradBucket.apply(h, _mesh().group(axes), *xs)


# Several parameters gathered as one collective (the schedule pass's gather buckets, as FSDP
# gathers a module's parameters at once): their shares side by side in one flat buffer, one
# all-gather into (p, total), each parameter's p blocks then put on its dim. In backward the dual:
# each gradient cut back into its p blocks, one reduce-scatter of the (p, total) buffer, whose
# result the bucket's _GradWait hands on (made at the program's start, it runs late).

def _to_dim(blocks, dim: int, groups: int):
    """(p, *share) -> the whole tensor: block r on ``dim`` (within each of ``groups`` blocks)."""
    return torch.cat([b.unflatten(dim, (groups, -1)) for b in blocks.unbind(0)], dim=dim + 1).flatten(dim, dim + 1)


def _from_dim(whole, p: int, dim: int, groups: int):
    """The inverse of ``_to_dim``, flattened: (p, numel of a share)."""
    return torch.stack([b.flatten(dim, dim + 1) for b in whole.unflatten(dim, (groups, -1)).chunk(p, dim + 1)]).reshape(p, -1)


def _unpack_bucket(buf, layout) -> list:
    p, off, out = buf.shape[0], 0, []
    for shape, dim, groups in layout:
        n = math.prod(shape)
        out.append(_to_dim(buf[:, off:off + n].reshape(p, *shape), dim, groups))
        off += n
    return out


class _BucketStart(torch.autograd.Function):
    """Forward: start the one all-gather of the shares, cast to ``dtype`` first where one is
    given (a mixed-precision policy's parameter copies, gathered in its bytes, as FSDP2 does).
    Backward: start the one reduce-scatter of their gradients, in the policy's reduce dtype where
    the mesh has one; the shares' gradients come out in their own dtype (autograd casts them)."""

    @staticmethod
    def forward(ctx, h, group, p, dtype, *shares):
        ctx.h = h
        # how its gradients are reduced, which its _BucketWait starts in backward
        h.start = SimpleNamespace(group=group, shapes=[x.shape for x in shares], sync=_mesh().sync_grads,
                                  reduce=_mesh().reduce_dtype, dtypes=[x.dtype for x in shares])
        flat = torch.cat([x.reshape(-1) for x in shares])
        if dtype is not None:
            flat = flat.to(dtype)
        out = flat.new_empty((p, flat.numel()))
        h.work, h.keep = _all_gather(out.view(-1), flat, group=group, async_op=True), flat
        h.shares, h.group, h.p, h.dtype = [x.detach() for x in shares], group, p, dtype   # what a regather needs
        return out

    @staticmethod
    def backward(ctx, g):
        h = ctx.h
        started, grads = h.reduced if h.reduced is not None else (None, ())
        h.reduced = None
        if g is not started:
            raise RuntimeError("autoshard internal error: a gather bucket's gradient reached its start other "
                               "than as its wait reduce-scattered it (a second use of the gathered buffer?)")
        return (None,) * 4 + grads


def _reduce_bucket(h: Pending, g, how) -> tuple:
    """Start the one reduce-scatter of a gather bucket's gradients ``g`` ((p, total), as its
    _BucketWait lays them out), in the policy's reduce dtype where the mesh has one, or keep them
    unreduced under no_sync; the shares' gradients to return, handed on by the bucket's
    _GradWait once reduced. ``how``: what the bucket's _BucketStart kept of it (``h.start``)."""
    if how.reduce is not None:
        g = g.to(how.reduce)
    if not how.sync:    # kept unreduced (no_sync): nothing reaches the parameters
        _unsynced(h.kept, g)
        h.bwd_result = [None] * len(how.shapes)
        return (None,) * len(how.shapes)
    g = _with_unsynced(h.kept, g).contiguous()
    out = g.new_empty(g.shape[1])
    m = h.mesh
    for earlier in m.hybrid:   # the hybrid buckets reduce-scattered before: their all-reduces next
        _all_reduce_after(earlier)
    m.hybrid = []
    h.bwd_work = _reduce_scatter(out, g.view(-1), group=how.group, async_op=True)
    h.bwd_result = [part.view(shape) for part, shape in zip(out.split([math.prod(s) for s in how.shapes]), how.shapes)]
    h.keep = g
    if h.sync_group is not None:
        h.reduced_out = out
        m.hybrid.append(h)
    return _handed_late(h.bwd_result, how.dtypes)


def _all_reduce_after(h: Pending) -> None:
    """A hybrid-sharded bucket's second reduction: once its reduce-scatter is done, the all-reduce
    of the result over the axes its parameters are stored broadcast on, started. Called when the
    next bucket's gradients are made (its reduce-scatter is then most likely done) or by the
    bucket's _GradWait, whichever comes first; on every rank in the same order."""
    if h.reduced_out is None:
        return
    _wait(h.bwd_work)
    h.bwd_work = dist.all_reduce(h.reduced_out, group=h.sync_group, async_op=True)
    h.reduced_out = None


def _handed_late(results, dtypes) -> tuple:
    """A started reduction's results as the gradients a backward returns for inputs of
    ``dtypes``; the bucket's _GradWait hands on the results once reduced. None where the dtypes
    differ: autograd would cast the result at once, copying what the collective is still writing."""
    return tuple(r if r.dtype == d else None for r, d in zip(results, dtypes))


class _BucketWait(torch.autograd.Function):
    """Forward: wait for the bucket's gather and give each parameter whole. Backward: the
    gradients back into (p, total) blocks (local)."""

    @staticmethod
    def forward(ctx, buf, h, layout):
        ctx.layout, ctx.p, ctx.meta, ctx.h = layout, buf.shape[0], (buf.dtype, buf.device), h
        _wait(h.work)
        h.work = h.keep = None
        h.layout = layout
        return tuple(_unpack_bucket(buf, layout))

    @staticmethod
    def backward(ctx, *gs):
        parts = [_from_dim(g, ctx.p, dim, groups) if g is not None
                 else torch.zeros((ctx.p, math.prod(shape)), dtype=ctx.meta[0], device=ctx.meta[1])
                 for g, (shape, dim, groups) in zip(gs, ctx.layout)]
        g = torch.cat(parts, dim=1)
        # the reduce-scatter starts here, as soon as the bucket's gradients are made: its
        # _BucketStart, made at the program's start, is the oldest node and autograd runs it only
        # once nothing made later is ready, at the end of backward
        h = ctx.h
        h.reduced = (g, _reduce_bucket(h, g, h.start))
        return g, None, None


def bucket_start(h: Pending, axis, *shares, dtype=None, sync=()):
    """Start one all-gather of several parameters' ``shares`` over ``axis`` (one, or a tuple),
    cast to ``dtype`` where given. ``sync``: the axes the parameters are stored broadcast on
    (hybrid sharding), over which their reduce-scattered gradients are then all-reduced."""
    m = _mesh()
    h.mesh, h.sync_group = m, (m.group(tuple(sync)) if sync else None)
    return _BucketStart.apply(h, m.group(axis), m.size(axis), dtype, *shares)


def bucket_wait(buf, h: Pending, layout: tuple):
    """The parameters of a started bucket, whole: ``layout`` gives each one's (share shape, dim
    gathered, blocks of that dim)."""
    return _BucketWait.apply(buf, h, layout)


# ---- parameters converted again for backward (reshard_after_forward) ------------------------------
#
# An op keeps what it needs for backward, a gathered weight included. With resharding, the
# rewriter marks each converted parameter (``regather``): while the program's forward runs under
# ``regathering()``, autograd's saved-tensor hooks store a marked tensor (or a view of it) as the
# recipe to make it again, and its backward makes it again from the parameter's share, on every
# rank in the same order (backward runs the same graph everywhere).

def regather(x, share, steps: tuple):
    """``x``, the parameter ``share`` converted by ``steps`` ((kind, axis, dim, dim2, groups),
    as the rewriter emitted them): kept for backward only as that recipe."""
    return _mark(x, _Convert(share.detach(), steps, _mesh()))


def regather_member(x, h: Pending, i: int):
    """``x``, parameter ``i`` of the gather bucket ``h`` made whole: kept for backward only as
    the bucket's recipe, which gathers the whole bucket again once for all its members."""
    return _mark(x, _Member(h, i))


def _mark(x, recipe):
    marks = getattr(_state, "regather", None)
    if marks is not None and torch.is_grad_enabled():
        root = x if x._base is None else x._base
        marks[id(root)] = (weakref.ref(root), recipe)
    return x


def _convert_again(share, steps, m: RankMesh):
    x = share
    for kind, axis, dim, dim2, groups in steps:
        x = _run(x, kind, m.group(axis), m.size(axis), m.coord(axis), dim, dim2, groups)
    return x


class _Convert:
    """One parameter's conversion, run again when backward needs its result."""

    def __init__(self, share, steps, m: RankMesh):
        self.share, self.steps, self.m = share, steps, m

    def packed(self):
        pass

    def again(self):
        return _convert_again(self.share, self.steps, self.m)


class _Member:
    """A parameter of a gather bucket: the first of the bucket's saved tensors that backward
    needs gathers the whole bucket again (one collective), the last one used frees it."""

    def __init__(self, h: Pending, i: int):
        self.h, self.i = h, i

    def packed(self):
        self.h.packs += 1

    def again(self):
        h = self.h
        if h.again is None:
            flat = torch.cat([x.reshape(-1) for x in h.shares])
            if h.dtype is not None:
                flat = flat.to(h.dtype)
            buf = flat.new_empty((h.p, flat.numel()))
            _all_gather(buf.view(-1), flat, group=h.group)
            h.again = _unpack_bucket(buf, h.layout)
        whole = h.again[self.i]
        h.packs -= 1
        if h.packs <= 0:
            h.again = None
        return whole


def _pack(t):
    marks = _state.regather
    root = t if t._base is None else t._base
    entry = marks.get(id(root))
    if entry is None or entry[0]() is not root:
        return t
    recipe = entry[1]
    recipe.packed()
    return (_Again, recipe, t.size(), t.stride(), t.storage_offset())


def _unpack(packed):
    if not (isinstance(packed, tuple) and packed and packed[0] is _Again):
        return packed
    _, recipe, size, stride, offset = packed
    with torch.no_grad():
        whole = recipe.again()
    return whole.as_strided(size, stride, offset)


class _Again:
    """The marker of a saved tensor stored as its recipe."""


@contextlib.contextmanager
def regathering():
    """Run a program's forward so that the parameters it marks are not kept for backward."""
    prev = getattr(_state, "regather", None)
    _state.regather = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _state.regather = prev


# ---- ops whose local form differs -------------------------------------------------------------

def dropout(x, p: float, train: bool, placement: tuple):
    """Draw the whole mask from the generator all ranks share and keep this rank's part: replicas
    agree, and the result equals a single-device draw from the same seed."""
    if not train or p == 0:
        return x
    m = _mesh()
    pls = tuple(pl.parse(q) for q in placement)
    shape = list(x.shape)
    for q, n in zip(pls, m.shape):
        if isinstance(q, pl.Split):
            shape[q.dim] *= n
    if p == 1:
        return x * 0
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=m.generator)
    noise.div_(1 - p)
    for a, (q, n) in enumerate(zip(pls, m.shape)):
        if isinstance(q, pl.Split):
            noise = _slice(noise, n, m.coords[a], q.dim)
    return x * noise


def cross_entropy_mean(x, target, weight, ignore_index: int, label_smoothing: float, axes: tuple,
                       whole_target=None):
    """Mean cross-entropy over a batch split on ``axes``: this rank's sum divided by the count of
    counted targets over all ranks (weighted, as torch does), so the partial sums add up to the
    single-device mean. Given ``whole_target`` (the targets of the whole batch, unweighted), the
    count is taken there, with no all-reduce."""
    m = _mesh()
    total = F.cross_entropy(x, target, weight=weight, reduction="sum", ignore_index=ignore_index,
                            label_smoothing=label_smoothing)
    if whole_target is not None and weight is None:
        with torch.no_grad():
            denom = (whole_target != ignore_index).sum().to(torch.float64)
        return total / denom.to(total.dtype)
    with torch.no_grad():
        counted = target != ignore_index
        if weight is not None:
            denom = weight[target.clamp(min=0)].masked_fill(~counted, 0).sum().to(torch.float64)
        else:
            denom = counted.sum().to(torch.float64)
        for a in axes:
            dist.all_reduce(denom, group=m.groups[a])
    return total / denom.to(total.dtype)


def batch_norm_train(x, weight, bias, running_mean, running_var, momentum: float, eps: float,
                     placement: tuple):
    """Batch norm in training mode on this rank's share ``placement`` of the input, with the
    statistics of the whole batch, as single-device batch norm computes them.

    Each rank takes the mean and the sum of squared deviations (M2) of its share per channel.
    On each axis that splits a dim the statistics run over, the ranks gather each other's
    (mean, M2) and combine them (Chan et al.): mean = the mean of the means (the shares are
    equal), M2 = sum of M2 + n * sum of (mean_i - mean)^2. Unlike sum and sum of squares this
    does not cancel when the mean is large. Everything is differentiable local ops and the
    gather, whose backward is the dual reduce-scatter: each rank gets the gradient that every
    rank's loss sends to its own statistics, so backward is that of the global batch norm too.
    Running statistics (whole on every rank) move by the global mean and unbiased variance; on
    axes that split the channels each rank's update is gathered first, so every rank's buffers
    stay whole and equal."""
    m = _mesh()
    pls = tuple(pl.parse(q) for q in placement)
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1, -1] + [1] * (x.dim() - 2)
    n = x.numel() // max(x.shape[1], 1)
    mean = xs.mean(dims)
    m2 = (xs - mean.view(shape)).square().sum(dims)
    for a, q in enumerate(pls):
        if isinstance(q, pl.Split) and q.dim != 1 and m.shape[a] > 1:
            both = all_gather(torch.stack([mean, m2]).unsqueeze(0), a, 0)   # (p, 2, C)
            means = both[:, 0]
            mean = means.mean(0)
            m2 = both[:, 1].sum(0) + n * (means - mean).square().sum(0)
            n *= m.shape[a]
    var = m2 / n
    out = (xs - mean.view(shape)) * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None or running_var is not None:
        with torch.no_grad():
            update = torch.stack([mean, var * (n / max(n - 1, 1))]).detach()
            channels = tuple(q if isinstance(q, pl.Split) and q.dim == 1 else pl.B for q in pls)
            update = _convert(update, channels, _whole(len(pls)), m)
            for buf, new in ((running_mean, update[0]), (running_var, update[1])):
                if buf is not None:
                    buf.mul_(1 - momentum).add_(new.to(buf.dtype), alpha=momentum)
    return out.to(x.dtype)
