"""Measure the machine a plan runs on: ``autoshard.measure``.

Inside an initialized process group every rank takes part: the collectives need them all, and
each rank times its compute while the others do, so the figures carry the contention a real step
has. Every rank returns the same Cluster: each figure the median of the ranks' (``_agreed``). What is measured, and what it is fitted to:

    collectives   each kind the plans use (all_gather, reduce_scatter, all_reduce, all_to_all) on
                  every group a mesh axis of this world can form: ``size`` ranks ``stride`` apart
                  (axes are laid out innermost last, so an axis's groups are such), every group
                  of a shape running at once, as one axis's groups do in a step, each call as
                  the emitted program makes it (with its copies). The seconds of one call at
                  several sizes are fitted by least squares (in relative error) to
                  t = alpha + sent / beta, ``sent`` the bytes a ring sends per rank
                  (``cost.comm.ring_bytes``), so beta is a bus bandwidth comparable across kinds;
                  the timed points are kept too, and price a collective between them
                  (``cost.comm.fitted_time``); the all-reduce also at a full gradient bucket,
                  in place as the bucket runs it
    kernels       forward and backward rates of each kernel family of ``cost.compute.FAMILY``, in
                  the cost model's own count of the forward's work (FLOPs of linear layers of
                  several shapes and of causal attention; bytes of gelu, layer norm, softmax and
                  cross-entropy over a vocabulary), fp32; the matmul rate is also the fp32 peak
    matmul bf16   FLOP/s of the same linear layers in bf16 (forward)
    memory        bytes/s of streaming elementwise ops (add, mul, each allocating its output)
    op launch     seconds one small op costs in an fx program shaped like the emitted one: the
                  Python of the graph module, the dispatcher and autograd's bookkeeping, per op
                  in forward and per autograd node in backward; on a GPU, whose kernels run
                  while the host launches the next (``Cluster.launch_hidden``), an op is priced
                  the longer of its kernel and its launch, on a CPU their sum
    optimizer     AdamW's step over DTensor parameters, held as ``parallelize`` holds them:
                  t = fixed + per tensor * tensors + per byte * bytes, solved over three sets
                  (few small tensors, many small ones, few large ones out of cache)
    overlap       how much of an all-reduce started before a run of matmuls as long as it, and
                  waited for after them, the matmuls hide: (alone + alone - together) / alone,
                  within [0, 1], the median of several trials on each rank and of the ranks'.
                  On a CPU the collective's copies and the compute share the cores

Each figure is a mean over a window of calls, not the best of short bursts: on a machine whose
cores are shared, a burst often runs unhindered while a training step gets only its share.
Outside a process group only this process's compute can be measured: the links stay those of
``base`` (a warning says so). Measurement takes seconds: on 2 quiet CPU cores 2.0-2.1 s at world
2 and 5.1-5.6 s at world 4 (2026-11-28, the overlap's trials 0.8 and 2-3 s of it), 3-5 s and
8-11 s under a load of 4-6; the first measurement in a process a second or two more, the first
DTensor optimizer step's one-time set-up (importing torch._dynamo), which ``parallelize`` pays anyway.
"""
from __future__ import annotations

import hashlib
import math
import os
import pathlib
import socket
import statistics
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from autoshard.cache import directory
from autoshard.machine.cluster import COLLECTIVE_KINDS, DEFAULT_CLUSTER, Cluster
from autoshard.cost.buckets import BUCKET_BYTES
from autoshard.cost.comm import ring_bytes
from autoshard.cost.compute import FLOP_FAMILIES, work

aten = torch.ops.aten

