"""autoshard.measure: the machine measured in its process group, saved and loaded exactly, carried by
the plan to every rank, and priced by the cost model (fitted collectives, op launches, the
optimizer step, overlap); the presets price as before."""
import copy
import math
import os
import pathlib
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.machine import measure
from autoshard import placement as pl
from autoshard.machine.cluster import COLLECTIVE_KINDS, Cluster
from autoshard.convert import Step
from autoshard.cost import comm
from autoshard.cost.buckets import BUCKET_BYTES
from autoshard.passes.annotate import annotate
from autoshard.passes.capture import capture
from autoshard.cost.price import Costs
from cases import step_on_the_same_gradients
from models import GPT, TwoLayer

PRESET = Cluster.preset("a100-80gb-nvlink-ib")
# a measured-looking cluster, without measuring: CPU-like figures
FAKE = PRESET.with_(name="fake measured", peak_flops=5e10, peak_flops_fp32=4e10, memory_bandwidth=1e10,
                    efficiency=1.0, op_overhead=8e-6, collective_overhead=8e-6, backward_overhead=1.2e-5, overlap=0.0,
                    optimizer=(2e-4, 3e-5, 1e-9),
                    collectives=tuple((k, 2, 1, 3e-4, 1e9) for k in COLLECTIVE_KINDS))


def _measure():
    import torch.distributed.tensor  # noqa: F401 - imported by parallelize anyway; not measuring's time
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = measure.measure()
    return cluster, time.perf_counter() - start, [str(w.message) for w in caught]


def _train(cluster):
    """parallelize(cluster=...) and one Adam step, against the same model on this process alone."""
    torch.manual_seed(0)
    model = GPT()
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, cluster=cluster)
    opt, ref_opt = torch.optim.Adam(pm.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss, ref_loss = pm(*inputs), ref(*inputs)
        loss.backward()
        ref_loss.backward()
        step_on_the_same_gradients(pm, ref, opt, ref_opt)
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return pm.plan.to_json(), losses, dist.get_rank()


@pytest.fixture(scope="module")
def measured(world2):
    return world2.run(_measure)


def test_measured_on_every_rank_alike_and_sane(measured):
    clusters = [c for c, _, _ in measured]
    c = clusters[0]
    print(f"\nautoshard.measure at world 2: {max(s for _, s, _ in measured):.2f} s")
    assert not any(w for _, _, w in measured), [w for _, _, w in measured]   # torch's "DTensor random operators" on CPU
    assert all(other == c for other in clusters)                 # rank 0's figures, everywhere
    assert c.measured and c.gpus_per_node == 2 and c.efficiency == 1.0
    assert 1e8 < c.peak_flops_fp32 < 1e15 and 1e8 < c.peak_flops < 1e16       # a CPU core to a GPU
    assert 1e8 < c.memory_bandwidth < 1e13
    assert 0 < c.op_overhead < 1e-3 and 0 < c.backward_overhead < 1e-3        # microseconds, not seconds
    assert len(c.optimizer) == 3 and all(math.isfinite(v) and v >= 0 for v in c.optimizer) and sum(c.optimizer) > 0
    assert 0 <= c.overlap <= 1
    assert {(k, p, s) for k, p, s, *_ in c.collectives} == {(k, 2, 1) for k in COLLECTIVE_KINDS}
    for kind, _, _, alpha, beta, points in c.collectives:
        assert 0 <= alpha < 0.1, (kind, alpha)                    # below 100 ms a call
        assert 1e6 < beta < 1e12, (kind, beta)                    # 1 MB/s to 1 TB/s
        # every size timed, as bytes a ring sends per rank (half of each size at world 2)
        # and the all-reduce also at a full gradient bucket's size, as the bucket runs it
        sizes = measure.COLLECTIVE_BYTES + ((BUCKET_BYTES,) if kind == "all_reduce" else ())
        assert [x for x, _ in points] == pytest.approx([comm.ring_bytes(kind, n, 2) for n in sizes], rel=0.05)
        assert all(0 < t < 1.0 for _, t in points)


def test_measured_cluster_round_trips_json(measured, tmp_path):
    c = measured[0][0]
    c.save(tmp_path / "cluster.json")
    assert Cluster.load(tmp_path / "cluster.json") == c
    FAKE.save(tmp_path / "fake.json")
    assert Cluster.load(tmp_path / "fake.json") == FAKE
    # and inside a plan's JSON, which parallelize broadcasts from rank 0
    torch.manual_seed(0)
    plan = autoshard.plan(TwoLayer(16, 32), (torch.randn(8, 16), torch.randn(8, 16)), world=2, cluster=c)
    assert autoshard.Plan.from_json(plan.to_json()).cluster == c


def test_parallelize_measures_and_trains_exactly(world2):
    out = world2.run(_train, "measure")
    plans = [text for text, _, _ in out]
    assert all(p == plans[0] for p in plans)                      # one plan on every rank
    plan = autoshard.Plan.from_json(plans[0])
    assert plan.cluster.measured and plan.cluster.name.startswith("measured: gloo, 2 ranks")
    for _, losses, rank in out:
        for loss, ref in losses:
            assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6), (rank, losses)


