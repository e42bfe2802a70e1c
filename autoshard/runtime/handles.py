"""``Pending``: the handles of one scheduled collective for one call of the program. The schedule
pass splits a collective into a start and a wait (``steps.step_start``, ``grads.bucket_start``,
...); both take the same ``Pending``, which carries what the start launched to the wait, in
forward and in backward.
"""
from __future__ import annotations

import torch

from autoshard.runtime.mesh import _mesh


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
    """A fresh Pending; ``key`` names what it keeps from call to call (in this rank's mesh).
    Traced (torch.compile), nothing is kept (the traced buckets keep no buffer), and the mesh's
    store is not read: a compiled caller would guard on its contents, changed by the first call."""
    h = Pending()
    if key is not None and not torch.compiler.is_compiling():
        h.kept = _mesh().kept.setdefault(key, {})
    return h
