"""Measure the machine a plan runs on: ``Cluster.measure``.

Inside an initialized process group every rank takes part (the collectives need them all, and
each rank measures its compute while the others do, so the figures carry the contention a real
step has); rank 0's figures decide and are broadcast, so every rank returns the same Cluster.
What is measured, and what it is fitted to:

    collectives   each kind the plans use (all_gather, reduce_scatter, all_reduce, all_to_all) on
                  every group a mesh axis of this world can form: ``size`` ranks ``stride`` apart
                  (axes are laid out innermost last, so an axis's groups are such), every group
                  of a shape running at once, as one axis's groups do in a step. The seconds of
                  one call at several sizes are fitted by least squares (in relative error) to
                  t = alpha + sent / beta, ``sent`` the bytes a ring sends per rank
                  (``cost.comm.ring_bytes``), so beta is a bus bandwidth comparable across kinds
    matmul        FLOP/s per dtype (fp32, bf16): t = c + flops / rate over three sizes
    memory        bytes/s of the kernels besides matmuls (add, mul, gelu, layer norm, softmax, each
                  allocating its output): t = c + bytes / bandwidth over four sizes
    op launch     seconds one small op costs in an fx program shaped like the emitted one: the
                  Python of the graph module, the dispatcher and autograd's bookkeeping, per op
                  in forward and per autograd node in backward
    optimizer     AdamW's step over DTensor parameters, held as ``parallelize`` holds them:
                  t = fixed + per tensor * tensors + per byte * bytes, fitted over four sets

Outside a process group only this process's compute can be measured: the links stay those of
``base`` (a warning says so). Measurement takes a second or two on a CPU at world 2-4.
"""
from __future__ import annotations

import math
import os
import socket
import statistics
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from autoshard.cluster import COLLECTIVE_KINDS, Cluster
from autoshard.cost.comm import ring_bytes

aten = torch.ops.aten

COLLECTIVE_BYTES = (1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 22)   # per rank: a norm's statistics to a layer's activations
MATMUL_SIZES = (256, 512, 768)
ELEMENTWISE_BYTES = (1 << 18, 1 << 20, 1 << 22)                   # activations of small models, in cache or not
LAUNCH_OPS = 120                                                   # ops in the launch-timing program


def measure(base=None, *, name: Optional[str] = None) -> Cluster:
    """The Cluster this machine is: see the module docstring. ``base`` (a Cluster or a preset
    name; default the default preset) gives what cannot be measured here: the links outside a
    process group."""
    from autoshard.api import resolve_cluster
    base = resolve_cluster(base)
    grouped = dist.is_available() and dist.is_initialized()
    device = _device()
    if grouped:
        dist.barrier()
    figures = _compute(device)
    if grouped and dist.get_world_size() > 1:
        figures.update(_links(device))
    if grouped:
        box = [figures if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        figures = box[0]
    else:
        warnings.warn("Cluster.measure outside a process group measures this process's compute only; "
                      f"the links are {base.name}'s. Measure inside the group the plan will run on "
                      "(torch.distributed.init_process_group) to measure them too.", stacklevel=3)
    world = dist.get_world_size() if grouped else 1
    backend = dist.get_backend() if grouped else device.type
    links = figures.pop("links", {})
    overall = links.get((COLLECTIVE_KINDS[0], world, 1))   # the whole world's all-gather
    changes = dict(
        name=name or f"measured: {backend}, {world} rank{'s' if world > 1 else ''} on {socket.gethostname()}",
        efficiency=1.0, memory=figures.pop("memory"),
        collectives=tuple(sorted((k, p, s, a, b) for (k, p, s), (a, b) in links.items())),
        **figures)
    changes["collective_overhead"] = changes["op_overhead"]   # the runtime's Python around each call
    if grouped:
        changes["gpus_per_node"] = figures_per_node = _ranks_per_host()
        if overall is not None and figures_per_node >= world:
            # groups the table does not hold (other worlds, axes that are not a stride run) get
            # the whole world's all-gather figures: one host, one kind of link
            alpha, beta = overall
            changes.update(intra_latency=alpha / (world - 1), intra_bandwidth=beta,
                           inter_latency=alpha / (world - 1), inter_bandwidth=beta * world)
    return base.with_(**changes)


# ---- timing -------------------------------------------------------------------------------------

def _device() -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, calls: int = 1, repeats: int = 5, barrier=None) -> float:
    """Median seconds of one call of ``fn``, timing ``calls`` back to back ``repeats`` times after
    one warm-up; ``barrier()`` (a group's) lines the ranks up before each timing."""
    fn()
    out = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def fit_line(xs, ts) -> tuple:
    """(intercept, slope) of t = a + b x by least squares in relative error (weights 1/t^2), so
    small sizes decide the intercept and large ones the slope; a negative intercept is refitted
    through the origin, and the slope is kept positive."""
    w = [1.0 / max(t, 1e-12) ** 2 for t in ts]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    det = sw * sxx - sx * sx
    a, b = ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det) if det > 0 else (0.0, 0.0)
    if a < 0 or b <= 0:
        a = max(a, 0.0) if b > 0 else 0.0
        b = sum(wi * x * (t - a) for wi, x, t in zip(w, xs, ts)) / sxx
    if b <= 0:   # time did not grow with size (noise): the largest point's rate
        b = max(ts[-1] - a, 1e-12) / xs[-1]
    return a, b


