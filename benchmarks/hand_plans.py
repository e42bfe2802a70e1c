"""Hand-designed plans against autoshard's own, and AxoNN's own ranking, for GPT-3-like stacks.

For each stack, on the meta device (no GPUs, no process group), at world 256 on 8-GPU A100 nodes:

  autoshard    autoshard.plan(model, inputs, world=256): its own mesh search
  hand plans   every scheme of autoshard.schemes on the mesh it is usually run on, pinned and planned
               by the same cost model within the same memory budget: a plan that cannot fit says
               so, one whose splits do not divide the model is not legal there
               (the 3-D and AxoNN 4-D ones on 3- and 4-axis meshes, each in a child process stopped
               after --multi-axis-limit seconds)
  AxoNN choice AxoNN's best-ranked grid (below) laid out by the scheme that expresses it, when one
               does, and priced the same way

Columns: the estimated step time, hand / autoshard (>= 1.000x: autoshard is no worse), all
collective seconds (overlapped or not), the part of them that serves the linear layers
(axonn.plan_traffic), the exposed part the step waits for, memory per rank, and the wall time of
autoshard.plan (capture, annotate, solve).

Then AxoNN's own ranking of its 4-D grids (autoshard.cost.axonn: its per-layer communication
formulas, priced on the same cluster's links, x innermost on the hardware, then y, z, data),
top five, beside the communication of autoshard's plan: all of it, and the part that serves the
linear layers (what AxoNN's formulas count; it also carries any re-layout of the matmuls' outputs
for attention and the residual adds, so it can only overstate ours).

    python benchmarks/hand_plans.py                              # d=2048 and d=4096, 2 layers each
    python benchmarks/hand_plans.py --layers 32 --d 4096 --batch 512      # the whole 6.7B
    python benchmarks/hand_plans.py --deep                       # a 24-layer GPT, mesh search: planning time
"""
import argparse
import multiprocessing
import time

import torch

import autoshard
from autoshard import schemes
from autoshard.cost import axonn
from autoshard.passes.capture import capture
from autoshard.planner.solve import MemoryBudgetError
from plan_gpt import GPT, broadcast

HAND = schemes.USUAL_256 + [("megatron", (64, 4), {"tp": 1})]


def label(scheme, mesh, roles):
    extra = ",".join(f"{k}={v}" for k, v in roles.items())
    return f"{scheme} {mesh}" + (f" [{extra}]" if extra else "")


def summary(plan, seconds, graph):
    return {"cost": plan.cost, "comm": sum(c.seconds for c in plan.collectives),
            "linear": axonn.plan_traffic(plan, graph)["linear"],
            "exposed": plan.breakdown["exposed"], "memory": plan.memory["total"], "seconds": seconds,
            "status": plan.solver["status"].lower() + (f" ({100 * plan.solver['gap']:.2f}% gap)"
                                                         if plan.solver.get("gap") else ""),
            "mesh": tuple(plan.mesh_shape)}


def hand_plan(model, inputs, graph, scheme, mesh, roles, args):
    """The scheme's plan summary, or a line saying why there is none."""
    try:
        pins = schemes.SCHEMES[scheme](model, inputs, mesh, graph=graph, **roles)
    except ValueError as e:
        return f"not legal: {e}"
    start = time.perf_counter()
    try:
        plan = autoshard.plan(model, inputs, mesh=mesh, cluster=args.cluster, pin=pins,
                              memory_budget=args.memory_budget, time_limit=args.time_limit)
    except MemoryBudgetError as e:
        return f"does not fit: {str(e).splitlines()[0]}"
    except RuntimeError as e:
        return f"no plan after {time.perf_counter() - start:.0f} s: {e}"
    return summary(plan, time.perf_counter() - start, graph)


def _child(conn, *job):
    conn.send(hand_plan(*job))