def _kept(root):
    """cluster="measure" twice with a plan cache at ``root``: the second measures nothing."""
    before = os.environ.get("AUTOSHARD_PLAN_CACHE")
    os.environ["AUTOSHARD_PLAN_CACHE"] = root
    fresh = measure.measure

    def refuse(*_, **__):
        raise AssertionError("measured again, though kept")
    try:
        first = measure.resolve_cluster("measure")
        measure.measure = refuse
        again = measure.resolve_cluster("measure")
    finally:
        measure.measure = fresh
        if before is None:
            del os.environ["AUTOSHARD_PLAN_CACHE"]
        else:
            os.environ["AUTOSHARD_PLAN_CACHE"] = before
    return first, again, sorted(p.name for p in pathlib.Path(root, "clusters").iterdir())


def test_a_measured_cluster_is_kept_on_disk_and_read_back_on_every_rank(world2, tmp_path):
    """issue 34: a restart neither measures again nor, its figures the same, misses its kept plan."""
    out = world2.run(_kept, str(tmp_path))
    (first, again, files), (first1, again1, _) = out
    assert first.measured and first == again == first1 == again1   # rank 0 read, every rank took it
    assert len(files) == 1 and files[0] in first.name


def test_measure_outside_a_group_measures_compute_and_keeps_the_links():
    with pytest.warns(UserWarning, match="compute only"):
        c = autoshard.api.resolve_cluster("measure")
    assert c.measured and not c.collectives and c.overlap == PRESET.overlap
    assert c.intra_bandwidth == PRESET.intra_bandwidth and c.peak_flops_fp32 != PRESET.peak_flops_fp32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(TwoLayer(16, 32), (torch.randn(8, 16), torch.randn(8, 16)), world=2,
                              cluster="measure")
    assert plan.cluster.measured and plan.cost > 0


def test_fits_and_group_shapes():
    a, b = measure.fit_line([1.0, 2.0, 4.0, 8.0], [3.0, 5.0, 9.0, 17.0])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    assert measure.group_shapes(4) == {(2, 1): [[0, 1], [2, 3]], (4, 1): [[0, 1, 2, 3]], (2, 2): [[0, 2], [1, 3]]}
    assert sorted(measure.group_shapes(8)) == [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]


def test_cluster_validates_measured_fields():
    with pytest.raises(ValueError, match="collectives"):
        PRESET.with_(collectives=(("all_gather", 1, 1, 1e-5, 1e9),))
    with pytest.raises(ValueError, match="collectives"):
        PRESET.with_(collectives=(("broadcast", 2, 1, 1e-5, 1e9),))
    with pytest.raises(ValueError, match="one row per"):
        PRESET.with_(collectives=(("all_gather", 2, 1, 1e-5, 1e9), ("all_gather", 2, 1, 2e-5, 1e9)))
    with pytest.raises(ValueError, match="optimizer"):
        PRESET.with_(optimizer=(1.0, 2.0))
    with pytest.raises(ValueError, match="overlap"):
        PRESET.with_(overlap=1.5)
    with pytest.raises(ValueError, match="op_overhead"):
        PRESET.with_(op_overhead=-1e-6)
    # lists, as JSON gives them back, become tuples: equal to the saved cluster
    assert Cluster(**dict(vars(FAKE), collectives=[list(r) for r in FAKE.collectives])) == FAKE


