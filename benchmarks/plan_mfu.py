"""The largest GPTs at the largest worlds: plan time, the mesh chosen, the estimated step, memory
per rank against the budget, and the estimated model-FLOPs utilization beside the published
figures of the hand-designed systems (DESIGN.md section 8).

Each configuration is planned with mesh search on the meta device (no GPUs, no process group).
Model FLOPs per step are Megatron-LM's count for a GPT without recomputation,
72 B s l h^2 (1 + s / 6h + V / 12 l h) (Narayanan et al., SC'21), and the estimated MFU is
model FLOPs / (estimated step x world x the cluster's peak FLOP/s).

    python benchmarks/plan_mfu.py                       # GPT-3 175B at 1024, then the 24- and 96-layer GPTs
    python benchmarks/plan_mfu.py --only gpt3-175b
"""
import argparse
import time

import torch

import autoshard
from autoshard.planner.solve import MemoryBudgetError
from plan_gpt import GPT

# name: (layers, d, heads, seq, global batch, vocab, world)
CONFIGS = {
    "gpt3-175b": (96, 12288, 96, 2048, 1536, 50304, 1024),
    "gpt-24l": (24, 2048, 16, 2048, 512, 50304, 256),
    "gpt-96l": (96, 2048, 16, 2048, 1024, 50304, 1024),
}
PUBLISHED = "Megatron-LM about 45% of peak at 1024 GPUs, AxoNN 57% (DESIGN.md section 8)"


def model_flops(layers, d, seq, batch, vocab) -> float:
    """Megatron-LM's FLOPs of one training step of a GPT, without recomputation."""
    return 72 * batch * seq * layers * d * d * (1 + seq / (6 * d) + vocab / (12 * layers * d))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--cluster", default=None, help=f"cluster preset, one of {sorted(autoshard.PRESETS)}")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per solve")
    ap.add_argument("--recompute", nargs="+", choices=["auto", "none", "blocks", "selective"], default=["auto"],
                    help="plan each configuration with each of these recompute= modes, side by side")
    args = ap.parse_args()
    cluster = autoshard.api.resolve_cluster(args.cluster)
    print(f"cluster {cluster.name}: peak {cluster.peak_flops / 1e12:.0f} TFLOP/s, {cluster.memory / 1e9:.0f} GB per "
          f"device; published: {PUBLISHED}\n", flush=True)
    for name in args.only:
        layers, d, heads, seq, batch, vocab, world = CONFIGS[name]
        with torch.device("meta"):
            model = GPT(vocab, d, heads, layers, seq)
            inputs = (torch.zeros(batch, seq, dtype=torch.long), torch.zeros(batch, seq, dtype=torch.long))
        nparams = sum(p.numel() for p in model.parameters())
        print(f"{name}: {nparams / 1e9:.1f}B parameters, {layers} layers, d={d}, seq {seq}, batch {batch}, "
              f"world {world}", flush=True)
        for mode in args.recompute:
            start = time.perf_counter()
            try:
                plan = autoshard.plan(model, inputs, world=world, cluster=cluster, time_limit=args.time_limit,
                                      recompute=mode)
            except MemoryBudgetError as e:
                print(f"  recompute={mode!r}: no plan after {time.perf_counter() - start:.1f} s: {str(e)[:160]}...",
                      flush=True)
                continue
            seconds = time.perf_counter() - start
            mfu = model_flops(layers, d, seq, batch, vocab) / (plan.cost * world * cluster.peak_flops)
            r = plan.recompute
            again = r.get("blocks", [])
            what = (f"{len(again)} of {layers} blocks recomputed" + (" (their cheap ops only)" if r.get("selective") else "")
                    + (f": + {r['compute']:.3f} s compute, + {r['communication']:.3f} s communication, "
                       f"{r['freed'] / 1e9:.1f} GB not kept" if again else ""))
            print(f"  recompute={mode!r}: planned in {seconds:.1f} s; mesh {tuple(plan.mesh_shape)}; estimated step "
                  f"{plan.cost:.4f} s; estimated MFU {100 * mfu:.1f}%; memory per rank "
                  f"{plan.memory['total'] / 1e9:.1f} GB of {plan.memory['budget'] / 1e9:.0f} GB; "
                  f"{what}; solver {plan.solver.get('status')}", flush=True)


if __name__ == "__main__":
    main()
