"""How large a bucket of gradients (or of gathered parameters) the schedule makes: the cost model
prices a parameter's share of its bucket's launch and latency by it, and ``passes.schedule``
forms the buckets by it."""
from __future__ import annotations

from autoshard.cost import comm, compute
from autoshard.precision import grad_itemsize

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
    axes = tuple(range(len(mesh_shape)))
    fixed = comm.group_all_reduce_time(0, axes, mesh_shape, cluster)
    per_byte = (comm.group_all_reduce_time(BUCKET_BYTES, axes, mesh_shape, cluster) - fixed) / BUCKET_BYTES
    if per_byte <= 0:
        return BUCKET_BYTES
    want = fixed * (1 - LATENCY_SHARE) / LATENCY_SHARE / per_byte
    return int(min(BUCKET_BYTES, max(MIN_BUCKET_BYTES, want)))


def backward_left(graph, cluster, world: int, training: bool) -> list:
    """Per node of ``graph`` (by its index): the backward compute seconds still to run once
    backward has gone back through it, that is the backward of the ops before it: each op's
    kernel on its whole shapes shared by the ``world`` ranks (whatever the plan, they split the
    work between them), and its own autograd node's launch."""
    left, total = [], 0.0
    for n in graph.nodes:
        left.append(total)
        if not (training and n.kind == "op" and n.requires_grad):
            continue
        metas = [graph.meta(v) for v in n.inputs]
        ins, outs = [tuple(m.shape) for m in metas], [tuple(m.shape) for m in n.outputs]
        itemsize = max([m.itemsize for m in metas + list(n.outputs) if m.floating] or [4])
        overhead = cluster.backward_overhead if cluster.measured else 0.0
        total += (compute.backward_time(n.target, ins, outs, itemsize, cluster) - overhead) / world + overhead
    return left


def first_uses(graph) -> dict:
    """{value name: the index of the first node that reads it}."""
    first: dict = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            first.setdefault(v[0], i)
    return first


def grad_buckets(graph, cap: int) -> list:
    """The gradient buckets the schedule forms (``passes.schedule._bucket_gradients``), every
    trainable parameter taken as all-reduced: filled in the order gradients complete (the reverse
    of first use) up to ``cap`` bytes; [{"members": [(name, bytes), ...], "bytes"}, ...]."""
    first = first_uses(graph)
    params = sorted((n for n in graph.nodes if n.kind == "param" and n.requires_grad and n.name in first),
                    key=lambda n: -first[n.name])
    buckets: list = []
    for n in params:
        size = n.outputs[0].numel * grad_itemsize(graph, n.outputs[0])
        if not buckets or (buckets[-1]["bytes"] and buckets[-1]["bytes"] + size > cap):
            buckets.append({"members": [], "bytes": 0})
        buckets[-1]["members"].append((n.name, size))
        buckets[-1]["bytes"] += size
    return buckets


def covered(buckets: list, first: dict, left: list, seconds) -> dict:
    """{member name: the part of its bucket's backward collective that backward compute can run
    beside}: a bucket's collective starts once backward is back at its earliest-used member
    (``first``: ``first_uses``) and only the compute still to run then (``left``:
    ``backward_left``) can hide it, against its ``seconds(bucket)``; the last bucket, which the
    first layers' gradients close, has none left and waits in full, as DDP's does."""
    out = {}
    for b in buckets:
        t = seconds(b)
        start = min(first[name] for name, _ in b["members"])
        part = min(1.0, left[start] / t) if t > 0 else 1.0
        out.update({name: part for name, _ in b["members"]})
    return out
