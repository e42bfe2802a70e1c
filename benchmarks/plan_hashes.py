"""One hash per plan of the suite's golden and real models: each plan's mesh, placements,
parameters, collectives, cost, memory and recomputation (not its timings). A change that must
not move any plan (a renovation, a speed-up) prints the same lines before and after.

    python benchmarks/plan_hashes.py            # every model (about a minute on 2 cores)
    python benchmarks/plan_hashes.py --quick    # the small ones
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autoshard  # noqa: E402
from autoshard import schemes  # noqa: E402
from models import GPT, MLP, megatron_pins  # noqa: E402


def digest(plan) -> str:
    """The plan's decisions and prices, rounded to 12 significant digits."""
    d = json.loads(plan.to_json())
    kept = {k: d[k] for k in ("mesh_shape", "cost", "params", "collectives", "memory", "recompute", "breakdown")}
    kept["nodes"] = [(n["name"], n["inputs"], n["outputs"], n["compute"], n["comm"]) for n in d["nodes"]]
    kept["candidates"] = [(c["mesh"], c.get("bound"), c.get("cost"), c.get("status")) for c in d["mesh_candidates"]]
    text = json.dumps(kept, sort_keys=True, default=lambda x: f"{x:.12g}" if isinstance(x, float) else str(x))
    text = json.dumps(json.loads(text, parse_float=lambda s: f"{float(s):.12g}"), sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _meta_gpt(layers, d, heads, seq, batch, vocab):
    with torch.device("meta"):
        model = GPT(vocab=vocab, d=d, heads=heads, layers=layers, seq=seq)
    idx = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (idx, idx)


def _tiny_gpt():
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=2, seq=16)
    idx = torch.randint(0, 64, (8, 16))
    return model, (idx, idx)


def cases(quick: bool) -> dict:
    a100 = "a100-80gb-nvlink-ib"
    out = {
        "mlp (2, 2)": lambda: autoshard.plan(MLP(), (torch.randn(8, 32),), mesh=(2, 2)),
        "tiny gpt world 8": lambda: autoshard.plan(*_tiny_gpt(), world=8, verbose=False),
        "tiny gpt megatron (4,)": lambda: autoshard.plan(
            *_tiny_gpt(), mesh=(4,), pin=megatron_pins([f"blocks.{i}." for i in range(2)])),
        "tiny gpt fsdp (2, 2)": lambda: autoshard.plan(
            *_tiny_gpt(), mesh=(2, 2), pin=schemes.fsdp(*_tiny_gpt(), (2, 2))),
        "gpt block world 256": lambda: autoshard.plan(*_meta_gpt(1, 1024, 16, 1024, 256, 50304), world=256,
                                                      cluster=a100, verbose=False),
    }
    if not quick:
        budget = 80e9
        for name, cfg in {"golden small_model_large_batch": (1, 512, 8, 1024, 256, 1024),
                          "golden wide_model_small_batch": (1, 8192, 64, 32, 256, 1024),
                          "golden does_not_fit_replicated": (1, 24576, 192, 64, 256, 1024)}.items():
            out[name] = (lambda cfg=cfg: autoshard.plan(*_meta_gpt(*cfg), world=256, cluster=a100,
                                                        memory_budget=budget, time_limit=600, verbose=False))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small models only")
    args = parser.parse_args()
    for name, make in cases(args.quick).items():
        start = time.perf_counter()
        plan = make()
        print(f"{name:34s} {digest(plan)}  mesh {plan.mesh_shape}  {plan.cost * 1e3:.6f} ms  "
              f"({time.perf_counter() - start:.1f} s to plan)", flush=True)


if __name__ == "__main__":
    main()
