"""How large a bucket of gradients (or of gathered parameters) the schedule makes: the cost model
prices a parameter's share of its bucket's launch and latency by it, and ``passes.schedule``
forms the buckets by it."""
from __future__ import annotations

BUCKET_BYTES = 25 * 2**20     # DDP's default bucket: the largest a bucket gets
MIN_BUCKET_BYTES = 2**20      # DDP's first bucket: the smallest
LATENCY_SHARE = 0.05          # a bucket's launch and latency at most this part of its all-reduce


def bucket_bytes_for(cluster, mesh_shape) -> int:
    """The gradient bucket for these links: the smallest whose launch and latency are at most
    ``LATENCY_SHARE`` of its all-reduce over the whole mesh, within DDP's 1 and 25 MiB.

    Every bucket but the last to complete hides behind the backward compute still to run, and
    the last one cannot: smaller buckets start the all-reduces earlier and leave less exposed at
    the end of backward, until their latencies add up. On the NVLink and InfiniBand presets this
    is the 25 MiB cap; on a cluster measured on loopback gloo it came out between 6 and 25 MiB,
    as the measured latency varied with the machine's load."""
    from autoshard.cost import comm
    axes = tuple(range(len(mesh_shape)))
    fixed = comm.group_all_reduce_time(0, axes, mesh_shape, cluster)
    per_byte = (comm.group_all_reduce_time(BUCKET_BYTES, axes, mesh_shape, cluster) - fixed) / BUCKET_BYTES
    if per_byte <= 0:
        return BUCKET_BYTES
    want = fixed * (1 - LATENCY_SHARE) / LATENCY_SHARE / per_byte
    return int(min(BUCKET_BYTES, max(MIN_BUCKET_BYTES, want)))
