"""The program's edges: a user's input, whole on every rank, cut to this rank's share
(``to_local``), and a returned tensor made whole again (``to_whole``), by the steps the shared
conversion planner (``autoshard.convert``) gives; an output made whole by an all-reduce returned
before that all-reduce completes (``Arriving``).
"""
from __future__ import annotations

import math
import threading

import torch

from autoshard import placement as pl
from autoshard._compat import tree_map_only
from autoshard.convert import rank_sizes, transition
from autoshard.runtime.mesh import RankMesh, _mesh
from autoshard.runtime.steps import _launch, _run, keep_traced


def _convert(x, src, dst, m: RankMesh, whole=None, arriving: bool = False):
    """Raw conversion between nd placements (no autograd), by the shared step planner. ``whole``:
    the tensor's whole shape, which an uneven split's chunk sizes come from (None: every split
    is even). ``arriving``: a last step that is a collective is started and not waited for; the
    result is an ``Arriving`` tensor, which waits when it is first read."""
    if torch.compiler.is_compiling():   # traced, the plan is a constant of the graph
        plan = _traced_plan(tuple(x.shape), tuple(map(str, src)), tuple(map(str, dst)), tuple(m.shape),
                            tuple(m.coords), None if whole is None else tuple(whole))
        arriving = False   # the compiler places the wait: no Arriving
    else:
        plan = _plan(tuple(x.shape), src, dst, m.shape, m.coords, whole)
    for i, (kind, axis, dim, dim2, groups, sizes, sizes2) in enumerate(plan):
        args = (kind, m.group(axis), m.size(axis))
        # an all-reduce works on a copy (``_launch``) of x's shape, so the result is the value at
        # this point whatever the caller does to ``x`` after; the other kinds read ``x`` while they run
        if arriving and i == len(plan) - 1 and kind == "all_reduce" and sizes is None:
            work, finish = _launch(x, *args, dim, dim2, groups)
            return Arriving(work, finish, tuple(x.shape), x.dtype, x.device)
        if kind == "keep" and torch.compiler.is_compiling():
            # traced, a gradient kept on one rank must not be a graph of zeros on the others, which
            # the partitioner may split otherwise and so issue their collectives in another order
            x = keep_traced(x, m, axis)
            continue
        x = _run(x, *args, m.coord(axis), dim, dim2, groups, sizes, sizes2)
    return x


def _plan(shape, src, dst, mesh_shape, coords, whole) -> list:
    """The conversion's steps, each as (kind, axis, dim, dim2, groups, sizes, sizes2)."""
    if whole is not None and pl.is_even(whole, src, mesh_shape) and pl.is_even(whole, dst, mesh_shape):
        whole = None    # the even path: no chunk sizes to work out on every call
    if whole is None:   # every split even
        steps = transition(shape, src, dst, mesh_shape)
        sizes = [{}] * len(steps)
    else:
        steps = transition(pl.local_shape(whole, src, mesh_shape), src, dst, mesh_shape, whole=whole)
        sizes = rank_sizes(whole, src, steps, mesh_shape, coords)
    # a step along axes of one device is no step (a pipeline's stage of one rank: its mesh (k, 1)),
    # and is not run: a collective of one rank is still a call into the process group
    return [(st.kind, st.axis, st.dim, st.dim2, st.groups, kw.get("sizes"), kw.get("sizes2"))
            for st, kw in zip(steps, sizes) if _devices(mesh_shape, st.axis) > 1]


def _devices(mesh_shape, axes) -> int:
    return mesh_shape[axes] if isinstance(axes, int) else math.prod(mesh_shape[a] for a in axes)


@torch.compiler.assume_constant_result
def _traced_plan(shape, src, dst, mesh_shape, coords, whole) -> tuple:
    """``_plan`` of placements given as strings, run when dynamo traces the program rather than
    traced itself: the planner's Python is no part of the graph, its steps constants there."""
    plan = _plan(shape, tuple(map(pl.parse, src)), tuple(map(pl.parse, dst)), mesh_shape, coords, whole)
    return tuple(tuple(None if v is None else tuple(v) if isinstance(v, list) else v for v in st) for st in plan)


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
    if not isinstance(x, torch.Tensor) or _one_device(m):
        return x
    dst = tuple(pl.parse(p) for p in placement)
    if x.requires_grad:
        return _ToLocal.apply(x, dst, m)
    return _convert(x, _whole(len(dst)), dst, m, tuple(x.shape))


def to_whole(x, placement: tuple, shape: tuple = None):
    """A returned tensor, made whole on every rank. Its gradient arrives whole on every rank,
    which is the dual of each placement after a slice (S), as is (P) or kept on one rank (B).
    ``shape``: the whole shape (needed where a split is uneven)."""
    m = _mesh()
    if _one_device(m):
        return x
    src = tuple(pl.parse(p) for p in placement)
    if x.requires_grad:
        return _ToWhole.apply(x, src, m, shape)
    return _convert(x, src, _whole(len(src)), m, shape)


def _one_device(m: RankMesh) -> bool:
    """A mesh of one device (a pipeline's stage of one rank): every conversion is the identity,
    its gradient's too, and a user's input or a result passes as it is, without an autograd node."""
    return all(size == 1 for size in m.shape)


class _ToWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, mesh, shape=None):
        ctx.src, ctx.mesh = src, mesh
        return _convert(x, src, _whole(len(src)), mesh, shape, arriving=True)

    @staticmethod
    def backward(ctx, g):
        # g is the true gradient on every rank (B); turn it into dual(src) with local steps only
        return _convert(g, _whole(len(ctx.src)), _dual(ctx.src), ctx.mesh), None, None, None
