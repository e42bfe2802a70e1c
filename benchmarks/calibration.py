"""The cost model against the clock: predicted and measured step times of several plans of one GPT,
on a local gloo group (CPU processes) measured by ``autoshard.measure``.

  1. every rank measures the cluster (``autoshard.measure``: collectives per group shape, matmul
     FLOP/s, memory bandwidth, op launch overhead, AdamW's step); rank 0's figures are the plan's
  2. the default plan (``autoshard.plan`` with the measured cluster, its own mesh search) and every
     hand scheme of ``autoshard.schemes`` that fits the world, each planned on the measured cluster
  3. each plan run by ``autoshard.parallelize(model, inputs, plan=...)``: a training step is forward,
     backward, AdamW's step and zero_grad. After warm-up, rounds: the cluster measured again, then
     one step of each plan, the plans taking turns to go first. A step's time is its slowest
     rank's; a plan's measured time is the median over rounds
  4. each plan's layout is priced on the cluster measured in each round, and its prediction is
     the median of those ``plan.cost``: on a machine shared with other work the load drifts by
     the second, and measurements taken in turn with the steps see the load the steps saw

Prints predicted and measured milliseconds side by side, the spread of the measured steps (their
interquartile range over the median: the machine's noise), measured / predicted, and the
Spearman rank correlation of the two. ``--phases`` adds forward, backward and optimizer times against the
model's parts (compute and the blocking communication of each phase; the collectives the schedule
overlaps count in the step's exposed total only). Targets: every prediction within 25% of its
measurement, Spearman >= 0.9.

    python benchmarks/calibration.py                  # world 2: d=256, 4 blocks, vocab 4096, 8 x 128 tokens
    python benchmarks/calibration.py --world 4        # adds 2-D meshes: tensor_2d, hybrid FSDP, Megatron x data
    python benchmarks/calibration.py --model mlp      # the residual MLP of vs_torch.py (256 -> 512, 4 blocks)
    python benchmarks/calibration.py --save run.json  # also keep the clusters, plans and step times ...
    python benchmarks/calibration.py --load run.json  # ... and price them again, on the cost model of now
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autoshard  # noqa: E402
from autoshard.machine import measure
from autoshard import schemes  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402
from autoshard import placement as pl  # noqa: E402
from autoshard.api import resolve_pins  # noqa: E402
from autoshard.cost.compute import FLOP_FAMILIES  # noqa: E402
from autoshard.passes.annotate import annotate  # noqa: E402
from autoshard.passes.capture import capture  # noqa: E402
from autoshard.cost.price import Costs  # noqa: E402
from autoshard.planner.solve import Solution  # noqa: E402
from autoshard.planner.make import make_plan  # noqa: E402
from plan_gpt import GPT  # noqa: E402
from vs_torch import ResMLP  # noqa: E402

# (label, scheme, mesh, roles) per world: every scheme whose splits this GPT divides
HAND = {
    2: [("data_parallel", (2,), {}), ("fsdp", (2,), {}), ("megatron", (2,), {}), ("sequence_parallel", (2,), {})],
    4: [("data_parallel", (4,), {}), ("fsdp", (4,), {}), ("megatron", (4,), {}), ("sequence_parallel", (4,), {}),
        ("fsdp", (2, 2), {"shard": 1}), ("megatron", (2, 2), {"tp": 1}), ("tensor_2d", (2, 2), {"row": 0, "col": 1})],
}


def make(args):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if args.model == "mlp":   # vs_torch.py's residual MLP, at its sizes
        model = ResMLP(256, 512, args.layers, 64)
        return model, (torch.randn(128, 256, generator=g), torch.randint(0, 64, (128,), generator=g))
    model = GPT(args.vocab, args.d, args.heads, args.layers, args.seq)
    inputs = tuple(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(2))
    return model, inputs


def measure_job():
    """Every rank: the measured cluster and the seconds measuring took (DTensor already imported,
    as ``parallelize`` imports it anyway)."""
    import torch.distributed.tensor  # noqa: F401
    start = time.perf_counter()
    autoshard.measure()
    seconds = time.perf_counter() - start
    # the plans are made on the median of three: one measurement taken during a burst of other
    # work on the machine would make the default plan for a slower machine than the steps see
    return autoshard.measure(repeats=3), seconds


def steps_job(plan_texts, args):
    """Every rank: the cluster measured in each round, and per plan, per round, (forward,
    backward, optimizer) seconds of its step."""
    import torch.distributed as dist
    runs = []
    for text in plan_texts:
        model, inputs = make(args)
        pm = autoshard.parallelize(model, inputs, plan=autoshard.Plan.from_json(text))
        runs.append((pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), inputs))
    clusters, times = [], [[] for _ in runs]
    for step in range(args.warmup + args.steps):
        if step >= args.warmup:
            clusters.append(autoshard.measure())
        order = list(range(len(runs)))
        order = order[step % len(order):] + order[:step % len(order)]   # each plan goes first in turn
        for i in order:
            pm, opt, inputs = runs[i]
            dist.barrier()
            t0 = time.perf_counter()
            loss = pm(*inputs)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if step >= args.warmup:
                times[i].append((t1 - t0, t2 - t1, t3 - t2))
    return clusters, times


class Layout:
    """A plan's layout, to price on other clusters: its strategy per node of the captured graph."""

    def __init__(self, plan, graph):
        self.plan, self.graph, mesh = plan, graph, tuple(plan.mesh_shape)
        self.strategies = annotate(graph, mesh, resolve_pins(graph, dict(plan.params), len(mesh)))
        self.choice = {}
        for n in graph.nodes:
            chosen = plan.nodes[n.name]
            want = ([tuple(x) for x in chosen.inputs], [tuple(x) for x in chosen.outputs])
            self.choice[n.name] = next(i for i, st in enumerate(self.strategies[n.name])
                                       if ([pl.to_strings(x) for x in st.inputs],
                                           [pl.to_strings(x) for x in st.outputs]) == want)

    def priced(self, cluster):
        """The plan with its costs from ``cluster``: ``.cost`` is its predicted step."""
        plan = self.plan
        costs = Costs(self.graph, tuple(plan.mesh_shape), cluster, plan.training, plan.schedule["bucket_bytes"],
                      plan.schedule.get("reshard_after_forward", False))
        return make_plan(self.graph, self.strategies, Solution(self.choice, 0.0, None, "priced", 0.0), costs)


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def phase_parts(plan):
    """Predicted (forward, backward, optimizer) seconds: each phase's compute and the collectives
    it waits for (of those the schedule overlaps in forward, the part ``Cluster.overlap`` says
    compute does not hide); backward's, the rest of the step's exposed communication (of a
    gradient bucket, what the backward left after it cannot hide: ``cost.buckets.covered``)."""
    b = plan.breakdown
    forward = sum(c.seconds * (1 - plan.cluster.overlap if c.overlapped else 1)
                  for c in plan.collectives if c.phase == "forward")
    return (b["compute_fwd"] + forward, b["compute_bwd"] + b["exposed"] - forward, b.get("optimizer", 0.0))


