"""The sends between a pipeline's stages, priced: what crosses a cut travels as each rank's share
in its crossing layout (``inputs.crossing_layout``), rank to rank along the pipeline axis, as
Megatron-LM sends each tensor-parallel rank's share of the activations and each data-parallel
rank its own rows (``planner.pipeline`` adds them to each stage's step)."""
from __future__ import annotations

import math

from autoshard.inputs import crossing_layout
from autoshard.placement import B


def send_seconds(sends, mesh_shape: tuple, cluster) -> float:
    """Seconds of one microbatch's sends across a cut, forward and its gradients back: ``sends``,
    (bytes, floating, shape) of each tensor. Each rank sends its own share of each, in its
    crossing layout on the stage's axes (``inputs.crossing_layout``: ``1/p`` of it where it
    splits over all ``p`` ranks of a stage), to the rank at its place in the next stage: one
    point-to-point transfer per rank on the pipeline axis's link. Converting it to and from the
    stages' planned layouts, on their own axes' links, is in their plans' prices
    (``planner.pipeline.capture_stage``)."""
    inner = tuple(mesh_shape[1:])
    latency, bandwidth, _ = cluster.group_link(mesh_shape, (0,))
    total = 0.0
    for back in (False, True):
        moved = [shared_bytes(b, shape, inner) for b, floating, shape in sends if floating or not back]
        if moved:
            total += latency + sum(moved) / bandwidth
    return total


def shared_bytes(nbytes: int, shape: tuple, inner: tuple) -> float:
    """The bytes of a tensor of ``nbytes`` and ``shape`` one rank sends between stages on axes
    ``inner``: its share in the crossing layout."""
    layout = crossing_layout(shape, inner)
    return nbytes / math.prod(n for n, p in zip(inner, layout) if p != B)
