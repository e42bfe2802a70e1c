"""Compute time of one op on one rank, from the shapes that rank holds.

    time = max(FLOPs / (efficiency * peak), bytes moved / (efficiency * memory bandwidth))

Costing the local shapes charges redundant compute (a broadcast op runs whole on every rank) its
full FLOPs, so replicating everything is never free. Backward of a differentiable op is costed as
twice its forward (two matmuls per matmul), the usual rule of thumb.

A measured cluster (``autoshard.measure``) adds what its machine measured one launch to cost: the
op's in forward, one autograd node's in backward. There a view (an op that aliases its input:
view, transpose, split, ...) costs its launch and nothing else, since it moves no bytes, and the
ops of a kernel family it timed (``FAMILY``: matmul, attention, gelu, norm, softmax,
cross-entropy) run at that family's measured forward and backward rates. The published presets
charge every op its tensors' bytes and no launch, as before.
"""
from __future__ import annotations

import math

import torch

from autoshard.machine.cluster import Cluster
from autoshard.rules.flex import FLEX
from autoshard.rules.moe import SORTS
from autoshard.rules.registry import qualified_name

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


def _grouped_mm_flops(ins, out):
    # each row by its own expert's (k, n) weight: rows as priced (rules.moe.computed_shapes)
    return 2 * ins[0][0] * ins[0][-1] * out[-1]


FLOPS = {
    aten._grouped_mm.default: _grouped_mm_flops,
    aten.linear.default: _matmul_flops,
    aten.mm.default: _matmul_flops,
    aten.bmm.default: _matmul_flops,
    aten.matmul.default: _matmul_flops,
    aten.addmm.default: _addmm_flops,
    aten.baddbmm.default: _addmm_flops,
    aten.scaled_dot_product_attention.default: _sdpa_flops,
    # counted dense here; a cluster whose kernel skips the blocks a mask leaves out
    # (``Cluster.block_sparse``, a GPU's) is charged the share kept (``rules.flex.density``)
    FLEX: _sdpa_flops,
    **{op: _conv_flops for op in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                                  aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
                                  aten.convolution.default, aten._convolution.default)},
    **{op: _conv_transpose_flops for op in (aten.conv_transpose1d.default, aten.conv_transpose2d.input,
                                            aten.conv_transpose3d.input)},
}


# aliasing in their schema, but they copy when the input's strides do not allow a view
MAY_COPY = {aten.contiguous.default, aten.reshape.default}

# kernels a measured cluster times on its own machine (``Cluster.kernels``), by family: their
# rates differ several-fold on a CPU (a gelu or a softmax computes an exp per element, an add
# streams), and their backward is not always twice their forward. A family's work is counted as
# the roofline counts it: FLOPs for matmul and attention, the bytes of its tensors for the others
FAMILY = {
    **{op: "matmul" for op in (aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default,
                               aten.bmm.default, aten.baddbmm.default)},
    aten.scaled_dot_product_attention.default: "attention", FLEX: "attention",
    aten.gelu.default: "gelu", aten.silu.default: "gelu",
    aten.layer_norm.default: "norm", aten.rms_norm.default: "norm",
    aten.softmax.int: "softmax", aten._softmax.default: "softmax",
    aten.log_softmax.int: "softmax", aten._log_softmax.default: "softmax",
    aten.cross_entropy_loss.default: "cross_entropy",
}
FLOP_FAMILIES = ("matmul", "attention")


def is_view(target) -> bool:
    """Whether the op returns a view of its input: no kernel runs, no byte moves."""
    return bool(getattr(target, "is_view", False)) and target not in MAY_COPY


# ops a library registers once imported, by qualified name (rules.registry.RULES_BY_NAME)
FLOPS_BY_NAME = {"transformers::grouped_mm_fallback": _grouped_mm_flops}


def work(target, in_shapes, out_shapes, itemsize: int, share: float = 1.0) -> tuple:
    """(FLOPs, or None for an op without a FLOP count; bytes its tensors hold) on one rank, a
    sort's once per pass; ``share`` of the FLOPs where a block-sparse kernel skips the rest
    (``rules.flex.density``)."""
    moved = (sum(math.prod(s) for s in in_shapes) + sum(math.prod(s) for s in out_shapes)) * itemsize
    if target in SORTS and in_shapes and in_shapes[0]:
        # once per pass, about log2 of the sorted length passes (a merge sort's levels; a radix
        # sort's digit passes over 64-bit keys are as many at the lengths routing sorts)
        moved *= max(1, math.ceil(math.log2(max(max(in_shapes[0]), 1))))
    fn = FLOPS.get(target) or FLOPS_BY_NAME.get(qualified_name(target))
    return (share * fn(in_shapes, out_shapes[0] if out_shapes else ()) if fn else None), moved


def work_time(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster, share: float = 1.0) -> float:
    """Seconds of the op's kernel on one rank with these local shapes: the roofline."""
    flops, moved = work(target, in_shapes, out_shapes, itemsize, share)
    t_mem = moved / (cluster.efficiency * cluster.memory_bandwidth)
    if flops is None:
        return t_mem
    return max(flops / (cluster.efficiency * cluster.matmul_flops(itemsize)), t_mem)


def timed_kernel(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster, share: float = 1.0):
    """(forward, backward) seconds of the op's kernels at the rates its family was timed at on
    the cluster's machine (fp32, as they were timed), or None where it was not."""
    family = FAMILY.get(target)
    rates = cluster.kernel(family) if family and itemsize == 4 else None
    if rates is None:
        return None
    flops, moved = work(target, in_shapes, out_shapes, itemsize, share)
    units = flops if family in FLOP_FAMILIES else moved
    return units / rates[0], units / rates[1]


def op_time(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster, share: float = 1.0) -> float:
    """Forward seconds of one op on one rank with these local shapes: its kernel and its launch
    (``share``: as ``work``)."""
    if cluster.measured and is_view(target):
        return cluster.op_overhead
    timed = timed_kernel(target, in_shapes, out_shapes, itemsize, cluster, share)
    kernel = timed[0] if timed else work_time(target, in_shapes, out_shapes, itemsize, cluster, share)
    return launched(kernel, cluster.op_overhead, cluster)


def backward_time(target, in_shapes, out_shapes, itemsize: int, cluster: Cluster, share: float = 1.0) -> float:
    """Backward seconds of one differentiable op: twice its kernel's (or as its family was timed),
    and one autograd node."""
    if cluster.measured and is_view(target):
        return cluster.backward_overhead
    timed = timed_kernel(target, in_shapes, out_shapes, itemsize, cluster, share)
    kernel = timed[1] if timed else BACKWARD_FACTOR * work_time(target, in_shapes, out_shapes, itemsize, cluster, share)
    return launched(kernel, cluster.backward_overhead, cluster)


def launched(kernel: float, launch: float, cluster: Cluster) -> float:
    """Seconds of an op whose kernel takes ``kernel`` and whose launch ``launch``: on a CPU one
    after the other; on a device that runs kernels while the host goes on (``launch_hidden``),
    the longer of the two, the host running ahead of a long kernel and the device waiting on
    a short one's launch."""
    return max(kernel, launch) if cluster.launch_hidden else kernel + launch