def test_presets_price_no_launches_and_no_fits():
    for c in autoshard.PRESETS.values():
        assert not c.measured and c.optimizer == () and c.overlap == 1.0
        assert c.axis_links((4, 2))[0].fits == {}


def test_collectives_priced_by_their_fits():
    links = FAKE.axis_links((2,))
    assert links[0].fits["all_reduce"] == (3e-4, 1e9)
    step = Step("all_gather", 0, 0, None, (1024, 256))
    n = 1024 * 256 * 4
    # launch + fitted latency + ring bytes / fitted bandwidth
    assert comm.step_time(step, 4, (2,), links) == pytest.approx(8e-6 + 3e-4 + n / 1e9)
    assert comm.all_reduce_time(n, 2, links[0]) == pytest.approx(8e-6 + 3e-4 + n / 1e9)
    # the preset's ring formula for the same step
    alpha, beta, launch = PRESET.axis_links((2,))[0]
    assert comm.step_time(step, 4, (2,), PRESET.axis_links((2,))) == pytest.approx(launch + alpha + n / beta)
    # a group shape that was not measured falls back to the formula
    assert FAKE.axis_links((4,))[0].fits == {}


def test_collectives_priced_through_their_points():
    # t = 1 ms at 1 MB, 3 ms at 2 MB (slower per byte past a cache), fitted line: 0.5 ms + 1 GB/s
    points = ((1e6, 1e-3), (2e6, 3e-3))
    fit = (5e-4, 1e9, points)
    assert comm.fitted_time(fit, 1e6, 0.0) == pytest.approx(1e-3)
    assert comm.fitted_time(fit, 1.5e6, 0.0) == pytest.approx(2e-3)             # between two points
    assert comm.fitted_time(fit, 3e6, 0.0) == pytest.approx(5e-3)               # the last slope on
    assert comm.fitted_time(fit, 5e5, 0.0) == pytest.approx(7.5e-4)             # from the latency
    # in a bucket: a share of launch and latency, the bytes' time whole
    assert comm.fitted_time(fit, 2e6, 1e-4, share=0.5) == pytest.approx(0.5 * (1e-4 + 5e-4) + 3e-3 - 5e-4)
    # a tensor that is a quarter of its bucket pays a quarter of the bucket's time at its size
    assert comm.fitted_time(fit, 5e5, 0.0, scale=4.0) == pytest.approx((5e-3 - 5e-4) / 4)
    # a point faster than a smaller one (noise) is taken as the smaller one's time
    assert comm.fitted_time((5e-4, 1e9, ((1e6, 2e-3), (2e6, 1e-3))), 2e6, 0.0) == pytest.approx(2e-3)
    # a cluster carries them, through JSON, to its links and so to every step
    c = FAKE.with_(collectives=tuple((k, 2, 1) + fit for k in COLLECTIVE_KINDS))
    assert Cluster(**dict(vars(c), collectives=[[*r[:5], [list(p) for p in r[5]]] for r in c.collectives])) == c
    links = c.axis_links((2,))
    step = Step("all_gather", 0, 0, None, (1024, 256))   # 1 MiB in, 1 MiB sent at world 2
    assert comm.step_time(step, 4, (2,), links) == pytest.approx(8e-6 + comm.fitted_time(fit, 2**20, 0.0))
    assert comm.all_reduce_time(2**20, 2, links[0]) == pytest.approx(8e-6 + comm.fitted_time(fit, 2**20, 0.0))
    with pytest.raises(ValueError, match="points"):
        FAKE.with_(collectives=(("all_gather", 2, 1, 1e-5, 1e9, ((2e6, 1e-3), (1e6, 2e-3))),))