def describe(cluster) -> str:
    lines = [f"{cluster.name}: matmul {cluster.peak_flops_fp32 / 1e9:.0f} GFLOP/s fp32, "
             f"{cluster.peak_flops / 1e9:.0f} bf16; memory {cluster.memory_bandwidth / 1e9:.1f} GB/s; "
             f"op launch {cluster.op_overhead * 1e6:.1f} us forward, {cluster.backward_overhead * 1e6:.1f} us "
             f"backward; AdamW {cluster.optimizer[0] * 1e3:.2f} ms + {cluster.optimizer[1] * 1e6:.1f} us per tensor "
             f"+ {cluster.optimizer[2] * 1e9:.2f} ns per byte"]
    lines.append("  kernels, forward / backward: " + ", ".join(
        f"{family} {f / 1e9:.1f}/{b / 1e9:.1f} {'GFLOP/s' if family in FLOP_FAMILIES else 'GB/s'}"
        for family, f, b in cluster.kernels) + f"; overlap {cluster.overlap:.2f}")
    for kind, size, stride, alpha, beta, *_ in cluster.collectives:
        lines.append(f"  {kind:<15} {size} ranks {stride} apart: alpha {alpha * 1e6:7.1f} us, "
                     f"beta {beta / 1e9:5.2f} GB/s")
    return "\n".join(lines)


