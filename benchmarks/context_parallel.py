"""Context parallelism measured: one long sequence (batch 1) through the causal GQA decoder with
rotary embeddings of tests/test_context_parallel.py, on a local gloo group, world 2 and 4.

Contenders, each a training step (forward of the loss, backward, zero_grad; no optimizer step, so
every contender starts every round from the same weights):

  torch TP     the baseline: what torch offers for one sequence on CPUs. torch's own context
               parallelism (``torch.distributed.tensor.experimental.context_parallel``) refuses
               CPUs: the script tries it first and prints its error. DTensor tensor parallelism
               (``parallelize_module``: ColwiseParallel on wq, wk, wv, w1, w3; RowwiseParallel on
               wo, w2; each rank its share of the heads, as torchtitan sets them) splits one
               sequence's work without a batch to split
  cp gather    autoshard pinned ``schemes.context_parallel(form="allgather")``: the sequence split,
               keys and values gathered whole for attention (Llama 3's form)
  cp ring      the same pinned ``form="ring"``: keys and values passed round the ring
  gather bal,  the two, their causal work balanced whatever the cost model says
  ring bal     (``plan.schedule["balanced_attention"]``: each rank a head and a tail of the queries)
  autoshard    ``autoshard.parallelize(model, batch)``: the plan autoshard chooses itself

Rounds interleave the contenders (an order shuffled anew each round, the same on every rank); a
step's time is the slowest rank's, from a barrier; medians after the warm-up rounds. Printed: ms
per step and the ratio of each median over torch TP's (< 1: faster than torch), and each
contender's first loss against one device's.

With ``--mask window`` (or ``causal+window``) the decoder's attention takes a sliding-window mask
(bool (L, S), the last ``--window`` keys: causal built into it, or beside ``is_causal``), made in
forward (tests/test_context_mask.py's model): the ring cuts each block's columns from it, the
all-gather form attends its rows to every key.

With ``--blocks`` it times ring attention alone (``runtime.ring_attention``, forward and
backward, 8 heads, 4 key/value heads, head dim 32) with a sliding-window mask beside
``is_causal``, the blocks that no query of a rank may see skipped (as it runs) against computed
(the skip turned off), interleaved, medians of the slowest rank.

With ``--sweep`` it runs nothing: it plans, on the meta device for the ``--cluster`` preset, the
issue's model (causal GQA, 32 heads, 8 key/value heads, d 4096, SwiGLU 14336, 4 layers, vocab
32000, batch 1) for sequences of 32k to 1M tokens on 8 to 1,024 devices, and prints each plan's
mesh, how its attention lays out queries and keys (all-gather form: keys ``B`` where the queries
are ``S(2)``; ring: ``S(2)`` too), and its step and memory per rank: cost-model estimates.

    python benchmarks/context_parallel.py                    # worlds 2 and 4
    python benchmarks/context_parallel.py --worlds 2 --seq 512 --rounds 6
    python benchmarks/context_parallel.py --mask window --window 256
    python benchmarks/context_parallel.py --blocks --seq 4096 --window 512
    python benchmarks/context_parallel.py --sweep            # plans only (about a minute)
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autoshard  # noqa: E402
from autoshard import schemes  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402
from test_context_mask import MaskedLlama  # noqa: E402
from test_context_parallel import GqaLlama  # noqa: E402

NAMES = ("torch TP", "cp gather", "cp ring", "gather bal", "ring bal", "autoshard")


def _model(a):
    torch.manual_seed(0)
    sizes = dict(vocab=a.vocab, d=a.d, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, layers=a.layers, hidden=a.hidden)
    model = GqaLlama(**sizes) if a.mask == "none" else MaskedLlama(a.mask, window=a.window, **sizes)
    idx = torch.randint(0, a.vocab, (1, a.seq))
    return model, (idx, torch.roll(idx, -1, dims=1))


def torch_cp_refusal(a) -> str:
    """What torch's own context parallelism says on this machine, or "" where it runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    model, (idx, tgt) = _model(a)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        buffers = [idx, tgt] + [attn.freqs_cis for attn in model.attn]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1] + [0] * len(model.attn)):
            model(idx, tgt).backward()
        return ""
    except Exception as e:   # noqa: BLE001 - reported, and the baseline taken instead
        return "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]


