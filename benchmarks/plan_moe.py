"""Expert parallelism against experts kept whole: HuggingFace Mixtral with Mixtral-8x7B's layer
shape (hidden 4096, 8 experts of 14336, 2 per token, 32 heads over 8 key/value heads, vocab
32000), planned on the meta device for A100s (the default cluster), batch 8 x 2048 tokens.

    python benchmarks/plan_moe.py [--layers 1] [--mesh 8] [--mesh 2,4] [--time-limit 120]
    python benchmarks/plan_moe.py --world 64 --world 256      # the whole model, 32 layers

With ``--world``, the whole model (32 layers unless ``--layers`` says otherwise) is planned with
mesh search for each world, one sequence of 2048 tokens per device, trained as people train it
(bf16 compute over fp32 master weights, gradients reduced in fp32: torch's
``MixedPrecisionPolicy``), and printed beside two
references on the same world: pure data parallelism (``autoshard.schemes.data_parallel``: every
weight, experts included, whole on every rank; priced without a memory budget, since it does
not fit one) and the solver's plan on the chosen mesh with the expert weights pinned whole.
The expert-parallel degree is the number of ranks the experts are split over (the axes where
the expert weights are ``S(0)``).

For each mesh, three plans: the solver's under uniform routing, the solver's with every expert
weight pinned whole on every rank, stored and used (data parallelism with the experts
replicated, and tensor parallelism elsewhere), and the solver's when one expert gets 70% of the
tokens (``autoshard.expert_loads``). Prints the expert weights'
placement, the estimated step, the bytes each rank passes into all-to-alls per step and the
memory per rank.
"""
import argparse
import math
import time
import warnings

import torch
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard.passes.capture import capture
from autoshard.rules.moe import is_grouped_mm

UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def mixtral(layers: int):
    cfg = transformers.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    ids = torch.empty(8, 2048, dtype=torch.long, device="meta")
    return model, dict(input_ids=ids, labels=ids, use_cache=False)


def expert_degree(plan, mesh) -> int:
    """How many ranks the experts of the first layer are split over."""
    return math.prod(n for n, p in zip(mesh, plan.placement(UP)) if p == "S(0)")


def at_scale(worlds, layers, time_limit):
    """The whole model planned with mesh search per world, beside pure data parallelism and
    beside the experts kept whole on the chosen mesh."""
    model, _ = mixtral(layers)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    print(f"Mixtral-8x7B shape, {layers} layers, one sequence of 2048 tokens per device, bf16 over fp32 masters, A100 preset, "
          f"memory budget {autoshard.Cluster.preset(autoshard.machine.cluster.DEFAULT_CLUSTER).memory / 1e9:.1f} GB per rank")
    print(f"{'world':>5s} {'plan':34s} {'mesh':16s} {'experts':>7s} {'step':>10s} "
          f"{'memory/rank':>12s} {'':12s} {'planned in':>10s}")
    for world in worlds:
        ids = torch.empty(world, 2048, dtype=torch.long, device="meta")
        batch = dict(input_ids=ids, labels=ids, use_cache=False)
        graph = capture(model, batch)
        used = [graph.by_name[n.inputs[1][0]].name for n in graph.nodes
                if n.kind == "op" and is_grouped_mm(n.target)]
        weights = [w for w, _ in model.named_parameters() if ".mlp.experts." in w] + used
        start = time.perf_counter()
        best = autoshard.plan(model, batch, world=world, time_limit=time_limit, verbose=False, mp_policy=policy)
        rows = [("solver, mesh search", best, time.perf_counter() - start)]
        mesh = best.mesh_shape
        start = time.perf_counter()
        whole = autoshard.plan(model, batch, mesh=mesh, pin={w: ("B",) * len(mesh) for w in weights},
                               time_limit=time_limit, verbose=False, memory_budget=1e15, mp_policy=policy)
        rows.append(("solver, experts pinned whole (B)", whole, time.perf_counter() - start))
        start = time.perf_counter()
        dp = autoshard.plan(model, batch, mesh=(world,), pin=autoshard.schemes.data_parallel(model, batch, (world,)),
                            time_limit=time_limit, verbose=False, memory_budget=1e15, recompute="none",
                            mp_policy=policy)
        rows.append(("pure data parallel", dp, time.perf_counter() - start))
        for label, plan, seconds in rows:
            budget = best.memory["budget"]
            print(f"{world:5d} {label:34s} {str(plan.mesh_shape):16s} {expert_degree(plan, plan.mesh_shape):7d} "
                  f"{plan.cost * 1e3:8.1f} ms {plan.memory['total'] / 1e9:9.1f} GB "
                  f"{'fits' if plan.memory['total'] <= budget else 'does not fit':12s} {seconds:8.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="default 1, or 32 with --world")
    ap.add_argument("--world", type=int, action="append", default=None,
                    help="plan the whole model with mesh search for this many devices (repeatable)")
    ap.add_argument("--mesh", action="append", default=None, help="a mesh shape such as 8 or 2,4 (repeatable)")
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.world:
        return at_scale(args.world, args.layers or 32, args.time_limit)
    args.layers = args.layers or 1
    meshes = [tuple(int(n) for n in m.split(",")) for m in (args.mesh or ["8", "2,4"])]
    model, batch = mixtral(args.layers)
    graph = capture(model, batch)
    used = [graph.by_name[n.inputs[1][0]].name for n in graph.nodes if n.kind == "op" and is_grouped_mm(n.target)]
    skewed = {w: [7] + [3 / 7] * 7 for w in (UP, DOWN)}   # one expert 70% of the tokens
    print(f"Mixtral-8x7B layer shape, {args.layers} layer(s), batch 8 x 2048, A100 preset")
    print(f"{'plan':28s} {'mesh':8s} {'experts':18s} {'step':>10s} {'all-to-all':>12s} {'memory/rank':>12s} {'planned in':>10s}")
    for mesh in meshes:
        whole = {name: ("B",) * len(mesh) for name in [UP, DOWN] + used}   # the weights and their views fed in
        for label, pin, loads in (("solver, uniform routing", None, None), ("experts replicated (B)", whole, None),
                                  ("solver, one expert 70%", None, skewed)):
            start = time.perf_counter()
            if loads:
                with autoshard.expert_loads(model, loads):
                    plan = autoshard.plan(model, batch, mesh=mesh, pin=pin, time_limit=args.time_limit, verbose=False)
            else:
                plan = autoshard.plan(model, batch, mesh=mesh, pin=pin, time_limit=args.time_limit, verbose=False)
            seconds = time.perf_counter() - start
            a2a = sum(c.bytes for c in plan.collectives if c.kind == "all_to_all")
            print(f"{label:28s} {str(mesh):8s} {str(plan.placement(UP)):18s} {plan.cost * 1e3:8.1f} ms "
                  f"{a2a / 2**20:9.1f} MiB {plan.memory['total'] / 2**30:8.1f} GiB {seconds:8.0f} s", flush=True)


if __name__ == "__main__":
    main()