def test_a_bucketed_gradient_moves_at_the_buckets_rate():
    """A small parameter's gradient rides in a bucket: it pays its share of the launch and
    latency, and its bytes at the rate of a bucket's size read off the timed points, not the small
    sizes' rate (which carries their latency: 50 small tensors would otherwise each pay most of
    a collective)."""
    # all-reduces: 1.3 ms for 4 KB (latency-bound), 20 ms for 16 MB
    points = ((4e3, 1.3e-3), (16e6, 20e-3))
    c = FAKE.with_(collectives=tuple((k, 2, 1, 1e-3, 1e9, points) for k in COLLECTIVE_KINDS))
    graph, strategies, costs = _costs(c)
    bias = next(n for n in graph.nodes if n.kind == "param" and len(n.outputs[0].shape) == 1)
    strat = next(s for s in strategies[bias.name] if all(isinstance(p, pl.Broadcast) for p in s.outputs[0]))
    (_, nbytes, seconds), = costs.grad_syncs(bias, strat)
    share = nbytes / costs.bucket_bytes
    whole = comm.fitted_time((1e-3, 1e9, points), costs.bucket_bytes, 0.0) - 1e-3   # a full bucket's bytes
    assert seconds == pytest.approx(share * (c.collective_overhead + 1e-3) + whole * share, rel=1e-6)
    assert seconds < 0.01 * comm.fitted_time((1e-3, 1e9, points), nbytes, 0.0)


def test_a_bucketed_gradient_pays_its_copies_into_and_out_of_the_bucket():
    """On a measured cluster an all-reduced gradient is copied into its bucket and, once reduced,
    out of it (runtime's _GradBucket and _GradWait): two copies, each reading and writing its
    bytes, in backward beside its autograd node's launch; a split parameter, not all-reduced,
    pays only the launch."""
    graph, strategies, costs = _costs(FAKE)
    weight = next(n for n in graph.nodes if n.kind == "param" and len(n.outputs[0].shape) == 2)
    whole = next(s for s in strategies[weight.name] if all(isinstance(p, pl.Broadcast) for p in s.outputs[0]))
    split = next(s for s in strategies[weight.name] if isinstance(s.outputs[0][0], pl.Split))
    (_, nbytes, _), = costs.grad_syncs(weight, whole)
    assert costs.node(weight, whole).compute_bwd == pytest.approx(
        FAKE.backward_overhead + 4 * nbytes / FAKE.memory_bandwidth, rel=1e-12)
    assert costs.node(weight, split).compute_bwd == pytest.approx(FAKE.backward_overhead, rel=1e-12)