# bytes per rank: a norm's statistics to a layer's activations and a gather bucket's share
COLLECTIVE_BYTES = (1 << 12, 1 << 18, 1 << 20, 1 << 22, 1 << 23)
TOKENS = 1024                 # rows of the timed kernels: a small model's batch on one rank
LINEARS = ((256, 1024), (1024, 256), (256, 2048))   # (in, out) features of the timed matmuls
STREAM_BYTES = 1 << 22        # tensors of the streaming ops: a layer's activations
LAUNCH_OPS = 120              # ops in the launch-timing program
WINDOW = 0.03                 # seconds of calls per timed point: several scheduler slices (CFS: ~3 ms)
COLLECTIVE_CALLS = 4          # calls per timed collective point, after one warm-up
LARGE_CALLS = 2               # at 4 MB or more: a call takes tens of ms, two already span several slices
COLLECTIVE_ROWS = 8           # rows of a timed collective's (rows, columns) tensor, exchanged on columns
OVERLAP_TRIALS = 5            # trials of the overlap, of which the median is kept
# calls of each of the three timings of an overlap trial: with two, gloo's all-reduce beside
# matmuls at world 2 on 2 cores gave trials from -0.03 to 0.78 (medians 0.14-0.56 from one
# measurement to the next, and a plan that chunked Megatron's batch on 0.56 ran 34% slower
# than priced); with eight, -0.2 to 0.2, medians 0.05-0.06
OVERLAP_CALLS = 8
OVERLAP_BYTES = 1 << 22       # the all-reduce the overlap is timed with: a layer's activations
# AdamW's parameter sets (tensors, elements each): few small, many small, few large (16 MB: with
# their gradients and moments out of a CPU's cache, as a model's are)
OPTIMIZER_SETS = ((8, 1 << 12), (32, 1 << 12), (8, 1 << 19))
# A GPU runs the CPU's shapes in microseconds, where its launches, not its kernels, set the
# time (an H200 measured 8.8 TFLOP/s on them and priced a 17 ms step at 536 ms). There the
# matmuls' rows and features are made this much larger (features 4 times larger ran at 253
# TFLOP/s, and a GPT of width 2048 then ran its forward 1.5 times faster than priced), and the
# memory-bound ops' rows, the streams and the large optimizer set its square, so that each
# kernel runs for tenths of a millisecond (a layer norm over 16 MB still ran at 0.64 TB/s on an
# H200 whose streams ran at 4.2: its launch and the synchronisation set the time)
GPU_SCALE = 8


def _shapes(device) -> dict:
    """The timed shapes for ``device``: the constants above on a CPU, scaled on a GPU."""
    if device.type == "cpu":
        return dict(tokens=TOKENS, rows=TOKENS, linears=LINEARS, attention=(4, 4, 128, 64), stream=STREAM_BYTES,
                    optimizer=OPTIMIZER_SETS)
    return dict(tokens=TOKENS * GPU_SCALE, rows=TOKENS * GPU_SCALE ** 2,
                linears=tuple((GPU_SCALE * k, GPU_SCALE * n) for k, n in LINEARS),
                attention=(8, 16, 1024, 64), stream=STREAM_BYTES * GPU_SCALE ** 2,
                optimizer=OPTIMIZER_SETS[:2] + ((OPTIMIZER_SETS[2][0], OPTIMIZER_SETS[2][1] * GPU_SCALE ** 2),))


MEASURE = "measure"


def resolve_cluster(cluster) -> Cluster:
    """A Cluster from a Cluster, a preset name, None (the default preset) or ``"measure"``: this
    machine, measured now (``measure``). Inside a process group measuring is collective,
    so every rank must plan with ``"measure"`` together (``parallelize`` measures once, on every
    rank, and rank 0 plans with its figures); outside one it measures this process's compute and
    keeps the default preset's links, with a warning."""
    if cluster is None:
        return Cluster.preset(DEFAULT_CLUSTER)
    if cluster == MEASURE:
        return kept_measure()
    if isinstance(cluster, str):
        return Cluster.preset(cluster)
    if isinstance(cluster, Cluster):
        return cluster
    raise TypeError(f"cluster is a Cluster, a preset name or {MEASURE!r}, got {type(cluster).__name__}")