def _torch_tp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    w = dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    plan = {}
    for i, attn in enumerate(model.attn):
        plan.update({f"attn.{i}.wq": ColwiseParallel(), f"attn.{i}.wk": ColwiseParallel(),
                     f"attn.{i}.wv": ColwiseParallel(), f"attn.{i}.wo": RowwiseParallel(),
                     f"w1.{i}": ColwiseParallel(), f"w3.{i}": ColwiseParallel(), f"w2.{i}": RowwiseParallel()})
        attn.heads //= w
        attn.kv_heads //= w
    return parallelize_module(model, mesh, plan)


def build(name, a, model, batch):
    model = copy.deepcopy(model)
    if name == "torch TP":
        return _torch_tp(model)
    w = dist.get_world_size()
    if name == "autoshard":
        return autoshard.parallelize(model, batch, world=w, verbose=False)
    form = "allgather" if name in ("cp gather", "gather bal") else "ring"
    plan = autoshard.plan(model, batch, mesh=(w,), verbose=False,
                          pin=schemes.context_parallel(model, batch, (w,), form=form))
    if name.endswith("bal"):
        attention = [n for n, c in plan.nodes.items() if c.op.startswith("scaled_dot_product_attention")]
        plan = dataclasses.replace(plan, schedule={**plan.schedule, "balanced_attention": attention})
    return autoshard.parallelize(model, batch, plan=plan)


def run_world(a):
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    refusal = torch_cp_refusal(a)
    model, batch = _model(a)
    ref = model(*batch).item()
    built, plans = {}, {}
    for n in NAMES:
        built[n] = build(n, a, model, batch)
        if hasattr(built[n], "plan"):
            p = built[n].plan
            sdpa = [c for c in p.nodes.values() if c.op.startswith("scaled_dot_product_attention")]
            balanced = len(p.schedule.get("balanced_attention", ()))
            plans[n] = (f"mesh {tuple(p.mesh_shape)}, attention {sdpa[0].inputs} -> {sdpa[0].outputs}, "
                        f"{balanced} of {len(sdpa)} balanced") if sdpa else ""
    times = {n: [] for n in NAMES}
    first = {}
    for r in range(a.warmup + a.rounds):
        for n in random.Random(r).sample(NAMES, len(NAMES)):
            dist.barrier()
            t0 = time.perf_counter()
            loss = built[n](*batch)
            loss.backward()
            for p in built[n].parameters():
                p.grad = None
            times[n].append(time.perf_counter() - t0)
            first.setdefault(n, loss.item())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    slowest = {n: [max(t[n][s] for t in gathered) for s in range(a.warmup, a.warmup + a.rounds)] for n in NAMES}
    return {"times": slowest, "first": first, "ref": ref, "refusal": refusal, "plans": plans}


def report(w, res, a):
    mask = "" if a.mask == "none" else f", mask {a.mask} (window {a.window})"
    print(f"\nworld {w}: one sequence of {a.seq} tokens, d {a.d}, {a.heads} heads, {a.kv_heads} kv heads, "
          f"{a.layers} layers{mask}; {a.rounds} rounds after {a.warmup} warm-up, medians of the slowest rank")
    if res["refusal"]:
        print(f"  torch's context_parallel on CPU/gloo refuses: {res['refusal']}")
    base = statistics.median(res["times"]["torch TP"])
    print(f"  {'contender':<11} {'ms/step':>9} {'vs torch TP':>12}  {'loss - one device':>18}")
    for n in NAMES:
        m = statistics.median(res["times"][n])
        print(f"  {n:<11} {1e3 * m:>9.1f} {m / base:>12.3f}  {res['first'][n] - res['ref']:>18.2e}")
    for n, text in res["plans"].items():
        print(f"  {n}: {text}")


