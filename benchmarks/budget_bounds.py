"""The memory-bound lower bounds against the plans CP-SAT proves under them, for budgets that
bind: the check tests/test_scale.py makes on one budget (0.8 of the unbounded plan's memory),
here on the tighter ones too, whose solves take CP-SAT 20-30 s each on a 2-core machine (too
long for the suite, and up to their 60 s limit on a slower machine).

    python benchmarks/budget_bounds.py

For each budget: the quick bound, the exact bound (the least of the recompute modes'
relaxations), the plan's objective and the seconds each took; "ok" where quick <= exact <=
objective, as a bound must be.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from autoshard.cost import memory  # noqa: E402
from autoshard.cost.price import Costs  # noqa: E402
from autoshard.machine.cluster import Cluster  # noqa: E402
from autoshard.passes.annotate import annotate  # noqa: E402
from autoshard.passes.capture import capture  # noqa: E402
from autoshard.planner import recompute  # noqa: E402
from autoshard.planner.solve import lower_bound, solve  # noqa: E402
from models import GPT  # noqa: E402


def main():
    with torch.device("meta"):
        model = GPT(vocab=256, d=64, heads=2, layers=4, seq=32)
    idx = torch.zeros(16, 32, dtype=torch.long, device="meta")   # test_scale's GPT
    graph = capture(model, (idx, idx))
    mesh, cluster = (2, 4), Cluster.preset("a100-80gb-nvlink-ib")
    strategies = annotate(graph, mesh)
    need = memory.rank_memory(graph, strategies, solve(graph, strategies, Costs(graph, mesh, cluster, True), 60,
                                                       None).choice, mesh, True)["total"]
    print(f"GPT 4 layers d=64 at mesh {mesh}: the unbounded plan's memory {need / 1e6:.2f} MB per rank")
    print(f"{'budget':>8} {'quick':>12} {'exact':>12} {'objective':>12} {'quick s':>8} {'exact s':>8} {'solve s':>8}")
    for share in (0.8, 0.5, 0.4, 0.05):
        budget = need * share
        costs = Costs(graph, mesh, cluster, True, recompute=recompute.AUTO)
        t0 = time.perf_counter()
        quick = lower_bound(graph, strategies, costs, budget, quick=True)
        t1 = time.perf_counter()
        exact = lower_bound(graph, strategies, costs, budget)
        t2 = time.perf_counter()
        if math.isinf(exact):
            print(f"{share:>8} {quick:>12.6g} {exact:>12} {'nothing fits':>12} {t1 - t0:>8.2f} {t2 - t1:>8.2f}"
                  f" {'':>8}  {'ok' if math.isinf(quick) else 'VIOLATED'}")
            continue
        plan = solve(graph, strategies, costs, 60, budget)
        t3 = time.perf_counter()
        ok = quick <= exact <= plan.objective * (1 + 1e-6)
        print(f"{share:>8} {quick:>12.6g} {exact:>12.6g} {plan.objective:>12.6g} {t1 - t0:>8.2f} {t2 - t1:>8.2f}"
              f" {t3 - t2:>8.2f}  {'ok' if ok else 'VIOLATED'} ({plan.status})")


if __name__ == "__main__":
    main()
