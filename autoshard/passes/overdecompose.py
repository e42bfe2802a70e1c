"""Overdecompose: a linear whose output one all-reduce or reduce-scatter converts, run in chunks so
that each chunk's collective overlaps the next chunk's matmul (Tensor3D's overdecomposition; in
a sequence-parallel plan, matmul-then-reduce-scatter as a collective matmul).

    y = linear(x, w, b); z = step(y)

becomes, for k chunks of ``x`` cut on a dim the step does not cut,

    x_0 .. x_k-1 = tensor_split(x, k, dim)
    y_0 = linear(x_0, w, b); start step(y_0)
    y_1 = linear(x_1, w, b); start step(y_1)          # runs while step(y_0) flies
    ...
    z = cat([wait step(y_0), ..., wait step(y_k-1)], dim)

Each chunk's step is a ``runtime.step_start`` / ``step_wait`` pair, so backward mirrors it: the
waits' backward starts every chunk's dual step, and each chunk's backward matmuls run once its
dual is done, while the others' still fly. The chunks are exact: a linear is computed row by row,
and the step cuts none of the chunked dim.

The plan chooses what to chunk and into how many (``plan.schedule["chunks"]``: producer, consumer,
k, dim, priced by ``cost.overlap``); the schedule pass calls this before it starts the other steps
early (``passes.schedule``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard import runtime

_CHUNKED = {runtime.all_reduce: "all_reduce", runtime.reduce_scatter: "reduce_scatter"}


def overdecompose(g: fx.Graph, chunks) -> list:
    """Chunk, in ``g``, each conversion ``chunks`` names: a list of (producer, consumer, k, dim),
    the captured graph's node names (``meta["source"]`` of the program's nodes). Returns the
    (producer, consumer, k) it chunked; a conversion the program does not hold as one step of a
    linear read by nothing else is left as it is."""
    want = {}
    for entry in chunks or ():
        producer, consumer, k, dim = entry
        if not (isinstance(k, int) and k >= 1 and isinstance(dim, int)):
            raise ValueError(f"plan.schedule['chunks']: {entry!r} is not (producer, consumer, k >= 1, dim)")
        if k > 1:
            want[(producer, consumer)] = (k, dim)
    done = []
    for n in list(g.nodes):
        kind = _CHUNKED.get(n.target) if n.op == "call_function" else None
        if kind is None or not n.users:
            continue
        lin = n.args[0]
        if not (lin.op == "call_function" and lin.target is torch.ops.aten.linear.default
                and len(lin.users) == 1):
            continue
        key = (lin.meta.get("source"), n.meta.get("source"))
        if key not in want or n.kwargs.get("groups", 1) != 1 or n.kwargs.get("sizes") is not None:
            continue
        k, dim = want[key]
        _chunk(g, n, lin, kind, k, dim)
        done.append((*key, k))
    return done


def _chunk(g: fx.Graph, step: fx.Node, lin: fx.Node, kind: str, k: int, dim: int) -> None:
    x, rest, kw = lin.args[0], lin.args[1:], step.kwargs
    args = (kind, kw["axis"], kw.get("dim"), kw.get("dim2"), kw.get("groups", 1))
    handles, tokens = [], []
    with g.inserting_before(lin):
        parts = g.call_function(torch.tensor_split, (x, k, dim))
        for i in range(k):
            part = g.call_function(operator.getitem, (parts, i))
            y = g.call_function(torch.ops.aten.linear.default, (part, *rest), dict(lin.kwargs))
            y.meta["source"] = lin.meta.get("source")
            h = g.call_function(runtime.pending, ())
            tokens.append(g.call_function(runtime.step_start, (y, h, *args)))
            handles.append(h)
    order = {n: i for i, n in enumerate(g.nodes)}
    first = min(step.users, key=order.get)
    with g.inserting_before(first):
        waits = [g.call_function(runtime.step_wait, (t, h)) for t, h in zip(tokens, handles)]
        whole = g.call_function(torch.cat, (waits, dim))
    step.replace_all_uses_with(whole)
    g.erase_node(step)
    g.erase_node(lin)