def run_blocks(a):
    """Ring attention with a window mask: hidden blocks skipped against computed, interleaved."""
    import autoshard.runtime.attention as ring
    from torch.distributed.device_mesh import init_device_mesh
    from autoshard.runtime.mesh import RankMesh, active
    torch.set_num_threads(a.threads)
    p, r = dist.get_world_size(), dist.get_rank()
    mesh, n = RankMesh(init_device_mesh("cpu", (p,)), torch.Generator()), a.seq // p
    torch.manual_seed(r)
    q = torch.randn(1, 8, n, 32, requires_grad=True)
    k, v = (torch.randn(1, 4, n, 32, requires_grad=True) for _ in range(2))
    rows, keys = torch.arange(r * n, (r + 1) * n)[:, None], torch.arange(a.seq)[None]
    window = keys > rows - a.window
    starts = tuple(((c,), c * n) for c in range(p))
    skip, times = ring._hidden, {"skipped": [], "computed": []}
    for rd in range(a.warmup + a.rounds):
        for name in random.Random(rd).sample(sorted(times), 2):
            ring._hidden = skip if name == "skipped" else (lambda mask, block: False)
            dist.barrier()
            t0 = time.perf_counter()
            with active(mesh):
                out = ring.ring_attention(q, k, v, None, True, r * n, starts, (0,), None, window)
            out.sum().backward()
            took = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rd >= a.warmup:
                times[name].append(took.item())
    ring._hidden = skip
    return {n: statistics.median(t) for n, t in times.items()}


def sweep(a):
    seqs = [int(x) for x in a.sweep_seqs.split(",")]
    worlds = [int(x) for x in a.sweep_worlds.split(",")]
    print(f"planned for {a.cluster}, batch 1; step and memory are the cost model's estimates")
    print(f"  {'tokens':>8} {'devices':>7}  {'mesh':<16} {'attention q / k':<24} {'form':<9} {'step ms':>9} "
          f"{'GB/rank':>8} {'plan s':>6}")
    for seq in seqs:
        for w in worlds:
            with torch.device("meta"):
                model = GqaLlama(vocab=32000, d=4096, heads=32, kv_heads=8, seq=seq, layers=4, hidden=14336)
            idx = torch.empty(1, seq, dtype=torch.long, device="meta")
            t0 = time.perf_counter()
            try:
                plan = autoshard.plan(model, (idx, idx), world=w, cluster=a.cluster, verbose=False)
            except ValueError as e:   # the memory budget's error says what the least layout needs
                least = str(e).split("the least it can reach is ")[-1].split(" (")[0]
                print(f"  {seq:>8} {w:>7}  no plan fits in the memory budget (the least needs {least} per rank)")
                continue
            took = time.perf_counter() - t0
            sd = next(n for n in plan.nodes.values() if n.op.startswith("scaled_dot_product_attention"))
            q, k = sd.inputs[0], sd.inputs[1]
            split = [ax for ax, p in enumerate(q) if p == "S(2)" and plan.mesh_shape[ax] > 1]
            kinds = {"ring" if k[ax] == "S(2)" else "all-gather" for ax in split}
            form = "none" if not split else "+".join(sorted(kinds))
            print(f"  {seq:>8} {w:>7}  {str(tuple(plan.mesh_shape)):<16} {'/'.join(map(''.join, (q, k))):<24} "
                  f"{form:<9} {1e3 * plan.cost:>9.1f} {plan.memory.get('total', 0) / 1e9:>8.2f} {took:>6.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mask", default="none", choices=("none", "window", "causal+window"))
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--blocks", action="store_true", help="ring attention alone, window mask: hidden blocks skipped or not")
    ap.add_argument("--sweep", action="store_true", help="plan the issue's model for long sequences, run nothing")
    ap.add_argument("--sweep-seqs", default="32768,131072,1048576")
    ap.add_argument("--sweep-worlds", default="8,64,1024")
    ap.add_argument("--cluster", default="a100-80gb-nvlink-ib")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a)
    if a.blocks:
        for w in map(int, a.worlds.split(",")):
            with LocalWorld(w) as world:
                res = world.run(run_blocks, a)[0]
            print(f"world {w}, {a.seq} tokens, window {a.window}, causal: ring attention with the hidden blocks "
                  f"computed {1e3 * res['computed']:.1f} ms, skipped {1e3 * res['skipped']:.1f} ms "
                  f"({res['skipped'] / res['computed']:.2f})")
        return
    for w in map(int, a.worlds.split(",")):
        with LocalWorld(w) as world:
            report(w, world.run(run_world, a)[0], a)


if __name__ == "__main__":
    main()
