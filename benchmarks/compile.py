"""Compiled autoshard (``parallelize(..., compile=True)``) against eager autoshard, compiled DDP and
compiled FSDP2, on a local gloo group of this CPU (inductor's C++ backend).

Contenders, every one from the same weights on the same global batch:

  as-eager       autoshard pinned data parallel (the batch split, every parameter whole), eager
  as-compiled    the same, ``compile=True`` (passes.compile)
  as-mt-eager    autoshard pinned Megatron (``schemes.megatron``), eager        (``--megatron``)
  as-mt-compiled the same, ``compile=True``                                     (``--megatron``)
  as-fsdp-eager  autoshard pinned FSDP (``schemes.fsdp``), eager                (``--fsdp``)
  as-fsdp-compiled the same, ``compile=True``                                   (``--fsdp``)
  as-compiled-inorder, as-mt-compiled-inorder, as-fsdp-compiled-inorder  compiled without inductor's comm reordering passes
                 (``_compat.comm_overlap_options``), in the order inductor keeps by default (``--inorder``)
  as-user-compiled ``torch.compile(parallelize(...))`` of the data-parallel one: the user's own
                 compile of the parallel module, which compiles its program      (``--user``)
  as-user-method ``module.compile()`` of the same (nn.Module's, which the parallel module overrides:
                 each program compiled as ``compile=True`` compiles it)          (``--user``)
  ddp-compiled   ``torch.compile(DistributedDataParallel(model))``, each rank its share of the batch
  ddp-compiled-logged  the same, and each step ends with the ranks' losses averaged (one all-reduce of the
                 loss), as a user logging the loss every step writes: the loss autoshard's module returns,
                 where DDP's is each rank's own                                   (``--logged``)
  fsdp2-compiled ``fully_shard`` on each block and the root, then ``torch.compile``, each rank its share

A step is forward (the loss), backward, SGD step, zero_grad. The first step of each contender (its
compile, for the compiled ones; planning is done before) is timed apart and reported as its
compile seconds. Then rounds: each runs one step of every contender, in an order shuffled anew
(seeded by the round, the same on every rank); a step's time is the slowest rank's, from a barrier
to the end of zero_grad; with ``--steps N`` each contender runs N steps back to back in a round, and
the round takes their median (a small model's steps spread by a factor of 3 on a shared CPU); the
first ``--warmup`` rounds are dropped; medians after, and the ratio of lower quartiles (the fast half's
steps: a small model's steps on a shared CPU are bimodal, and the median sits at the edge). ``--pin`` puts each rank's process on a core of
its own, as each rank has its own device and cores on a GPU machine: unpinned, the ranks' collective
threads take turns on both cores, and a run's medians move by 10-20% from run to run. ``--guards``
also reports, per compiled contender, the guard trees dynamo built on its first step (lines,
checks run in Python) and the time one call's check takes (rank 0, warm, interleaved rounds of
200 checks each, median), the part of each call spent before the compiled code runs.

    python benchmarks/compile.py                 # world 2, the small GPT, 20 rounds
    python benchmarks/compile.py --megatron --rounds 30 --d 128
    python benchmarks/compile.py --only as-eager as-mt-eager --megatron   # eager alone (before/after a change)
    python benchmarks/compile.py --only as-compiled ddp-compiled --profile 15   # where a step's time goes
    python benchmarks/compile.py --user --guards --only as-user-compiled as-user-method ddp-compiled
    python benchmarks/compile.py --megatron --inorder --only as-eager as-compiled as-compiled-inorder \
        as-mt-eager as-mt-compiled as-mt-compiled-inorder     # what the comm passes gain
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/tests")


def _model(a):
    from models import GPT
    torch.manual_seed(0)
    model = GPT(vocab=a.vocab, d=a.d, heads=a.heads, layers=a.layers, seq=a.seq)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    return model, (idx, torch.roll(idx, -1, dims=1))


def _share(batch):
    r, w = dist.get_rank(), dist.get_world_size()
    n = batch[0].shape[0]
    return tuple(x[r * n // w:(r + 1) * n // w] for x in batch)


def _contenders(a) -> dict:
    import autoshard
    base, batch = _model(a)
    dp_pin = {"idx": ("S(0)",), "targets": ("S(0)",), **{n: ("B",) for n, _ in base.named_parameters()}}
    made = {}

    def ours(pin, compile):
        m = copy.deepcopy(base)
        return autoshard.parallelize(m, batch, pin=pin, verbose=False, compile=compile), batch

    def inorder(pin):   # compiled (at parallelize, given the batch) with inductor's default order
        from unittest import mock

        from autoshard.passes import compile as passes_compile
        with mock.patch.object(passes_compile, "comm_overlap_options", dict):
            return ours(pin, True)

    made["as-eager"] = lambda: ours(dp_pin, False)
    made["as-compiled"] = lambda: ours(dp_pin, True)
    if a.inorder:
        made["as-compiled-inorder"] = lambda: inorder(dp_pin)
    if a.megatron:
        mt_pin = autoshard.schemes.megatron(base, batch, (dist.get_world_size(),))
        made["as-mt-eager"] = lambda: ours(mt_pin, False)
        made["as-mt-compiled"] = lambda: ours(mt_pin, True)
        if a.inorder:
            made["as-mt-compiled-inorder"] = lambda: inorder(mt_pin)
    if a.fsdp:
        fsdp_pin = autoshard.schemes.fsdp(base, batch, (dist.get_world_size(),))
        made["as-fsdp-eager"] = lambda: ours(fsdp_pin, False)
        made["as-fsdp-compiled"] = lambda: ours(fsdp_pin, True)
        if a.inorder:
            made["as-fsdp-compiled-inorder"] = lambda: inorder(fsdp_pin)
    if a.user:
        made["as-user-compiled"] = lambda: (torch.compile(ours(dp_pin, False)[0]), batch)

        def method():
            m = ours(dp_pin, False)[0]
            m.compile()
            return m, batch
        made["as-user-method"] = method

    def ddp():
        from torch.nn.parallel import DistributedDataParallel
        return torch.compile(DistributedDataParallel(copy.deepcopy(base))), _share(batch)

    def ddp_logged():   # the loss autoshard returns: each rank's loss averaged, once the step is done
        model, inputs = ddp()
        return model, inputs, _global_loss

    def fsdp2():
        from torch.distributed.fsdp import fully_shard
        m = copy.deepcopy(base)
        for blk in m.blocks:
            fully_shard(blk)
        fully_shard(m)
        return torch.compile(m), _share(batch)

    made["ddp-compiled"], made["fsdp2-compiled"] = ddp, fsdp2
    if a.logged:
        made["ddp-compiled-logged"] = ddp_logged
    return {n: f for n, f in made.items() if not a.only or n in a.only}


def _global_loss(loss: torch.Tensor) -> torch.Tensor:
    """What a DDP user logging every step adds: the ranks' losses averaged (the loss of the global
    batch, the one autoshard's module returns), after the optimizer's step."""
    loss = loss.clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def _timed(fn) -> float:
    """The slowest rank's seconds for ``fn()``, from a barrier."""
    dist.barrier()
    t = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _guard_costs(guards: dict, rounds: int = 15, calls: int = 200) -> dict:
    """Per contender: its guard trees' lines, the checks among them evaluated in Python
    (``LAMBDA_GUARD``: a DTensor's spec, an object reached by two paths), and the median
    microseconds one call spends checking them all, over interleaved rounds."""
    times = {n: [] for n in guards}
    for r in range(rounds):
        order = sorted(guards)
        random.Random(r).shuffle(order)
        for name in order:
            t = time.perf_counter()
            for _ in range(calls):
                for manager, scope in guards[name]:
                    manager.check(scope)
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    out = {}
    for name, built in guards.items():
        trees = [str(manager) for manager, _ in built]
        out[name] = {"frames": len(trees), "lines": sum(len(t.splitlines()) for t in trees),
                     "python": sum(t.count("LAMBDA_GUARD") for t in trees), "us": statistics.median(times[name])}
    return out


