"""This rank's view of the device mesh, and the one that is active: the emitted program names mesh
axes by index, and the process groups and coordinates behind them come from the ``RankMesh`` the
parallel module activates around each call (``active``). The active mesh lives here alone, in a
thread-local, read through ``_mesh()``.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from autoshard import placement as pl
from autoshard._compat import blocked_shard, checkpoint_blocked_splits

class _State(threading.local):
    """What ``active`` set on this thread: ``mesh``, the RankMesh. Set on each thread's first use,
    so a compiled caller's guard on it reads the same before the first call as after."""

    def __init__(self):
        self.mesh = None


_state = _State()
# key -> RankMesh, for what a compiled program calls by a constant (its generator: ``by_key``);
# keys count up as meshes are made, so every rank gives a module's mesh the same key
_by_key: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_keys = itertools.count()


class RankMesh:
    """This rank's view of the device mesh: a process group and a coordinate per axis, and the
    generator every rank shares for random ops."""

    def __init__(self, device_mesh, generator: torch.Generator, joint: Optional[dict] = None):
        self.device_mesh = device_mesh
        self.shape = tuple(device_mesh.shape)
        self.groups = [device_mesh.get_group(a) for a in range(len(self.shape))]
        self.coords = list(device_mesh.get_coordinate())
        # per axis, whether this rank is the axis's first, as a tensor: a traced program reads it as
        # an input, so that every rank's graph is the same graph (``steps.keep_partial``)
        self.first = [torch.tensor(c == 0, device=device_mesh.device_type) for c in self.coords]
        self.generator = generator
        self.key = next(_keys)
        _by_key[self.key] = self
        self.kept: dict = {}    # key -> what a scheduled collective keeps from call to call
        self.hybrid: list = []  # backward: hybrid gather buckets reduce-scattered, their all-reduces not started
        self.sync_grads = True  # False under ParallelModule.no_sync(): gradients kept unreduced
        self.reduce_dtype = None  # a mixed-precision policy's: parameter gradients all-reduced in it
        # a gradient kept unreduced hands on zeros rather than nothing: torch's zero-bubble weight
        # pass asks autograd for every parameter's gradient, and takes no missing one
        self.held_as_zeros = False
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

    def is_first(self, axes) -> torch.Tensor:
        """Whether this rank is the first of the group spanning ``axes``, as a 0-d bool tensor."""
        if isinstance(axes, int):
            return self.first[axes]
        flag = self.first[axes[0]]
        for a in axes[1:]:
            flag = flag & self.first[a]
        return flag

    @contextlib.contextmanager
    def no_sync(self):
        """Parameter gradients kept unreduced while inside (``no_sync``: ``sync_grads`` False)."""
        before, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = before

    def prepare_groups(self, axis_sets) -> None:
        """Create the groups spanning several axes at once. Collective: every rank calls it with
        the same sets in the same order (the same program gives them)."""
        make_joint_groups(self.device_mesh.mesh, axis_sets, self._joint)


def make_joint_groups(ranks: torch.Tensor, axis_sets, joint: dict, first: int = 0) -> None:
    """Into ``joint``, by axes, the process groups spanning several axes of a mesh at once, those
    axes ``first`` places along the mesh of ``ranks`` (a pipeline's stages: after its own axis,
    every stage's groups made by every rank). Collective: every rank calls it with the same sets
    in the same order."""
    for axes in axis_sets:
        axes = tuple(axes)
        if len(axes) < 2 or axes in joint:
            continue
        full = [a + first for a in axes]
        rest = [a for a in range(ranks.ndim) if a not in full]
        lists = ranks.permute(*rest, *full).reshape(-1, math.prod(ranks.shape[a] for a in full)).tolist()
        joint[axes], _ = dist.new_subgroups_by_enumeration(lists)


@contextlib.contextmanager
def active(mesh: RankMesh):
    prev = _state.mesh
    _state.mesh = mesh
    try:
        yield
    finally:
        _state.mesh = prev


def _mesh() -> RankMesh:
    m = _state.mesh
    if m is None:
        raise RuntimeError("an autoshard program ran outside its parallel module")
    return m


def by_key(key: int) -> RankMesh:
    """The mesh whose ``key`` this is (a compiled program names its mesh by the key: a traced
    graph holds no Python objects)."""
    return _by_key[key]


def dtensor_placements(placement: tuple, name: str) -> list:
    """The DTensor placements of a parameter stored as ``placement`` (a plan's, per mesh axis):
    Shard, the blocked split's strided shard (whose checkpoints are then taught to save it), or
    Replicate. ``name``: the parameter's, for an error that names it."""
    from torch.distributed.tensor import Replicate, Shard
    parts = list(map(pl.parse, placement))
    out = [(Shard(q.dim) if q.groups == 1 else blocked_shard(q.dim, q.groups, name))
           if isinstance(q, pl.Split) else Replicate() for q in parts]
    if any(isinstance(q, pl.Split) and q.groups > 1 for q in parts):
        checkpoint_blocked_splits()   # so that torch.distributed.checkpoint can save it
    return out
