"""Compute time of one op on one rank, from the shapes that rank holds.

    time = max(FLOPs / (efficiency * peak), bytes moved / (efficiency * memory bandwidth))

Costing the local shapes charges redundant compute (a broadcast op runs whole on every rank) its
full FLOPs, so replicating everything is never free. Backward of a differentiable op is costed as
twice its forward (two matmuls per matmul), the usual rule of thumb.

A measured cluster (``Cluster.measure``) adds what its machine measured one launch to cost: the
op's in forward, one autograd node's in backward. There a view (an op that aliases its input:
view, transpose, split, ...) costs its launch and nothing else, since it moves no bytes; the
published presets charge every op its tensors' bytes and no launch, as before.
"""
from __future__ import annotations

import math

import torch

from autoshard.cluster import Cluster

aten = torch.ops.aten

BACKWARD_FACTOR = 2.0


def _matmul_flops(ins, out):
    k = ins[0][-1] if ins[0] else 1
    return 2 * math.prod(out) * k


def _addmm_flops(ins, out):
    return 2 * math.prod(out) * ins[1][-1]


def _sdpa_flops(ins, out):
    q, k = ins[0], ins[1]
    return 4 * math.prod(q[:-1]) * k[-2] * q[-1]


def _conv_flops(ins, out):
    # every output element is a dot product over its group's input channels and the kernel:
    # weight (out, in / groups, k...); local shapes, so a channel split is counted as it runs
    return 2 * math.prod(out) * math.prod(ins[1][1:])


def _conv_transpose_flops(ins, out):
    # every input element is scattered into (out / groups) * k outputs: weight (in, out / groups, k...)
    return 2 * math.prod(ins[0]) * math.prod(ins[1][1:])


FLOPS = {
    aten.linear.default: _matmul_flops,
    aten.mm.default: _matmul_flops,
    aten.bmm.default: _matmul_flops,
    aten.matmul.default: _matmul_flops,
    aten.addmm.default: _addmm_flops,
    aten.baddbmm.default: _addmm_flops,
    aten.scaled_dot_product_attention.default: _sdpa_flops,
    **{op: _conv_flops for op in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                                  aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
                                  aten.convolution.default, aten._convolution.default)},
    **{op: _conv_transpose_flops for op in (aten.conv_transpose1d.default, aten.conv_transpose2d.input,
                                            aten.conv_transpose3d.input)},
}


# aliasing in their schema, but they copy when the input's strides do not allow a view
MAY_COPY = {aten.contiguous.default, aten.reshape.default}


def is_view(target) -> bool:
    """Whether the op returns a view of its input: no kernel runs, no byte moves."""
    return bool(getattr(target, "is_view", False)) and target not in MAY_COPY


def work_time(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster) -> float:
    """Seconds of the op's kernel on one rank with these local shapes: the roofline."""
    moved = (sum(math.prod(s) for s in in_shapes) + sum(math.prod(s) for s in out_shapes)) * itemsize
    t_mem = moved / (cluster.efficiency * cluster.memory_bandwidth)
    fn = FLOPS.get(target)
    if fn is None:
        return t_mem
    flops = fn(in_shapes, out_shapes[0] if out_shapes else ())
    return max(flops / (cluster.efficiency * cluster.matmul_flops(itemsize)), t_mem)


def op_time(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster) -> float:
    """Forward seconds of one op on one rank with these local shapes: its kernel and its launch."""
    if cluster.measured and is_view(target):
        return cluster.op_overhead
    return work_time(target, in_shapes, out_shapes, itemsize, cluster) + cluster.op_overhead


def backward_time(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster) -> float:
    """Backward seconds of one differentiable op: twice its kernel's, and one autograd node."""
    if cluster.measured and is_view(target):
        return cluster.backward_overhead
    return BACKWARD_FACTOR * work_time(target, in_shapes, out_shapes, itemsize, cluster) + cluster.backward_overhead