def run(a) -> dict:
    from autoshard._compat import guards_built
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if a.pin:   # this rank's process on one core: its collectives' threads beside its own compute
        os.sched_setaffinity(0, {dist.get_rank() % os.cpu_count()})
    built, errors, compile_s, first_loss, guards = {}, {}, {}, {}, {}
    for name, make in _contenders(a).items():
        try:
            model, inputs, *log = make()
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)

            def step(model=model, inputs=inputs, opt=opt, log=log[0] if log else None):
                loss = model(*inputs)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.detach() if log is None else log(loss.detach())

            with guards_built([]) as trees:
                compile_s[name] = _timed(step)   # the first step: compiles (autoshard: plans were made above)
            built[name] = step
            if a.guards and trees:
                guards[name] = trees
        except Exception as e:  # noqa: BLE001 - a contender that cannot run here says why in its row
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    times = {n: [] for n in built}
    for r in range(a.warmup + a.rounds):
        order = sorted(built)
        random.Random(r).shuffle(order)
        for name in order:
            t = statistics.median(_timed(built[name]) for _ in range(a.steps))
            if r >= a.warmup:
                times[name].append(t)
    profiles = {}
    if a.profile:   # rank 0's busiest ops over a few more steps of each contender, after the rounds
        from torch.profiler import ProfilerActivity, profile
        for name in sorted(built):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    built[name]()
            profiles[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile)
    return {"times": times, "compile_s": compile_s, "errors": errors, "profiles": profiles,
            "guards": _guard_costs(guards) if guards else {}}