def hand_plan_limited(limit, *job):
    """``hand_plan`` in a child process, stopped after ``limit`` seconds of wall time."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, *job))
    start = time.perf_counter()
    child.start()
    if receive.poll(limit):
        out = receive.recv()
        child.join()
        return out
    child.terminate()
    child.join()
    return f"stopped after {time.perf_counter() - start:.0f} s without a plan"


def fmt_ms(t):
    return f"{t * 1e3:.2f} ms"


def print_table(header, rows):
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths)))
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def run_stack(layers, d, batch, args, cluster):
    with torch.device("meta"):
        model = GPT(args.vocab, d, d // args.head_dim, layers, args.seq)
    idx = torch.empty(batch, args.seq, dtype=torch.long, device="meta")
    inputs = (idx, idx)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"\n== GPT {layers} layers, d={d}, batch {batch} x {args.seq} tokens, {nparams / 1e9:.2f}B parameters "
          f"({16 * nparams / 1e9:.0f} GB replicated with gradients and Adam state) ==", flush=True)
    graph = capture(model, inputs)
    start = time.perf_counter()
    auto = autoshard.plan(model, inputs, world=args.world, cluster=args.cluster,
                          memory_budget=args.memory_budget, time_limit=args.time_limit)
    ours = summary(auto, time.perf_counter() - start, graph)
    results = [("autoshard", ours)]
    stack = axonn.gpt_layers(d, layers, vocab=args.vocab)
    tokens = batch * args.seq
    ranked = axonn.rank(stack, tokens, args.world, cluster, memory_budget=args.memory_budget)
    choice = next(((g, axonn.as_scheme(g)) for g in ranked[:5] if axonn.as_scheme(g)), None)
    jobs = [(label(*j), j) for j in HAND]
    if choice:
        jobs.append((f"AxoNN choice: {label(*choice[1])}", choice[1]))
    for name, (scheme, mesh, roles) in jobs:
        job = (model, inputs, graph, scheme, mesh, roles, args)
        out = hand_plan(*job) if len(mesh) <= 2 else hand_plan_limited(args.multi_axis_limit, *job)
        results.append((name, out))
        print(f"  {name}: {'planned' if isinstance(out, dict) else out[:100]}", flush=True)

    header = ("plan", "mesh", "step", "hand/auto", "comm", "linear", "exposed", "memory/rank", "plan time", "solver")
    rows = []
    for name, r in results:
        if isinstance(r, dict):
            rows.append((name, str(r["mesh"]), fmt_ms(r["cost"]), f"{r['cost'] / ours['cost']:.3f}x",
                         fmt_ms(r["comm"]), fmt_ms(r["linear"]), fmt_ms(r["exposed"]), f"{r['memory'] / 1e9:.2f} GB",
                         f"{r['seconds']:.1f} s", r["status"]))
        else:
            rows.append((name, "-", "-", "-", "-", "-", "-", "-", "-", r[:90]))
    print()
    print_table(header, rows)

    traffic = axonn.plan_traffic(auto, graph)
    every = axonn.rank(stack, tokens, args.world, cluster, orders="all", memory_budget=args.memory_budget)
    fwd, bwd = axonn.compute_seconds(stack, tokens, args.world, cluster)
    print(f"\nAxoNN's ranking of its {len(ranked)} grids that fit (its formulas, these links; x innermost), "
          f"top 5, against autoshard's plan on {auto.mesh_shape}:")
    arows = [(f"Gx={x.gx} Gy={x.gy} Gz={x.gz} Gd={x.gd}", fmt_ms(x.seconds), fmt_ms(x.blocking),
              fmt_ms(x.exposed(fwd, bwd)), f"{x.state_bytes / 1e9:.2f} GB") for x in ranked[:5]]
    b = every[0]
    arows.append((f"best of every order: Gx={b.gx} Gy={b.gy} Gz={b.gz} Gd={b.gd} ({','.join(b.order)})",
                  fmt_ms(b.seconds), fmt_ms(b.blocking), fmt_ms(b.exposed(fwd, bwd)), f"{b.state_bytes / 1e9:.2f} GB"))
    print_table(("AxoNN grid", "comm", "blocking", "exposed", "weights/rank"), arows)
    print(f"autoshard: comm {fmt_ms(traffic['total'])} in all, {fmt_ms(traffic['linear'])} of it the linear "
          f"layers' (AxoNN's best {fmt_ms(b.seconds)}: ours / AxoNN's = {traffic['linear'] / b.seconds:.2f}x), "
          f"{fmt_ms(traffic['other'])} the rest; exposed {fmt_ms(ours['exposed'])}")


def deep(args):
    d = args.d[0]
    with torch.device("meta"):
        model = GPT(args.vocab, d, d // args.head_dim, 24, args.seq)
    idx = torch.empty(args.batch[0], args.seq, dtype=torch.long, device="meta")
    start = time.perf_counter()
    plan = autoshard.plan(model, (idx, idx), world=args.world, cluster=args.cluster,
                          memory_budget=args.memory_budget, time_limit=args.time_limit)
    seconds = time.perf_counter() - start
    fates: dict = {}
    for c in plan.mesh_candidates:
        fate = c["status"].split(":")[0].split(" (")[0]
        fates[fate] = fates.get(fate, 0) + 1
    print(f"\n== GPT 24 layers, d={d}, batch {args.batch[0]} x {args.seq}, mesh search at world {args.world} ==")
    print(f"planned in {seconds:.1f} s (solver {plan.solver['status'].lower()}): "
          f"mesh {plan.mesh_shape}, step {fmt_ms(plan.cost)}, {plan.memory['total'] / 1e9:.2f} GB per rank")
    print(f"{len(plan.mesh_candidates)} meshes: " + ", ".join(f"{k} {v}" for k, v in sorted(fates.items(), key=lambda kv: -kv[1])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2], help="blocks (one, or one per --d)")
    ap.add_argument("--d", type=int, nargs="+", default=[2048, 4096], help="widths: GPT-3 XL, GPT-3 6.7B")
    ap.add_argument("--batch", type=int, nargs="+", default=[512], help="sequences per step (one, or one per --d)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--world", type=int, default=256)
    ap.add_argument("--cluster", default="a100-80gb-nvlink-ib", help=f"one of {sorted(autoshard.PRESETS)}")
    ap.add_argument("--memory-budget", type=float, default=None, help="bytes per device (default: the cluster's)")
    ap.add_argument("--time-limit", type=float, default=600.0, help="solver seconds per plan")
    ap.add_argument("--multi-axis-limit", type=float, default=300.0,
                    help="wall seconds for each hand plan on a 3- or 4-axis mesh")
    ap.add_argument("--deep", action="store_true", help="only plan a 24-layer GPT with mesh search, print its time")
    args = ap.parse_args()
    cluster = autoshard.Cluster.preset(args.cluster)
    args.memory_budget = args.memory_budget or cluster.memory
    print(f"GPT stacks at world {args.world} on {args.cluster}, training, fp32, estimated per step; "
          f"memory budget {args.memory_budget / 1e9:.0f} GB per device")
    if args.deep:
        deep(args)
        return
    n = len(args.d)
    for layers, d, batch in zip(broadcast(args.layers, n, "--layers"), args.d, broadcast(args.batch, n, "--batch")):
        run_stack(layers, d, batch, args, cluster)


if __name__ == "__main__":
    main()
