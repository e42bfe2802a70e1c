"""What handing the logits back split saves: the Llama-3-style model of meta-pytorch/autoparallel's
example, scaled down (dim 512, 8 layers, vocab 128256, seq 2048, batch 16), planned on the meta
device for a (8, 8) mesh of A100s, with every output made whole on every rank (the default) and
with ``outputs="dtensor"`` (the logits stay in their planned layout, for a loss computed outside
the model, e.g. with ``loss_parallel``).

    python benchmarks/plan_outputs.py [--layers 8] [--time-limit 60]

Prints each plan's estimated step, its compute and exposed communication, what it spends
converting the outputs, the logits' placement, the memory per rank, and the solver's status and
optimality gap (under the time limit a loaded machine may stop it short of the optimum).
"""
import argparse
import sys
import time
import warnings

import torch

import autoshard
from plan_scale import CLUSTER, Llama


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = Llama(dim=512, layers=args.layers, vocab=128256, seq=2048)
    tokens = torch.empty(16, 2048, dtype=torch.long, device="meta")
    print(f"Llama-3-style, dim 512, {args.layers} layers, vocab 128256, seq 2048, batch 16, mesh (8, 8), {CLUSTER}")
    print(f"{'outputs':<9} {'step ms':>9} {'compute ms':>11} {'exposed comm ms':>16} {'outputs ms':>11} "
          f"{'logits':>12} {'GB/rank':>8} {'plan s':>7}  solver")
    for outputs in ("whole", "dtensor"):
        start = time.perf_counter()
        plan = autoshard.plan(model, (tokens,), mesh=(8, 8), cluster=CLUSTER, outputs=outputs,
                              time_limit=args.time_limit, verbose=False)
        took = time.perf_counter() - start
        b = plan.breakdown
        compute = b.get("compute_fwd", 0) + b.get("compute_bwd", 0)
        at_output = sum(c.seconds for c in plan.collectives if c.node == "output")
        logits = plan.placement(next(n.name for n in plan.nodes.values() if n.module == "output"))   # the head
        print(f"{outputs:<9} {plan.cost * 1e3:>9.2f} {compute * 1e3:>11.2f} {(plan.cost - compute) * 1e3:>16.2f} "
              f"{at_output * 1e3:>11.2f} {str(logits):>12} {plan.memory['total'] / 1e9:>8.2f} {took:>7.1f}  "
              f"{plan.solver['status'].lower()}, gap {100 * (plan.solver['gap'] or 0):.2f}%")


if __name__ == "__main__":
    sys.exit(main())