def run(args, model, inputs, graph):
    """Measure, plan and run: (plans, the clusters measured in the rounds, each rank's step times)."""
    with LocalWorld(args.world, timeout_s=900.0) as world:   # a loaded machine runs the rounds slowly
        measured = world.run(measure_job)
        cluster = measured[0][0]
        print(f"cluster measured in {max(t for _, t in measured):.2f} s; the plans made on the median of three "
              "measurements")
        print(describe(cluster) + "\n")
        plans = [("autoshard", autoshard.plan(model, inputs, world=args.world, cluster=cluster))]
        for scheme, mesh, roles in HAND[args.world]:
            label = f"{scheme}" + (f" [{','.join(f'{k}={v}' for k, v in roles.items())}]" if roles else "")
            try:
                pins = schemes.SCHEMES[scheme](model, inputs, mesh, graph=graph, **roles)
            except ValueError as e:   # a scheme this model has no place for (sequence parallel on an MLP)
                print(f"{label} on {mesh}: not planned ({str(e)[:100]})")
                continue
            plans.append((label, autoshard.plan(model, inputs, mesh=mesh, cluster=cluster, pin=pins)))
        results = world.run(steps_job, [p.to_json() for _, p in plans], args)
    return plans, results[0][0], [r[1] for r in results]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, choices=sorted(HAND))
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                    help="the GPT (its sizes below) or vs_torch.py's residual MLP (256 -> 512, 64 classes, batch 128)")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="rounds: timed steps per plan")
    ap.add_argument("--phases", action="store_true", help="also forward, backward and optimizer times")
    ap.add_argument("--save", help="write the plans, the clusters measured and the step times here (JSON)")
    ap.add_argument("--load", help="run nothing: price the plans of a --save run again, on the cost model of now")
    args = ap.parse_args()
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        keep = ("phases",)
        args = argparse.Namespace(**dict(saved["args"], **{k: getattr(args, k) for k in keep}, load=args.load,
                                         save=None))

    what = (f"residual MLP 256 -> 512, {args.layers} blocks, 64 classes, batch 128" if args.model == "mlp" else
            f"GPT d={args.d}, {args.layers} blocks, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x "
            f"{args.seq} tokens")
    print(f"{what}; {args.world} gloo processes, one thread each; AdamW; median of {args.steps} rounds "
          f"after {args.warmup} of warm-up, plans taking turns" + (f" (as saved in {args.load})" if args.load else "")
          + "\n")
    model, inputs = make(args)
    graph = capture(model, inputs)
    if args.load:
        plans = [(label, autoshard.Plan.from_json(text)) for label, text in saved["plans"]]
        clusters = [autoshard.Cluster(**c) for c in saved["clusters"]]
        times = saved["times"]
    else:
        plans, clusters, times = run(args, model, inputs, graph)
    if args.save:
        from dataclasses import asdict
        with open(args.save, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("save", "load")},
                       "plans": [(label, p.to_json()) for label, p in plans],
                       "clusters": [asdict(c) for c in clusters], "times": times}, f)
    print(f"measured again before each round; the median of each figure over the {len(clusters)} rounds:")
    print(describe(measure.median(clusters)) + "\n")

    rows, preds, meas = [], [], []
    for i, (label, planned) in enumerate(plans):
        layout = Layout(planned, graph)
        per_round = [layout.priced(c) for c in clusters]
        pred = statistics.median(p.cost for p in per_round)
        per_step = [[max(rank[i][s][k] for rank in times) for k in range(3)] for s in range(args.steps)]
        steps = [max(sum(rank[i][s]) for rank in times) for s in range(args.steps)]   # the slowest rank's
        m = statistics.median(steps)
        quartiles = statistics.quantiles(steps, n=4)
        preds.append(pred)
        meas.append(m)
        phases = [statistics.median(t[k] for t in per_step) for k in range(3)]
        parts = [statistics.median(phase_parts(p)[k] for p in per_round) for k in range(3)]
        rows.append((label, str(tuple(planned.mesh_shape)), pred, m, (quartiles[2] - quartiles[0]) / m, phases, parts))
    width = max(len(r[0]) for r in rows)
    head = f"{'plan':<{width}}  {'mesh':<7} {'predicted':>10} {'measured':>10} {'spread':>7} {'meas/pred':>9}"
    if args.phases:
        head += "   fwd pred/meas   bwd pred/meas   opt pred/meas (ms)"
    print(head)
    worst = 0.0
    for label, mesh, pred, m, spread, phases, parts in rows:
        line = f"{label:<{width}}  {mesh:<7} {pred * 1e3:8.1f}ms {m * 1e3:8.1f}ms {100 * spread:6.0f}% {m / pred:9.3f}"
        if args.phases:
            line += "   " + "   ".join(f"{p * 1e3:6.1f}/{q * 1e3:6.1f}" for p, q in zip(parts, phases))
        print(line)
        worst = max(worst, abs(pred - m) / m)
    rho = spearman(preds, meas)
    print(f"\nSpearman rank correlation {rho:.3f} (target >= 0.9); largest error {100 * worst:.1f}% of the "
          f"measured step (target <= 25%)")


if __name__ == "__main__":
    main()