def _costs(cluster, mesh=(2,)):
    torch.manual_seed(0)
    model, inputs = GPT(), (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    graph = capture(model, inputs)
    strategies = annotate(graph, mesh, {})
    return graph, strategies, Costs(graph, mesh, cluster, True)


def test_launches_counted_per_op_and_views_cost_only_their_launch():
    overhead = FAKE.with_(op_overhead=1e-4, backward_overhead=3e-4)
    graph, strategies, with_launch = _costs(overhead)
    _, _, without = _costs(overhead.with_(op_overhead=0.0, backward_overhead=0.0))   # still measured
    fwd = bwd = 0.0
    launches_fwd = launches_bwd = 0
    for n in graph.nodes:
        s = strategies[n.name][0]
        a, b = with_launch.node(n, s), without.node(n, s)
        fwd += a.compute_fwd - b.compute_fwd
        bwd += a.compute_bwd - b.compute_bwd
        if n.kind in ("op", "param"):
            launches_fwd += 1
            launches_bwd += n.requires_grad
    # every op and every parameter launches once forward, once backward when it needs a gradient
    assert fwd == pytest.approx(launches_fwd * 1e-4, rel=1e-6)
    assert bwd == pytest.approx(launches_bwd * 3e-4, rel=1e-6)
    view = next(n for n in graph.nodes if n.kind == "op" and n.target == torch.ops.aten.view.default)
    assert with_launch.node(view, strategies[view.name][0]).compute_fwd == 1e-4    # a view moves no bytes


def test_a_gpu_hides_launches_behind_kernels_and_times_kernels_long_enough(tmp_path):
    """On a GPU (``launch_hidden``) an op costs the longer of its kernel and its launch, on a CPU
    their sum; a saved cluster says which. The GPU times shapes whose kernels are longer than
    their launches: the CPU's (a linear of 1024 x 256 by 256 x 1024) ran there at 8.8 TFLOP/s
    and priced a 15 ms step at 536 ms."""
    from autoshard.cost import compute
    linear = torch.ops.aten.linear.default
    bare = FAKE.with_(op_overhead=0.0, backward_overhead=0.0)
    cpu = FAKE.with_(op_overhead=1e-4, backward_overhead=3e-4)
    gpu = cpu.with_(launch_hidden=True)
    for (x, w), long_kernel in ((((4, 8), (8, 8)), False), (((4096, 4096), (4096, 4096)), True)):
        out = [(x[0], w[0])]
        for price, launch in ((compute.op_time, 1e-4), (compute.backward_time, 3e-4)):
            kernel = price(linear, (x, w), out, 4, bare)
            assert price(linear, (x, w), out, 4, cpu) == pytest.approx(kernel + launch, rel=1e-9)
            assert price(linear, (x, w), out, 4, gpu) == pytest.approx(max(kernel, launch), rel=1e-9)
            assert (kernel > launch) is long_kernel
    for cluster in (cpu, gpu):
        cluster.save(tmp_path / "c.json")
        assert Cluster.load(tmp_path / "c.json") == cluster
    on_cpu, on_gpu = measure._shapes(torch.device("cpu")), measure._shapes(torch.device("cuda", 0))
    flops = lambda sh: 2 * sh["tokens"] * sh["linears"][0][0] * sh["linears"][0][1]   # noqa: E731
    assert on_cpu["linears"] == measure.LINEARS and on_cpu["tokens"] == measure.TOKENS
    assert flops(on_gpu) >= 256 * flops(on_cpu)   # tenths of a millisecond on an H100-class GPU
    assert on_gpu["stream"] >= 64 * on_cpu["stream"] and on_gpu["rows"] >= 64 * on_cpu["rows"]


def test_measured_cluster_changes_the_price_and_counts_the_optimizer():
    torch.manual_seed(0)
    model, inputs = GPT(), (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    pins = autoshard.schemes.data_parallel(model, inputs, (2,))
    preset = autoshard.plan(model, inputs, mesh=(2,), pin=pins, cluster=PRESET)
    fake = autoshard.plan(model, inputs, mesh=(2,), pin=pins, cluster=FAKE)
    assert fake.cost > 100 * preset.cost                                          # a CPU, not an A100
    assert preset.breakdown["optimizer"] == 0.0
    params = [p for p in model.parameters()]
    fixed, per_tensor, per_byte = FAKE.optimizer
    # every rank steps every (replicated) parameter: the fixed part once, each tensor, each byte
    want = fixed + per_tensor * len(params) + per_byte * 4 * sum(p.numel() for p in params)
    assert fake.breakdown["optimizer"] == pytest.approx(want, rel=1e-9)
    # overlap 0: the gradient all-reduce is waited for, not hidden
    assert fake.breakdown["hidden_bwd"] == 0.0 and preset.breakdown["hidden_bwd"] > 0.0
    # overlap 1: still waited for where every gradient rides in one bucket, the last, which
    # starts when backward is done; in smaller buckets the earlier ones hide behind backward
    hidden = FAKE.with_(overlap=1.0)
    again = autoshard.plan(model, inputs, mesh=(2,), pin=pins, cluster=hidden)
    assert again.breakdown["comm"] == pytest.approx(fake.breakdown["comm"]) and again.breakdown["hidden_bwd"] == 0
    small = autoshard.plan(model, inputs, mesh=(2,), pin=pins, cluster=hidden, bucket_bytes=4096)
    assert small.breakdown["hidden_bwd"] > 0


def test_a_gradient_bucket_hides_behind_the_backward_left_after_it():
    """On a measured machine a gradient bucket's all-reduce has beside it only the backward
    compute still to run when it starts (once backward is back at its earliest-used parameter):
    the last bucket (the first layers') none, so data parallelism is priced with it waited for,
    and on a machine whose links are slow beside its compute Megatron's layout is the cheaper."""
    from autoshard.cost.buckets import backward_left, first_uses, grad_buckets
    hidden = FAKE.with_(overlap=1.0)
    graph, strategies, costs = _costs(hidden)
    costs = Costs(graph, (2,), hidden, True, bucket_bytes=8192)
    first, left = first_uses(graph), backward_left(graph, hidden, 2, True)
    buckets = grad_buckets(graph, 8192)
    assert len(buckets) > 2 and left[0] == 0.0 and left[-1] > 0
    for i, b in enumerate(buckets):
        t = comm.group_all_reduce_time(b["bytes"], (0,), (2,), hidden)
        part = min(1.0, left[min(first[name] for name, _ in b["members"])] / t)
        for name, _ in b["members"]:
            n = graph.by_name[name]
            strat = next(s for s in strategies[name] if all(isinstance(p, pl.Broadcast) for p in s.outputs[0]))
            (_, _, seconds), = costs.grad_syncs(n, strat)
            cost = costs.node(n, strat)
            assert cost.hidden_bwd == pytest.approx(part * seconds, rel=1e-9, abs=1e-15)
            assert cost.hidden_bwd + cost.comm == pytest.approx(seconds, rel=1e-9)
        if i == len(buckets) - 1:
            assert part == 0.0     # the embedding's: nothing of backward left after it
    assert 0 < max(costs._grad_cover.values()) <= 1.0
    # the ranking: slow links, all of them hidden by compute beside them (overlap 1)
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, layers=2)
    inputs = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    slow = hidden.with_(collectives=tuple((k, 2, 1, 3e-4, 6e7) for k in COLLECTIVE_KINDS))
    dp = autoshard.plan(model, inputs, mesh=(2,), pin=autoshard.schemes.data_parallel(model, inputs, (2,)), cluster=slow)
    mg = autoshard.plan(model, inputs, mesh=(2,), pin=autoshard.schemes.megatron(model, inputs, (2,)), cluster=slow)
    # with the gradient all-reduce taken as hidden by all of backward, data parallelism was
    # priced at 10.2 ms against Megatron's 10.9; it waits for its one bucket: 11.9 ms
    assert dp.breakdown["hidden_bwd"] == 0.0 and dp.cost > mg.cost


def test_ranks_agree_on_the_median_of_their_figures():
    # three ranks' figures: one caught by a burst of other work; device memory is the least
    ranks = [{"op_overhead": t, "memory": m, "kernels": (("norm", r, r / 2),), "overlap": o,
              "links": {("all_gather", 2, 1): (a, 1e9, ((1e6, a + 1e-3), (2e6, a + 3e-3)))}}
             for t, m, r, o, a in ((1e-5, 8e9, 2e9, 0.0, 1e-4), (9e-4, 6e9, 5e7, 0.9, 5e-3), (2e-5, 8e9, 3e9, 0.3, 2e-4))]
    agreed = measure._agreed(ranks)
    assert agreed["op_overhead"] == 2e-5 and agreed["memory"] == 6e9 and agreed["overlap"] == 0.3
    assert agreed["kernels"] == (("norm", 2e9, 1e9),)
    alpha, beta, points = agreed["links"][("all_gather", 2, 1)]
    assert (alpha, beta) == (2e-4, 1e9) and [x for x, _ in points] == [1e6, 2e6]
    assert [t for _, t in points] == pytest.approx([1.2e-3, 3.2e-3])


def test_median_of_measurements():
    slow = FAKE.with_(op_overhead=3e-5, optimizer=(4e-4, 5e-5, 3e-9),
                      collectives=tuple((k, 2, 1, 9e-4, 5e8) for k in COLLECTIVE_KINDS))
    fast = FAKE.with_(op_overhead=5e-6, optimizer=(1e-4, 1e-5, 1e-9))
    m = measure.median([slow, FAKE, fast])
    assert m.op_overhead == FAKE.op_overhead and m.optimizer == FAKE.optimizer and m.collectives == FAKE.collectives
    assert m.gpus_per_node == FAKE.gpus_per_node and m.name == "fake measured, median of 3"
    with pytest.raises(ValueError, match="repeats"):
        measure.measure(repeats=0)
