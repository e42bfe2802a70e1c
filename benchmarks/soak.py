"""A long run stays flat: a GPT trained for many steps on a local gloo group (AdamW, a new batch
each step, the default plan or a pinned one), printing for each rank its resident memory after the
warm-up and at the end, and the step time over the first and second half of the steps after the
warm-up (median, and the 10th-90th percentile spread); then ``parallelize`` called 20 times in the
same processes, printing the process groups, threads, open files and resident memory each rank
holds before and after.

A step is zero_grad, forward, backward and the optimizer step, timed on each rank from a barrier;
resident memory is the process's resident set (/proc/self/statm), read every 10 steps.

    python benchmarks/soak.py [--world 4] [--steps 200] [--warmup 20] [--scheme default|megatron]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard import schemes
from autoshard.testing.launch import LocalWorld

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from models import GPT, MLP  # noqa: E402

MIB = 2 ** 20


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held() -> tuple:
    from torch.distributed import distributed_c10d   # the groups this process holds, by torch's count
    return len(distributed_c10d._world.pg_map), threading.active_count(), len(os.listdir("/proc/self/fd"))


def batch(step, rows=8, seq=64, vocab=256):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g)


def soak(steps, warmup, scheme):
    torch.manual_seed(0)
    model = GPT(vocab=256, d=64, heads=4, layers=4, seq=64)
    pin = None if scheme == "default" else getattr(schemes, scheme)(model, batch(0), (dist.get_world_size(),))
    pm = autoshard.parallelize(model, batch(0), pin=pin, time_limit=20)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    times, memory = [], {}
    for step in range(steps):
        x, y = batch(step)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        pm(x, y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if step % 10 == 0 or step == steps - 1:
            memory[step] = resident()
    return times, memory


def again(times):
    """parallelize 20 times (one plan, made first); what the process holds before and after."""
    x = torch.randn(8, 32)
    first = autoshard.parallelize(MLP(), (x,), mesh=(2, dist.get_world_size() // 2), time_limit=10)
    first(x).sum().backward()
    before = (*held(), resident())
    for _ in range(times):
        pm = autoshard.parallelize(MLP(), (x,), plan=first.plan)
        pm(x).sum().backward()
    return before, (*held(), resident())


def spread(xs):
    q = statistics.quantiles(xs, n=10)
    return statistics.median(xs) * 1e3, q[0] * 1e3, q[-1] * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--scheme", default="default", choices=["default", "megatron"])
    args = ap.parse_args()
    if args.warmup % 10 or args.steps <= args.warmup + 20:
        ap.error("--warmup is a multiple of 10, and --steps at least 20 more than it")
    with LocalWorld(args.world, timeout_s=600) as world:
        runs = world.run(soak, args.steps, args.warmup, args.scheme)
        print(f"{args.steps} steps at world {args.world}, GPT d=64 x 4 blocks, batch 8 x 64, AdamW, "
              f"plan: {args.scheme}; warm-up {args.warmup} steps\n")
        half = args.warmup + (args.steps - args.warmup) // 2
        print(f"{'rank':>4}  {'RSS after warm-up':>17}  {'RSS at end':>10}  {'growth':>8}  "
              f"{'step ms, first half':>26}  {'step ms, second half':>26}")
        for rank, (times, memory) in enumerate(runs):
            first, last = memory[args.warmup], memory[args.steps - 1]
            a, b = spread(times[args.warmup:half]), spread(times[half:])
            print(f"{rank:>4}  {first / MIB:>13.1f} MiB  {last / MIB:>6.1f} MiB  {(last - first) / MIB:>+4.1f} MiB  "
                  f"{a[0]:>8.2f} (p10 {a[1]:.2f}, p90 {a[2]:.2f})  {b[0]:>8.2f} (p10 {b[1]:.2f}, p90 {b[2]:.2f})")
        print("\nRSS every 10 steps after warm-up, rank 0 (MiB):",
              " ".join(f"{v / MIB:.1f}" for k, v in sorted(runs[0][1].items()) if k >= args.warmup))
        if args.world >= 4 and args.world % 2 == 0:
            print(f"\nparallelize 20 times on mesh (2, {args.world // 2}) after a first call: "
                  "(process groups, threads, open files, RSS MiB) before -> after")
            for rank, (before, after) in enumerate(world.run(again, 20)):
                show = lambda h: f"({h[0]}, {h[1]}, {h[2]}, {h[3] / MIB:.1f})"  # noqa: E731
                print(f"  rank {rank}: {show(before)} -> {show(after)}")


if __name__ == "__main__":
    main()
