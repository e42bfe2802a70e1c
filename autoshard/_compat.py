"""The private torch APIs autoshard needs, in one place.

torch.utils._pytree flattens and rebuilds nested inputs and outputs exactly as torch.export saw
them (ExportedProgram.call_spec holds its TreeSpecs); torch has no public equivalent yet.
"""
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401


def thread_local_c10d():
    """(install, uninstall, isolate) for running every rank of a group as a thread of this process
    (autoshard.simulate). c10d keeps its groups in one process-wide registry and the functional
    collectives resolve a group by name in a C++ registry: install swaps the former for one per
    thread (torch's own, which its threaded test backend uses, so it follows c10d's changes),
    isolate(True) makes the latter per thread. Imported on use, so that a torch without them fails
    only the simulation, saying so."""
    try:
        from torch._C._distributed_c10d import _set_thread_isolation_mode
        from torch.testing._internal.distributed.multi_threaded_pg import (
            _install_threaded_pg, _uninstall_threaded_pg)
    except ImportError as e:
        import torch
        raise RuntimeError(
            f"autoshard.simulate needs torch's thread-local process-group world (torch.testing._internal."
            f"distributed.multi_threaded_pg) and c10d's thread isolation mode, which torch {torch.__version__} "
            f"lacks ({e}). Run the ranks as processes instead: autoshard.launch.LocalWorld.") from e
    return _install_threaded_pg, _uninstall_threaded_pg, _set_thread_isolation_mode


def blocked_shard(dim: int, groups: int):
    """The DTensor placement of a blocked split S(dim)/groups on one mesh axis: the dim cut into
    ``groups`` blocks first and each block across the axis, which DTensor writes as a strided
    shard with split factor ``groups`` (the same on every axis that cuts the dim). DTensor has no
    public name for it yet."""
    from torch.distributed.tensor.placement_types import _StridedShard
    return _StridedShard(dim, split_factor=groups)


def dtensor_like(p, local):
    """A DTensor of ``p``'s mesh, placements, shape and strides holding ``local``, which has this
    rank's share's shape and strides (a gradient of ``p``). ``DTensor.from_local`` builds the same
    through an autograd function and a new spec, 40 us a call in Python, paid for every parameter
    at every step; DTensor's constructor with ``p``'s spec costs a tenth of that. Where torch has
    no such constructor, from_local."""
    from torch.distributed.tensor import DTensor
    spec = getattr(p, "_spec", None)
    if spec is not None:
        try:
            return DTensor(local, spec, requires_grad=False)
        except TypeError:
            pass
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def set_collective_timeout(groups, seconds: float) -> None:
    """Bound every collective on ``groups`` to ``seconds``. A group's timeout is fixed when it is
    made (``new_group(timeout=)``; DeviceMesh's subgroups take torch's default, 30 minutes on
    gloo) and torch has no public way to change it after."""
    import datetime
    from torch.distributed.distributed_c10d import _set_pg_timeout
    for group in {id(g): g for g in groups}.values():
        _set_pg_timeout(datetime.timedelta(seconds=seconds), group)
