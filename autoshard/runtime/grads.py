"""Parameters in, gradients out: each parameter's share fed to the program as a leaf of its own
(``param_share``), whose gradient goes back to the DTensor parameter; gradients all-reduced where a
parameter is stored broadcast (``grad_sync``, the buckets ``grad_bucket``/``grad_wait``), parameters
gathered several at once and their gradients reduce-scattered (``bucket_start``/``bucket_wait``),
and gradients kept unreduced under ``ParallelModule.no_sync``.
"""
from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist

import autoshard.runtime.steps as runtime_steps
from autoshard._compat import dtensor_like, functional_collective, local_tensor, wait_collective
from autoshard.runtime.mesh import _mesh
from autoshard.runtime.handles import Pending
from autoshard.runtime.steps import _run, _wait


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
    """Identity in forward; in backward, the gradient all-reduced. ``kept`` None: traced
    (torch.compile), where backward keeps nothing from call to call and reduces every time: under
    no_sync too, the same sum (reductions are linear), sent at every micro-batch."""

    @staticmethod
    def forward(ctx, x, group, kept, reduce):
        ctx.group, ctx.kept, ctx.reduce = group, kept, reduce
        ctx.sync = kept is None or _mesh().sync_grads
        ctx.zeros = _mesh().held_as_zeros
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce is not None:   # reduced in the policy's dtype; autograd casts it back to the master's
            g = g.to(ctx.reduce)
        if ctx.kept is None:
            return _run(g, "all_reduce", ctx.group, None, None, None, None), None, None, None
        if not ctx.sync:
            _unsynced(ctx.kept, g)
            return torch.zeros_like(g) if ctx.zeros else None, None, None, None
        return _run(_with_unsynced(ctx.kept, g), "all_reduce", ctx.group, None, None, None, None), None, None, None


def grad_sync(x, axes: tuple, key: str = None):
    """A parameter stored broadcast on ``axes``: its gradient arrives as partial sums there and is
    all-reduced (data parallelism). ``key`` names the parameter's unreduced sum under no_sync."""
    m = _mesh()
    if not x.requires_grad or not axes:
        return x
    kept = None if torch.compiler.is_compiling() else m.kept.setdefault(("grad_sync", key), {})
    return _GradSync.apply(x, m.group(tuple(axes)), kept, m.reduce_dtype)   # one all-reduce on the group spanning them


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
    if torch.compiler.is_compiling():   # traced: DTensor's own autograd hands the gradient back
        return p.to_local() if p.requires_grad else local_tensor(p).detach()
    local = local_tensor(p)
    if not p.requires_grad:
        return local.detach()
    hit = _SHARES.get(id(p))
    if hit is not None and hit[1] is local and hit[0]() is p:
        return hit[2]
    leaf = local.detach().requires_grad_()
    owner = weakref.ref(p, _forget(id(p)))   # the leaf's hook keeps no parameter alive

    def hand_back(leaf):
        p = owner()
        if p is not None:
            _hand_back(leaf, p)

    leaf.register_post_accumulate_grad_hook(hand_back)
    _SHARES[id(p)] = (owner, local, leaf)
    return leaf


# id(parameter) -> (a weak reference to it, its local tensor, its leaf). Keyed by id, as tensors
# compare elementwise: a plain dict's lookup is a twentieth of a weak-keyed one's, paid for every
# parameter at every call
_SHARES: dict = {}


def _forget(key: int):
    """The callback of a parameter's weak reference: its entry goes with it (unless another
    parameter took its id since)."""
    def forget(ref):
        if _SHARES.get(key, (None,))[0] is ref:
            del _SHARES[key]
    return forget


def _hand_back(leaf: torch.Tensor, p: torch.Tensor) -> None:
    g, leaf.grad = leaf.grad, None
    if g is None:   # its reduction held back (no_sync): nothing to hand on
        return
    hit = _SHARES.get(id(p))
    if hit is None or hit[2] is not leaf or hit[1] is not local_tensor(p):
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} holds another local tensor than the one this step's "
            "forward read (its DTensor's data was replaced after the module was last called or compiled): "
            "its gradient would be of the old values. Write into parameters in place "
            "(`with torch.no_grad(): param.copy_(...)`), or call the module uncompiled once after replacing them.")
    grad = share_grad(p, leaf, g)
    if p.grad is None:
        p.grad = grad
    else:   # accumulation over several backward passes
        p.grad.add_(grad)


def share_grad(p: torch.Tensor, leaf: torch.Tensor, g: torch.Tensor):
    """The gradient ``g`` of ``p``'s share ``leaf`` as a DTensor gradient of ``p``: it is in the
    parameter's placement (the program reduced it there: grad_sync), and in its share's strides
    (autograd's layout contract for a leaf's gradient) or, where not, rebuilt from them."""
    if g.stride() == leaf.stride():
        return dtensor_like(p, g)
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)


