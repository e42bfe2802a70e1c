"""The machine a plan is priced for: nodes of GPUs, their links, their compute.

Mesh axes are laid onto ranks innermost last (the last axis has stride 1), and ranks fill nodes in
order. An axis whose groups stay within a node talks over the node's links; one whose groups cross
nodes shares the node's network with the other groups of that node that cross at the same time.

A cluster is either published figures (the presets) or measured on the machine it describes
(``autoshard.measure``, ``autoshard.machine.measure``). A measured one also holds what the presets leave
unpriced: each collective kind's fitted latency and bandwidth per group shape, the fixed time of
one op launch in forward and in backward, and the optimizer step.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

from autoshard.arguments import check_int, check_number

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


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
    # measured (autoshard.measure); the presets leave them empty: launches, measured links and the
    # optimizer step unpriced, every op charged its tensors' bytes
    op_overhead: float = 0.0         # seconds one op costs to launch in the emitted forward program
    backward_overhead: float = 0.0   # seconds one autograd node costs in backward
    launch_hidden: bool = False      # the device runs one op's kernel while the host launches the next
                                     # (a GPU): an op costs the longer of its kernel and its launch, not both
    block_sparse: bool = True        # a block-sparse kernel (FlexAttention's) skips the blocks its mask
                                     # leaves out, as on a GPU; a CPU's computes every score
    collectives: tuple = ()          # ((kind, size, stride, alpha, beta[, points]), ...): t = alpha + ring
                                     # bytes / beta, or through the points ((ring bytes, seconds), ...)
    optimizer: tuple = ()            # AdamW's step: (seconds per step, per parameter tensor, per parameter byte)
    overlap: float = 1.0             # the fraction of a scheduled collective that compute beside it hides
    kernels: tuple = ()              # ((family, forward rate, backward rate), ...) of cost.compute.FAMILY,
                                     # in FLOP/s (matmul, attention) or bytes/s of the forward's work

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"Cluster.name is a string, got {self.name!r}")
        check_int("Cluster.gpus_per_node", self.gpus_per_node, low=1)
        for field in ("intra_bandwidth", "inter_bandwidth", "peak_flops", "peak_flops_fp32",
                      "memory_bandwidth", "memory"):
            check_number(f"Cluster.{field}", getattr(self, field), positive=True)
        for field in ("intra_latency", "inter_latency", "collective_overhead"):
            check_number(f"Cluster.{field}", getattr(self, field), low=0, hint="seconds, not negative")
        check_number("Cluster.efficiency", self.efficiency, positive=True, high=1, hint="a fraction in (0, 1]")
        check_number("Cluster.overlap", self.overlap, low=0, high=1, hint="a fraction in [0, 1]")
        for field in ("op_overhead", "backward_overhead"):
            check_number(f"Cluster.{field}", getattr(self, field), low=0, hint="seconds per launch, not negative")
        # tuples, also when read back from JSON's lists, so a saved cluster loads equal
        rows = tuple(tuple(r[:5]) + (tuple(tuple(pt) for pt in r[5]),) if len(r) == 6 else tuple(r)
                     for r in self.collectives)
        for row in rows:
            if (len(row) not in (5, 6) or row[0] not in COLLECTIVE_KINDS
                    or not all(isinstance(v, int) for v in row[1:3])
                    or row[1] < 2 or row[2] < 1 or not 0 <= row[3] < math.inf or not 0 < row[4] < math.inf
                    or len(row) == 6 and not _points(row[5])):
                raise ValueError(f"Cluster.collectives holds (kind, size, stride, alpha, beta) rows, and "
                                 f"optionally the ((bytes sent, seconds), ...) points they were fitted to: a "
                                 f"kind of {COLLECTIVE_KINDS}, a group of size >= 2 ranks stride >= 1 apart, "
                                 f"latency >= 0 s, bandwidth > 0 bytes/s, points of growing bytes; got {row}")
        if len({r[:3] for r in rows}) != len(rows):
            raise ValueError("Cluster.collectives holds one row per (kind, size, stride)")
        object.__setattr__(self, "collectives", rows)
        opt = tuple(self.optimizer)
        if opt and (len(opt) != 3 or not all(0 <= v < math.inf for v in opt)):
            raise ValueError(f"Cluster.optimizer is (seconds per step, per tensor, per byte), each finite and "
                             f"not negative, or empty; got {self.optimizer}")
        object.__setattr__(self, "optimizer", opt)
        kernels = tuple(tuple(k) for k in self.kernels)
        for row in kernels:
            if (len(row) != 3 or not isinstance(row[0], str)
                    or not all(isinstance(v, (int, float)) and 0 < v < math.inf for v in row[1:])):
                raise ValueError(f"Cluster.kernels holds (family, forward rate, backward rate) rows, each rate "
                                 f"positive and finite; got {row}")
        if len({k[0] for k in kernels}) != len(kernels):
            raise ValueError("Cluster.kernels holds one row per family")
        object.__setattr__(self, "kernels", kernels)

    @staticmethod
    def preset(name: str) -> "Cluster":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}") from None

    def with_(self, **changes) -> "Cluster":
        return replace(self, **changes)

    def save(self, path) -> None:
        """Write the cluster as JSON; ``Cluster.load`` reads back an equal one."""
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @staticmethod
    def load(path) -> "Cluster":
        with open(path) as f:
            return Cluster(**json.load(f))

    def kernel(self, family: str) -> Optional[tuple]:
        """(forward, backward) rate the kernel ``family`` was timed at, or None."""
        return next((k[1:] for k in self.kernels if k[0] == family), None)

    @property
    def measured(self) -> bool:
        """Whether the cluster carries figures measured on its machine (op launches priced)."""
        return self.op_overhead > 0 or bool(self.collectives)

    def axis_links(self, mesh_shape: Sequence[int]) -> "Links":
        """(latency per ring step, bandwidth, launch overhead) of each mesh axis, axes laid out with
        the last innermost: ``links[a]``; ``links[(a, b)]`` is the group spanning axes a and b."""
        return Links(self, tuple(mesh_shape))

    def group_link(self, mesh_shape: Sequence[int], axes: Sequence[int]) -> "Link":
        """(latency per ring step, bandwidth, launch overhead) of the groups that span ``axes`` of
        the mesh together (one axis: that axis's groups). A group inside a node talks over the
        node's links; one that crosses nodes gets the node's network shared by every group with
        members in that node, since they all cross at once. Where the cluster was measured on
        groups of this shape, the link also carries each kind's fitted (alpha, beta)."""
        gpn = self.gpus_per_node
        strides = [math.prod(mesh_shape[a + 1:]) for a in range(len(mesh_shape))]
        fits = self._fits(mesh_shape, axes, strides)
        if all(strides[a] * mesh_shape[a] <= gpn for a in axes):
            return Link(self.intra_latency, self.intra_bandwidth, self.collective_overhead, fits)
        inside = math.prod(min(mesh_shape[a], max(1, gpn // strides[a])) for a in axes)   # one group's members in a node
        sharing = max(1, gpn // inside)
        return Link(self.inter_latency, self.inter_bandwidth / sharing, self.collective_overhead, fits)

    def _fits(self, mesh_shape, axes, strides) -> Optional[dict]:
        """kind -> (alpha, beta[, points]) measured on groups of the shape ``axes`` form: their size, ranks
        the innermost axis's stride apart (exact for one axis or a run of neighbouring axes; for
        others, the measured shape of that size with the nearest stride). None where nothing of
        that size was measured."""
        if not self.collectives:
            return None
        size = math.prod(mesh_shape[a] for a in axes)
        stride = min(strides[a] for a in axes)
        rows = [r for r in self.collectives if r[1] == size]
        if not rows:
            return None
        near = min({r[2] for r in rows}, key=lambda s: (abs(math.log(s / stride)), s))
        return {r[0]: tuple(r[3:]) for r in rows if r[2] == near}

    def matmul_flops(self, itemsize: int) -> float:
        return self.peak_flops_fp32 if itemsize >= 4 else self.peak_flops


def _points(points) -> bool:
    """Whether ``points`` are ((bytes, seconds), ...) pairs, bytes growing, each finite and >= 0."""
    return (len(points) >= 1 and all(len(pt) == 2 and all(isinstance(v, (int, float)) and 0 <= v < math.inf
                                                            for v in pt) for pt in points)
            and all(a[0] < b[0] for a, b in zip(points, points[1:])))


class Link(tuple):
    """(latency per ring step, bandwidth, launch overhead) of a group's link; ``fits``: collective
    kind -> (alpha, beta) measured on groups of its shape, or None (``Cluster.group_link``)."""

    def __new__(cls, latency: float, bandwidth: float, overhead: float, fits: Optional[dict] = None):
        link = super().__new__(cls, (latency, bandwidth, overhead))
        link.fits = fits or {}
        return link


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
    # 8 H100-80GB per node, NVLink 4, 8x NDR 400 Gb/s per node. Measured by autoshard.measure on an
    # H200 (the H100's compute die, more and faster memory; torch 2.11, CUDA 13, 2026-11-27,
    # benchmarks/gpu.py, docs/benchmarks.md "On a GPU"): matmuls at the cost model's timed layer shapes 334
    # TFLOP/s fp32 (TF32) and 707 bf16, 0.68 and 0.72 of the peaks below (square products of
    # 4096-8192: 0.70-0.84 and 0.66-0.74; of 2048: 0.43-0.52 and 0.34-0.43), so ``efficiency``
    # 0.6 is a layer's matmuls of width 1024-2048; streams 4.1-4.2 TB/s (1.25 of the H100's 3.35,
    # 0.87 of the H200's 4.8); launches 17-21 us per op in forward and 24-33 us per autograd
    # node in backward, hidden behind kernels longer than that (``launch_hidden``), and left
    # unpriced here: the models this preset plans run kernels longer than that
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
