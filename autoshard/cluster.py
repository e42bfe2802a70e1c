"""The machine a plan is priced for: nodes of GPUs, their links, their compute.

Mesh axes are laid onto ranks innermost last (the last axis has stride 1), and ranks fill nodes in
order. An axis whose groups stay within a node talks over the node's links; one whose groups cross
nodes shares the node's network with the other groups of that node that cross at the same time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str = "custom"
    gpus_per_node: int = 8
    intra_bandwidth: float = 150e9   # bytes/s per GPU within a node (NVLink class)
    intra_latency: float = 5e-6      # seconds per ring step within a node
    inter_bandwidth: float = 200e9   # bytes/s of one node's network, shared by its GPUs
    inter_latency: float = 15e-6     # seconds per ring step across nodes
    collective_overhead: float = 5e-6  # seconds to launch one collective, whatever its size
    peak_flops: float = 312e12       # FLOP/s for 16-bit matmuls
    peak_flops_fp32: float = 156e12  # FLOP/s for fp32 (TF32) matmuls
    memory_bandwidth: float = 2.0e12  # bytes/s of device memory
    memory: float = 80e9             # bytes of device memory
    efficiency: float = 0.6          # fraction of peak a real kernel reaches

    def __post_init__(self):
        for field in ("gpus_per_node",):
            if getattr(self, field) < 1:
                raise ValueError(f"Cluster.{field} must be at least 1, got {getattr(self, field)}")
        for field in ("intra_bandwidth", "inter_bandwidth", "peak_flops", "peak_flops_fp32",
                      "memory_bandwidth", "memory"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Cluster.{field} must be positive, got {getattr(self, field)}")
        for field in ("intra_latency", "inter_latency", "collective_overhead"):
            if getattr(self, field) < 0:
                raise ValueError(f"Cluster.{field} must not be negative, got {getattr(self, field)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Cluster.efficiency is a fraction in (0, 1], got {self.efficiency}")

    @staticmethod
    def preset(name: str) -> "Cluster":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}") from None

    def with_(self, **changes) -> "Cluster":
        return replace(self, **changes)

    def axis_links(self, mesh_shape: Sequence[int]) -> "Links":
        """(latency per ring step, bandwidth, launch overhead) of each mesh axis, axes laid out with
        the last innermost: ``links[a]``; ``links[(a, b)]`` is the group spanning axes a and b."""
        return Links(self, tuple(mesh_shape))

    def group_link(self, mesh_shape: Sequence[int], axes: Sequence[int]) -> tuple[float, float, float]:
        """(latency per ring step, bandwidth, launch overhead) of the groups that span ``axes`` of
        the mesh together (one axis: that axis's groups). A group inside a node talks over the
        node's links; one that crosses nodes gets the node's network shared by every group with
        members in that node, since they all cross at once."""
        gpn = self.gpus_per_node
        strides = [math.prod(mesh_shape[a + 1:]) for a in range(len(mesh_shape))]
        if all(strides[a] * mesh_shape[a] <= gpn for a in axes):
            return (self.intra_latency, self.intra_bandwidth, self.collective_overhead)
        inside = math.prod(min(mesh_shape[a], max(1, gpn // strides[a])) for a in axes)   # one group's members in a node
        sharing = max(1, gpn // inside)
        return (self.inter_latency, self.inter_bandwidth / sharing, self.collective_overhead)

    def matmul_flops(self, itemsize: int) -> float:
        return self.peak_flops_fp32 if itemsize >= 4 else self.peak_flops


class Links(list):
    """The links of a mesh's axes, one entry per axis; indexed by a tuple of axes, the links of
    the groups spanning them together (``Cluster.group_link``)."""

    def __init__(self, cluster: Cluster, mesh_shape: tuple):
        super().__init__(cluster.group_link(mesh_shape, (a,)) for a in range(len(mesh_shape)))
        self._cluster, self._mesh, self._groups = cluster, mesh_shape, {}

    def __getitem__(self, key):
        if not isinstance(key, tuple):
            return super().__getitem__(key)
        if key not in self._groups:
            self._groups[key] = self._cluster.group_link(self._mesh, key)
        return self._groups[key]


PRESETS = {
    # 8 A100-80GB per node, NVLink 3 (~300 GB/s per direction per GPU, ~150 usable for rings),
    # 8x HDR InfiniBand 200 Gb/s per node (~25 GB/s per GPU)
    "a100-80gb-nvlink-ib": Cluster(
        name="a100-80gb-nvlink-ib", gpus_per_node=8, intra_bandwidth=150e9, inter_bandwidth=200e9,
        peak_flops=312e12, peak_flops_fp32=156e12, memory_bandwidth=2.0e12, memory=80e9),
    # 8 H100-80GB per node, NVLink 4, 8x NDR 400 Gb/s per node
    "h100-80gb-nvlink-ib": Cluster(
        name="h100-80gb-nvlink-ib", gpus_per_node=8, intra_bandwidth=300e9, inter_bandwidth=400e9,
        peak_flops=989e12, peak_flops_fp32=494e12, memory_bandwidth=3.35e12, memory=80e9),
    # 4 A100-40GB per node with a Slingshot-class network (4x 25 GB/s NICs), as on Perlmutter
    "a100-40gb-slingshot": Cluster(
        name="a100-40gb-slingshot", gpus_per_node=4, intra_bandwidth=100e9, inter_bandwidth=100e9,
        inter_latency=20e-6, peak_flops=312e12, peak_flops_fp32=156e12, memory_bandwidth=1.55e12,
        memory=40e9),
}

DEFAULT_CLUSTER = "a100-80gb-nvlink-ib"