# ---- scheduled collectives: start/wait pairs (built by passes.schedule) ----------------------
#
# A gradient all-reduce or a parameter gather need not block where the rewriter put it. The
# schedule pass splits it into a start and a wait. In forward, a gather starts ahead of its use
# and is waited on at the use. In backward, a parameter's gradient collective starts as soon as
# its gradient is complete, and its wait is an autograd node made at the program's very start:
# autograd runs ready nodes latest-made first, so every wait runs after the backward compute
# that is ready, and the collectives overlap it.

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
    if torch.compiler.is_compiling():   # traced: each bucket's backward waits where the compiler puts it
        return tuple(xs)
    return _GradWait.apply(h, *xs)


def grad_bucket(h: Pending, axes: tuple, *xs):
    """Parameters stored broadcast on ``axes`` whose gradients are all-reduced together."""
    if torch.compiler.is_compiling():
        return _TracedBucket.apply(_mesh().group(axes), _mesh().reduce_dtype, *xs)
    return _GradBucket.apply(h, _mesh().group(axes), *xs)


class _TracedBucket(torch.autograd.Function):
    """``_GradBucket`` traced (torch.compile): in backward, the bucket's gradients all-reduced as
    one flat functional all-reduce, every time (no_sync too: see ``_GradSync``)."""

    @staticmethod
    def forward(ctx, group, reduce, *xs):
        ctx.group, ctx.reduce = group, reduce
        ctx.metas = [(x.shape, x.dtype if reduce is None else reduce) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        flat = torch.cat([(g.to(d) if g is not None else _absent(s, d, gs)).reshape(-1)
                          for g, (s, d) in zip(gs, ctx.metas)])
        flat = _run(flat, "all_reduce", ctx.group, None, None, None, None)
        parts = flat.split([math.prod(s) for s, _ in ctx.metas])
        return (None, None) + tuple(v.view(s) for v, (s, _) in zip(parts, ctx.metas))


def _absent(shape, dtype, like):
    """Zeros standing in for a gradient autograd did not make, on the device of one it did."""
    device = next(g.device for g in like if g is not None)
    return torch.zeros(shape, dtype=dtype, device=device)


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
    # one split, not a slice per parameter: traced, autograd's backward of a split is one cat,
    # where each slice's is the whole buffer zeroed with the slice written in, and inductor fused
    # the sum of a bucket's 52 such buffers into a kernel of 80 ms of a 330 ms FSDP step (d=256)
    p = buf.shape[0]
    parts = buf.split([math.prod(shape) for shape, _, _ in layout], dim=1)
    return [_to_dim(part.reshape(p, *shape), dim, groups) for part, (shape, dim, groups) in zip(parts, layout)]


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
        h.work, h.keep = runtime_steps._all_gather(out.view(-1), flat, group=group, async_op=True), flat
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
    h.bwd_work = runtime_steps._reduce_scatter(out, g.view(-1), group=how.group, async_op=True)
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
    if torch.compiler.is_compiling():
        return _TracedGather.apply(m.group(axis), m.size(axis), dtype, m.reduce_dtype, h.sync_group, *shares)
    return _BucketStart.apply(h, m.group(axis), m.size(axis), dtype, *shares)


def bucket_wait(buf, h: Pending, layout: tuple):
    """The parameters of a started bucket, whole: ``layout`` gives each one's (share shape, dim
    gathered, blocks of that dim)."""
    if torch.compiler.is_compiling():   # gathered and waited on by _TracedGather: views and cats autograd reverses
        return tuple(_unpack_bucket(buf, layout))
    return _BucketWait.apply(buf, h, layout)


class _TracedGather(torch.autograd.Function):
    """``_BucketStart`` traced (torch.compile): the shares, cast to ``dtype`` where given, gathered
    by one functional all-gather into (p, total), waited on here: a wait outside, on this output,
    would write to a custom Function's output in place, which autograd forbids. Backward: one reduce-scatter of the (p, total) gradients in ``reduce`` (the policy's reduce
    dtype) where given, then, for a hybrid bucket, the all-reduce over ``sync_group``."""

    @staticmethod
    def forward(ctx, group, p, dtype, reduce, sync_group, *shares):
        ctx.group, ctx.p, ctx.reduce, ctx.sync_group = group, p, reduce, sync_group
        ctx.shapes = [x.shape for x in shares]
        flat = torch.cat([x.reshape(-1) for x in shares])
        if dtype is not None:
            flat = flat.to(dtype)
        return wait_collective(functional_collective("all_gather", flat, group, p)).view(p, -1)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce is not None:
            g = g.to(ctx.reduce)
        out = _run(g.contiguous().view(-1), "reduce_scatter", ctx.group, ctx.p, None, 0, None)
        if ctx.sync_group is not None:
            out = _run(out, "all_reduce", ctx.sync_group, None, None, None, None)
        parts = out.split([math.prod(s) for s in ctx.shapes])
        return (None,) * 5 + tuple(v.view(s) for v, s in zip(parts, ctx.shapes))