# ---- compute ------------------------------------------------------------------------------------

def _compute(device) -> dict:
    out = {}
    for field, dtype in (("peak_flops_fp32", torch.float32), ("peak_flops", torch.bfloat16)):
        xs, ts = [], []
        for n in MATMUL_SIZES:
            a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
            xs.append(2.0 * n ** 3)
            ts.append(_timed(lambda: torch.mm(a, b), device, calls=2, repeats=3))
        out[field] = 1.0 / fit_line(xs, ts)[1]
    xs, ts = [], []
    for nbytes in ELEMENTWISE_BYTES:
        a, b = (torch.randn(nbytes // 1024, 256, device=device) for _ in range(2))
        moved = 0
        for fn, tensors in _ELEMENTWISE:
            moved += tensors * nbytes
        xs.append(float(moved))
        ts.append(_timed(lambda: [fn(a, b) for fn, _ in _ELEMENTWISE], device, calls=2, repeats=3))
    out["memory_bandwidth"] = 1.0 / fit_line(xs, ts)[1]
    out["op_overhead"], out["backward_overhead"] = _launch(device)
    out["optimizer"] = _optimizer(device)
    out["memory"] = _device_memory(device)
    return out


# the kernels besides matmuls that take a model's time, each allocating its output as the
# program's ops do: (op, tensors it reads and writes). Their rates differ several-fold on a CPU
# (an add streams, a gelu or a norm computes), so the figure is the mix's bytes per second
_ELEMENTWISE = ((lambda a, b: a + b, 3), (lambda a, b: a * b, 3),
                (lambda a, b: torch.nn.functional.gelu(a), 2),
                (lambda a, b: torch.nn.functional.layer_norm(a, a.shape[-1:]), 2),
                (lambda a, b: torch.softmax(a, -1), 2))


def _launch(device) -> tuple:
    """(forward seconds per op, backward seconds per autograd node) of a program of small ops
    as the rewriter emits them: aten overloads called from an fx GraphModule, with autograd on."""
    g = fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    y = x
    ops = [(aten.view.default, lambda y: (y, [8, 8])), (aten.linear.default, lambda y: (y, w, b)),
           (aten.transpose.int, lambda y: (y, 0, 1)), (aten.add.Tensor, lambda y: (y, w)),
           (aten.layer_norm.default, lambda y: (y, [8])), (aten.gelu.default, lambda y: (y,))]
    for i in range(LAUNCH_OPS):
        op, args = ops[i % len(ops)]
        y = g.call_function(op, args(y))
    g.output(g.call_function(aten.sum.default, (y,)))
    program = fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(*s, device=device, requires_grad=True) for s in ((8, 8), (8, 8), (8,))]
    fwd, bwd = [], []
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        loss = program(*args)
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    n = LAUNCH_OPS + 1
    return statistics.median(fwd[1:]) / n, statistics.median(bwd[1:]) / n


def _optimizer(device) -> tuple:
    """(seconds per step, per parameter tensor, per parameter byte) of AdamW over DTensor
    parameters on the world's mesh, as ``parallelize`` holds them (plain tensors outside a
    process group), fitted over sets of different counts and sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    grouped = dist.is_available() and dist.is_initialized()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if grouped else None
    rows, ts = [], []
    for count, numel in ((4, 1 << 12), (24, 1 << 12), (4, 1 << 18), (12, 1 << 17)):
        params = []
        for _ in range(count):
            t = torch.randn(numel, device=device)
            p = torch.nn.Parameter(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if grouped else t)
            p.grad = torch.randn_like(p)
            params.append(p)
        _adopt(params)
        opt = torch.optim.AdamW(params, lr=1e-3)
        rows.append((count, 4.0 * count * numel))
        ts.append(_timed(opt.step, device, calls=1, repeats=3))
    return _fit_optimizer(rows, ts)


def _adopt(params) -> None:
    """Hand the parameters to autoshard's optimizer switch, as ``parallelize`` does, where it has one."""
    try:
        from autoshard import optim
    except ImportError:
        return
    optim.adopt(params)


def _fit_optimizer(rows, ts) -> tuple:
    """Least squares of t = fixed + per_tensor * count + per_byte * bytes (relative error)."""
    X = torch.tensor([[1.0, c, b] for c, b in rows], dtype=torch.float64)
    t = torch.tensor(ts, dtype=torch.float64)
    w = 1.0 / t
    coef = torch.linalg.lstsq(X * w[:, None], t * w).solution.tolist()
    fixed, per_tensor, per_byte = (max(c, 0.0) for c in coef)
    if per_byte == 0.0:
        per_byte = ts[2] / rows[2][1]
    return (fixed, per_tensor, per_byte)


def _device_memory(device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / _ranks_per_host() if dist.is_available() and dist.is_initialized() else float(total)


def _ranks_per_host() -> int:
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.count(hosts[0])


# ---- links --------------------------------------------------------------------------------------

def group_shapes(world: int) -> dict:
    """(size, stride) -> the rank lists of every group an axis of a mesh of ``world`` can form:
    ``size`` ranks ``stride`` apart, within blocks of ``size * stride`` consecutive ranks."""
    out = {}
    for stride in range(1, world + 1):
        if world % stride:
            continue
        for size in range(2, world // stride + 1):
            if (world // stride) % size:
                continue
            block = size * stride
            out[(size, stride)] = [[start + off + stride * i for i in range(size)]
                                   for start in range(0, world, block) for off in range(stride)]
    return out


def _links(device) -> dict:
    """{"links": {(kind, size, stride): (alpha, beta)}} for every group shape of this world."""
    from autoshard.runtime import _all_gather, _reduce_scatter
    world = dist.get_world_size()
    table = {}
    for (size, stride), lists in group_shapes(world).items():
        if size == world:
            group = dist.group.WORLD
        else:
            group, _ = dist.new_subgroups_by_enumeration(lists)
        barrier = lambda: dist.barrier(group=group)   # noqa: E731
        for kind in COLLECTIVE_KINDS:
            xs, ts = [], []
            for nbytes in COLLECTIVE_BYTES:
                n = max(size, nbytes // 4 // size * size)   # divisible into the group's blocks
                x = torch.randn(n, device=device)
                big = torch.empty(n * size, device=device)
                small = torch.empty(n // size, device=device)
                y = torch.empty_like(x)
                call = {"all_gather": lambda: _all_gather(big, x, group=group),
                        "reduce_scatter": lambda: _reduce_scatter(small, x, group=group),
                        "all_reduce": lambda: dist.all_reduce(y, group=group),
                        "all_to_all": lambda: dist.all_to_all_single(y, x, group=group)}[kind]
                xs.append(ring_bytes(kind, 4.0 * n, size))
                ts.append(_timed(call, device, calls=2, repeats=3, barrier=barrier))
            alpha, slope = fit_line(xs, ts)
            table[(kind, size, stride)] = (alpha, 1.0 / slope)
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    return {"links": table}
