"""Parameters converted again for backward rather than kept (``reshard_after_forward``):
``regather`` and ``regather_member`` mark a converted parameter, and ``regathering`` runs a forward
whose saved-tensor hooks store each marked tensor as the recipe that makes it again.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

import autoshard.runtime.steps as runtime_steps
from autoshard.runtime.grads import _unpack_bucket
from autoshard.runtime.mesh import RankMesh, _mesh
from autoshard.runtime.handles import Pending
from autoshard.runtime.steps import _run

class _State(threading.local):
    def __init__(self):   # run on each thread's first use
        self.regather = None   # the marks of the forward ``regathering`` runs on this thread, None outside one


_state = _State()


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
    if torch.compiler.is_compiling():   # traced: what backward keeps is the compiler's choice
        return x
    marks = _state.regather
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
            runtime_steps._all_gather(buf.view(-1), flat, group=h.group)
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
    """Run a program's forward so that the parameters it marks are not kept for backward. Traced
    (torch.compile), nothing: AOTAutograd chooses what its backward keeps and makes again."""
    if torch.compiler.is_compiling():
        yield
        return
    prev = _state.regather
    _state.regather = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _state.regather = prev