def kept_measure() -> Cluster:
    """``cluster="measure"``: this machine measured once and kept on disk, beside the plans
    (``autoshard.cache``), so that a restart or a resume neither measures again nor, its figures
    being the same, misses its kept plan. Kept per machine: its host, device, cores and threads,
    the group's size, backend and ranks per host, torch's version and this module's source (a
    changed measurement measures again). In a process group rank 0 reads and every rank takes
    what it read, or all measure together. ``autoshard.measure()`` always measures afresh; delete
    the file (its path is in the figures' ``name``) to measure again, or turn the cache off
    (``AUTOSHARD_PLAN_CACHE=off``)."""

    root = directory()
    if root is None:
        return measure()
    grouped = dist.is_available() and dist.is_initialized()
    path = root / "clusters" / f"{_machine_key(grouped)}.json"
    found = None
    if not grouped or dist.get_rank() == 0:
        try:
            found = Cluster.load(path)
        except (OSError, ValueError, TypeError):   # none kept yet, or unreadable: measure
            found = None
    if grouped:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    if found is not None:
        return found
    cluster = measure()
    cluster = cluster.with_(name=f"{cluster.name}, kept in {path}")
    if not grouped or dist.get_rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            cluster.save(tmp)
            os.replace(tmp, path)   # whole or not at all: another process may read meanwhile
        except OSError:   # a read-only cache: measured, not kept
            pass
    return cluster


