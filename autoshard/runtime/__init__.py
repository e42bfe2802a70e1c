"""What the emitted per-rank program calls: collectives and local layout steps as autograd
functions whose backward is the dual step (the dual rule, DESIGN.md section 3), and the few ops
whose local form differs from the global one.

The program names mesh axes by index; the process groups come from the ``RankMesh`` that the
parallel module activates around each call. Backward runs with the groups saved at forward time.

The program calls every function by its name here, ``autoshard.runtime.<name>``; the code lives in
the modules below, each importing from the others directly, never through this package:

    mesh       RankMesh, the mesh ``active`` around a call (``_mesh``)
    handles    Pending: one scheduled collective's handles, from its start to its wait
    steps      the layout steps (all_gather, reduce_scatter, ...), casts, step_start/step_wait
    linears    linears computed around a collective in flight (linear_dw_later, linear_gathered)
    edges      to_local/to_whole at the program's edges; Arriving outputs
    grads      param_share, gradient all-reduces and their buckets, gather buckets
    reshard    regather: parameters converted again for backward (reshard_after_forward)
    ops        dropout, cross_entropy_mean, batch_norm_train, causal_attention, attention_dropout
    attention  ring_attention: keys and values passed round the ranks, merged by log-sum-exp;
               balanced_attention: causal work even, each rank a head and a tail of the queries
    experts, scans, optim, outputs, agree: expert layers, a cumsum and a sort along a split
               dim, the optimizer's step, outputs kept as DTensors, and the ranks' agreement
               check (imported by name, not re-exported here)
"""
from __future__ import annotations

from autoshard.runtime.attention import balanced_attention, ring_attention
from autoshard.runtime.edges import Arriving, to_local, to_whole
from autoshard.runtime.grads import bucket_start, bucket_wait, grad_bucket, grad_sync, grad_wait, param_share
from autoshard.runtime.handles import Pending, pending
from autoshard.runtime.linears import linear_dw_later, linear_gathered, linear_local_part, weight_later
from autoshard.runtime.mesh import RankMesh, active
from autoshard.runtime.ops import attention_dropout, batch_norm_train, causal_attention, cross_entropy_mean, dropout
from autoshard.runtime.reshard import regather, regather_member, regathering
from autoshard.runtime.steps import (COLLECTIVE_KINDS, DUAL, STEP_FUNCTIONS, all_gather, all_reduce, all_to_all,
                                     cast_all_gather, cast_many, dual_args, dual_sizes, keep_partial, pad_shard,
                                     reduce_scatter, slice_shard, step_start, step_wait)
# private names reached through the package: the active mesh (passes.checkpoint), one raw step
# (machine.measure), the autograd nodes the schedule tests trace. The dim-0 collectives a test
# replaces to count them are replaced in ``steps``, where every module calls them: not here
from autoshard.runtime.grads import _GradBucket, _GradWait  # noqa: F401
from autoshard.runtime.linears import _WeightLater  # noqa: F401
from autoshard.runtime.mesh import _mesh  # noqa: F401
from autoshard.runtime.steps import _launch, _StepStart, _StepWait  # noqa: F401

__all__ = [
    "RankMesh", "active", "Pending", "pending",
    "COLLECTIVE_KINDS", "DUAL", "STEP_FUNCTIONS", "dual_args", "dual_sizes", "all_gather", "reduce_scatter",
    "all_reduce", "all_to_all", "slice_shard", "pad_shard", "keep_partial", "cast_all_gather", "cast_many",
    "step_start", "step_wait",
    "linear_dw_later", "weight_later", "linear_local_part", "linear_gathered",
    "Arriving", "to_local", "to_whole",
    "grad_sync", "param_share", "grad_wait", "grad_bucket", "bucket_start", "bucket_wait",
    "regather", "regather_member", "regathering",
    "dropout", "cross_entropy_mean", "batch_norm_train", "causal_attention", "ring_attention",
    "balanced_attention", "attention_dropout",
]

# torch.fx names a called function by its module (the printed program reads
# ``autoshard_runtime_all_gather(...)``), and users and tests read the program: each public name
# keeps this package as its module, whichever module holds its code
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or callable(_obj):
        _obj.__module__ = __name__
del _name, _obj