def _lower_quartile(times: list) -> float:
    """The time a quarter of the rounds beat: on a shared CPU a small model's steps are bimodal (a
    fast half, then a slow one spread by a factor of 2), and the median sits where the slow half
    starts, so a ratio of medians moves by 0.1 from run to run where this one holds."""
    return statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]


def report(a, res):
    for name, table in res.get("profiles", {}).items():
        print(f"{name}, rank 0, 5 steps:\n{table}")
    med = {n: statistics.median(t) * 1e3 for n, t in res["times"].items()}
    print(f"GPT d={a.d}, {a.heads} heads, {a.layers} blocks, vocab {a.vocab}, batch {a.batch} x {a.seq}; gloo world "
          f"{a.world}, {a.rounds} rounds after {a.warmup}, {a.steps} step(s) a contender a round (medians, the "
          f"slowest rank's)\n")
    print("| contender | ms/step | first step (compile) s |")
    print("|---|---|---|")
    for n in sorted(set(med) | set(res["errors"])):
        if n in med:
            print(f"| {n} | {med[n]:.2f} | {res['compile_s'][n]:.1f} |")
        else:
            print(f"| {n} | not run: {res['errors'][n]} | |")
    print()
    if res.get("guards"):
        print("| contender | frames | guard tree lines | checks in Python | us per call's check (rank 0) |")
        print("|---|---|---|---|---|")
        for n, g in sorted(res["guards"].items()):
            print(f"| {n} | {g['frames']} | {g['lines']} | {g['python']} | {g['us']:.1f} |")
        print()
    pairs = [("as-compiled", "as-eager"), ("as-mt-compiled", "as-mt-eager"), ("as-compiled-inorder", "as-eager"),
             ("as-mt-compiled-inorder", "as-mt-eager"), ("as-compiled", "as-compiled-inorder"),
             ("as-mt-compiled", "as-mt-compiled-inorder"), ("as-fsdp-compiled", "as-fsdp-eager"), ("as-fsdp-compiled-inorder", "as-fsdp-eager"),
             ("as-fsdp-compiled", "as-fsdp-compiled-inorder"),
             ("as-user-compiled", "as-eager"), ("as-compiled", "ddp-compiled"), ("as-compiled", "ddp-compiled-logged"),
             ("ddp-compiled-logged", "ddp-compiled"), ("as-user-method", "ddp-compiled-logged"), ("as-user-compiled", "ddp-compiled"),
             ("as-user-method", "ddp-compiled"), ("as-user-method", "as-user-compiled"),
             ("as-fsdp-compiled", "fsdp2-compiled")]
    for x, y in pairs:
        if x in med and y in med:
            per_round = statistics.median(p / q for p, q in zip(res["times"][x], res["times"][y]))
            fast = _lower_quartile(res["times"][x]) / _lower_quartile(res["times"][y])
            print(f"{x} / {y}: {med[x] / med[y]:.3f} (ratio of medians), {per_round:.3f} (median ratio), "
                  f"{fast:.3f} (ratio of lower quartiles)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=1,
                   help="steps each contender runs back to back in a round; its time in the round is their median")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--megatron", action="store_true", help="also autoshard pinned Megatron, eager and compiled")
    p.add_argument("--fsdp", action="store_true", help="also autoshard pinned FSDP, eager and compiled")
    p.add_argument("--inorder", action="store_true", help="also compiled without inductor's comm reordering passes")
    p.add_argument("--user", action="store_true", help="also the user's own torch.compile of the data-parallel module")
    p.add_argument("--logged", action="store_true",
                   help="also compiled DDP that averages the ranks' losses after each step (the loss autoshard returns)")
    p.add_argument("--pin", action="store_true",
                   help="each rank's process on a core of its own (its collectives' threads then share it)")
    p.add_argument("--guards", action="store_true",
                   help="also the compiled contenders' guard trees and the time a call spends checking them")
    p.add_argument("--only", nargs="+", help="run only these contenders")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print rank 0's N busiest ops of each contender over 5 more steps")
    a = p.parse_args()
    from autoshard.testing.launch import LocalWorld
    with LocalWorld(a.world, timeout_s=1800) as world:
        res = world.run(run, a)[0]
    report(a, res)


if __name__ == "__main__":
    main()