def _machine_key(grouped: bool) -> str:
    """What the kept figures hold for: see ``kept_measure``."""
    device = _device()
    parts = [socket.gethostname(), device.type, os.cpu_count(), torch.get_num_threads(), torch.__version__,
             pathlib.Path(__file__).read_bytes()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    if grouped:
        parts += [dist.get_world_size(), dist.get_backend(), _ranks_per_host()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def measure(base=None, *, name: Optional[str] = None, repeats: int = 1) -> Cluster:
    """The Cluster this machine is: see the module docstring. ``base`` (a Cluster or a preset
    name; default the default preset) gives what cannot be measured here: the links outside a
    process group. ``repeats`` > 1 measures that many times and keeps each figure's median, for
    a machine whose load comes and goes."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats is a number of measurements, at least 1; got {repeats!r}")
    base = resolve_cluster(base)
    grouped = dist.is_available() and dist.is_initialized()
    device = _device()
    runs = []
    for _ in range(repeats):
        if grouped:
            dist.barrier()
        figures = _compute(device)
        if grouped and dist.get_world_size() > 1:
            figures.update(_links(device))
        if grouped:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, figures)
            figures = _agreed(every)
        runs.append(figures)
    figures = _median(runs)
    if not grouped:
        warnings.warn("autoshard.measure outside a process group measures this process's compute only; "
                      f"the links are {base.name}'s. Measure inside the group the plan will run on "
                      "(torch.distributed.init_process_group) to measure them too.", stacklevel=3)
    world = dist.get_world_size() if grouped else 1
    backend = dist.get_backend() if grouped else device.type
    links = figures.pop("links", {})
    overall = links.get((COLLECTIVE_KINDS[0], world, 1))   # the whole world's all-gather
    changes = dict(
        name=name or f"measured: {backend}, {world} rank{'s' if world > 1 else ''} on {socket.gethostname()}",
        efficiency=1.0, memory=figures.pop("memory"),
        collectives=tuple(sorted((k, p, s) + fit for (k, p, s), fit in links.items())),
        **figures)
    changes["collective_overhead"] = changes["op_overhead"]   # the runtime's Python around each call
    changes["launch_hidden"] = device.type != "cpu"   # a GPU's kernels run while the host launches on
    changes["block_sparse"] = device.type != "cpu"    # and skip the blocks a mask leaves out
    if grouped:
        changes["gpus_per_node"] = figures_per_node = _ranks_per_host()
        if overall is not None and figures_per_node >= world:
            # groups the table does not hold (other worlds, axes that are not a stride run) get
            # the whole world's all-gather figures: one host, one kind of link
            alpha, beta = overall[:2]
            changes.update(intra_latency=alpha / (world - 1), intra_bandwidth=beta,
                           inter_latency=alpha / (world - 1), inter_bandwidth=beta * world)
    return base.with_(**changes)


def _median(runs: list) -> dict:
    """Each figure's median over several measurements (of one group: the same keys and rows)."""
    if len(runs) == 1:
        return runs[0]

    def med(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: med([v[k] for v in values]) for k in first}
        if isinstance(first, (tuple, list)):
            return tuple(med(list(v)) for v in zip(*values))
        if all(v == first for v in values):   # names, group shapes, and what did not vary
            return first
        return statistics.median(values)
    return med(runs)


def median(clusters) -> Cluster:
    """Each measured figure's median over ``clusters``, measured on one group (taken in turn with
    other work, say, on a machine whose load comes and goes)."""
    from dataclasses import asdict
    figures = _median([asdict(c) for c in clusters])
    return Cluster(**dict(figures, name=f"{clusters[0].name}, median of {len(clusters)}"))


def _agreed(every: list) -> dict:
    """One set of figures from every rank's: each figure's median over the ranks, the device
    memory their least. The ranks of one machine are alike, and what sets one apart in a
    measurement is the load of the moment: on 2 shared cores at world 4 one rank's window of
    layer norms ran at 0.05 GB/s while the others' ran at 2-20, and the slowest rank's figure,
    taken figure by figure, priced every step about twice what it ran."""
    out = _median(every)
    out["memory"] = min(f["memory"] for f in every)
    return out


# ---- timing -------------------------------------------------------------------------------------

def _device() -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, window: float = WINDOW) -> float:
    """Mean seconds of one call of ``fn`` over at least ``window`` seconds of calls (two at
    least), after one warm-up. A mean over a window, not the best of short bursts: on a machine
    whose cores are shared, a short burst often runs unhindered while a training step gets only
    its share of the cores, and the figures are to predict steps."""
    fn()
    _sync(device)
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls >= 2:
            _sync(device)
            if time.perf_counter() - t0 >= window:
                return (time.perf_counter() - t0) / calls


def _timed_phases(forward, backward, device, window: float = 2 * WINDOW) -> tuple:
    """Mean seconds of ``forward()`` and of ``backward(its result)``, timed apart within the same
    calls over at least ``window`` seconds (two calls at least) after one warm-up, so that both
    see the same load."""
    backward(forward())
    fwd = bwd = 0.0
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < window:
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        backward(out)
        _sync(device)
        fwd += t1 - t0
        bwd += time.perf_counter() - t1
        calls += 1
    return fwd / calls, bwd / calls


def _timed_together(fn, device, calls: int, barrier) -> float:
    """Mean seconds of one call of a collective ``fn``: every rank of its group makes the same
    number of calls (a window each rank closed by itself would leave one waiting), lined up by
    ``barrier`` after one warm-up."""
    fn()
    barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / calls


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
    kernels = _kernels(device)
    matmul = next(k for k in kernels if k[0] == "matmul")
    shapes = _shapes(device)
    tokens, (k, n), streamed = shapes["tokens"], shapes["linears"][0], shapes["stream"]
    x, w, b = (torch.randn(*shape, device=device, dtype=torch.bfloat16) for shape in ((tokens, k), (n, k), (n,)))
    bf16 = 2.0 * tokens * k * n / _timed(lambda: aten.linear.default(x, w, b), device)
    a, c = (torch.randn(streamed // 4, device=device) for _ in range(2))
    stream = 6.0 * streamed / _timed(lambda: (a + c, a * c), device)   # each reads two, writes one
    fwd, bwd = _launch(device)
    return {"kernels": kernels, "peak_flops_fp32": matmul[1], "peak_flops": bf16, "memory_bandwidth": stream,
            "op_overhead": fwd, "backward_overhead": bwd, "optimizer": _optimizer(device),
            "memory": _device_memory(device)}


def _kernels(device) -> tuple:
    """((family, forward rate, backward rate), ...) of each family of ``cost.compute.FAMILY``:
    the work of every timed call as the cost model counts it (``cost.compute.work``), over the
    seconds its forward, and then its backward, took."""
    rand = lambda *shape: torch.randn(*shape, device=device, requires_grad=True)   # noqa: E731
    shapes = _shapes(device)
    tokens, rows, heads = shapes["tokens"], shapes["rows"], shapes["attention"]
    cases = {
        "matmul": [(aten.linear.default, (rand(tokens, k), rand(n, k), rand(n)), {}) for k, n in shapes["linears"]],
        "attention": [(aten.scaled_dot_product_attention.default, (rand(*heads), rand(*heads), rand(*heads)),
                       {"is_causal": True})],
        "gelu": [(aten.gelu.default, (rand(rows, 1024),), {})],
        "norm": [(aten.layer_norm.default, (rand(rows, 512), [512], rand(512), rand(512)), {})],
        "softmax": [(aten._log_softmax.default, (rand(rows // 2, 2048), -1, False), {})],
        "cross_entropy": [(aten.cross_entropy_loss.default,
                           (rand(rows // 2, 4096), torch.randint(0, 4096, (rows // 2,), device=device)), {})],
    }
    out = []
    for family, calls in cases.items():
        units = fwd = bwd = 0.0
        for op, args, kwargs in calls:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            leaves = [a for a in tensors if a.requires_grad]
            y = op(*args, **kwargs)
            flops, moved = work(op, [tuple(a.shape) for a in tensors], [tuple(y.shape)], 4)
            grad = torch.randn_like(y)

            def forward():
                for a in leaves:
                    a.grad = None   # as after zero_grad: the first gradient is taken, not added
                return op(*args, **kwargs)

            t_fwd, t_bwd = _timed_phases(forward, lambda y: y.backward(grad), device)
            units += flops if family in FLOP_FAMILIES else moved
            fwd += t_fwd
            bwd += t_bwd
        out.append((family, units / fwd, units / bwd))
    return tuple(out)


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
    args = [torch.randn(*shape, device=device, requires_grad=True) for shape in ((8, 8), (8, 8), (8,))]
    fwd, bwd = _timed_phases(lambda: program(*args), lambda loss: loss.backward(), device)
    return fwd / (LAUNCH_OPS + 1), bwd / (LAUNCH_OPS + 1)


def _optimizer(device) -> tuple:
    """(seconds per step, per parameter tensor, per parameter byte) of AdamW over DTensor
    parameters on the world's mesh, as ``parallelize`` holds them (plain tensors outside a
    process group), fitted over sets of different counts and sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    grouped = dist.is_available() and dist.is_initialized()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if grouped else None
    rows, ts = [], []
    for count, numel in _shapes(device)["optimizer"]:
        params = []
        for _ in range(count):
            t, g = torch.randn(numel, device=device), torch.randn(numel, device=device)   # no DTensor RNG: warns on CPU
            p = torch.nn.Parameter(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if grouped else t)
            p.grad = DTensor.from_local(g, mesh, [Replicate()], run_check=False) if grouped else g
            params.append(p)
        _adopt(params)
        opt = torch.optim.AdamW(params, lr=1e-3)
        rows.append((count, 4.0 * count * numel))
        ts.append(_timed(opt.step, device))
    return _fit_optimizer(rows, ts)


def _adopt(params) -> None:
    """Hand the parameters to autoshard's optimizer switch, as ``parallelize`` does, where it has one."""
    try:
        from autoshard.runtime import optim
    except ImportError:
        return
    optim.adopt(params)


def _fit_optimizer(rows, ts) -> tuple:
    """t = fixed + per_tensor * count + per_byte * bytes through the three sets, each part kept
    at least 0 (noise can make a difference negative): the large set's bytes, the many-tensor
    set's count, the rest fixed."""
    (c0, b0), (c1, _), (_, b2) = rows
    per_byte = max(ts[2] - ts[0], 0.0) / (b2 - b0)
    per_tensor = max(ts[1] - ts[0], 0.0) / (c1 - c0)
    fixed = max(ts[0] - per_tensor * c0 - per_byte * b0, 0.0)
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

# torch 2.13 renamed the dim-0 gather and reduce-scatter; older releases have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    """{"links": {(kind, size, stride): (alpha, beta)}} for every group shape of this world. Each
    call runs as the emitted program runs a conversion step (``runtime._launch`` on a dim the
    collective does not exchange, with the copies that puts the cut on dim 0 and back), so the
    fitted bandwidth carries those copies too: on a CPU they cost as much as the bytes sent."""
    from autoshard.runtime import _launch
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
                rows = size * max(1, COLLECTIVE_ROWS // size)             # both dims divisible into
                cols = max(size, nbytes // 4 // rows // size * size)       # the group's blocks
                x = torch.randn(rows, cols, device=device)
                # a fresh output each call, as the program's steps make (a new buffer costs gloo
                # more than a reused one)
                dim, dim2 = (1, 0) if kind == "all_to_all" else (1, None)

                def call(x=x, kind=kind, dim=dim, dim2=dim2):
                    work, finish = _launch(x, kind, group, size, dim, dim2)
                    work.wait()
                    finish()

                xs.append(ring_bytes(kind, 4.0 * x.numel(), size))
                ts.append(_timed_together(call, device, _calls(nbytes), barrier))
            if kind == "all_reduce":
                # also a full gradient bucket, as the bucket runs it (in place, on a buffer kept
                # from call to call): priced past the points above at their last slope, gloo's
                # all-reduce of 26 MB at world 4 took a fifth longer than that
                flat = torch.randn(BUCKET_BYTES // 4, device=device)
                xs.append(ring_bytes(kind, 4.0 * flat.numel(), size))
                ts.append(_timed_together(lambda flat=flat: dist.all_reduce(flat, group=group), device,
                                          _calls(BUCKET_BYTES), barrier))
            alpha, slope = fit_line(xs, ts)
            table[(kind, size, stride)] = (alpha, 1.0 / slope, tuple(zip(xs, ts)))
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    return {"links": table, "overlap": _overlap(device)}


def _calls(nbytes: int) -> int:
    return COLLECTIVE_CALLS if nbytes < 1 << 22 else LARGE_CALLS


def _overlap(device) -> float:
    """The fraction of an all-reduce that matmuls run beside it hide (see the module docstring):
    the median over ``OVERLAP_TRIALS`` trials, each timing the all-reduce alone, the matmuls
    alone and both at once back to back (``OVERLAP_CALLS`` calls each), every rank together, so
    that the three see one load."""
    x = torch.randn(OVERLAP_BYTES // 4, device=device)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    reduce = lambda: dist.all_reduce(x.clone())   # noqa: E731
    alone = _timed_together(reduce, device, COLLECTIVE_CALLS, dist.barrier)
    one = _timed(lambda: torch.mm(a, b), device, window=WINDOW / 3)
    count = torch.tensor([max(1, round(alone / one))])
    dist.broadcast(count, src=0)   # the same work on every rank
    count = int(count)

    def compute():
        for _ in range(count):
            torch.mm(a, b)

    def both():
        work = dist.all_reduce(x.clone(), async_op=True)
        compute()
        work.wait()

    trials = []
    for _ in range(OVERLAP_TRIALS):
        alone = _timed_together(reduce, device, OVERLAP_CALLS, dist.barrier)
        work = _timed_together(compute, device, OVERLAP_CALLS, dist.barrier)
        together = _timed_together(both, device, OVERLAP_CALLS, dist.barrier)
        trials.append((alone + work - together) / min(alone, work))
    return min(1.0, max(0.0, statistics.median(trials)))
