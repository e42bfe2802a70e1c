"""autoshard's pipelined program against torch's own pipelining written by hand, on a local gloo group.

Both run the same stages of the same GPT (``tests/models.py``: 8 blocks, the head tied to the
embedding, cross-entropy inside forward) on ``torch.distributed.pipelining`` with the same
schedule and microbatches:

  autoshard  ``autoshard.parallelize(model, batch, pipeline=k)``: the planner cuts the model and
             each rank runs its stage's lowered program; ``loss = pm(*batch); loss.backward()``
  by hand    a ``PipelineStage`` per rank over a module written for its stage (the embedding on
             the first, the blocks it holds, the final norm and head on the last, the loss as the
             schedule's ``loss_fn``), the same blocks as autoshard's stages; the tied head's
             gradient summed between the first and last stage by one all-reduce, as it must be.
             With ``--virtual v`` each rank holds ``v`` such chunks (``r, r + k, ...``) and both
             run ``ScheduleInterleaved1F1B`` (autoshard: ``virtual=v``); ``--schedule`` names
             another of torch's for both (``InterleavedZeroBubble``)

A step is forward, backward, AdamW step and zero_grad; its time is the slowest rank's, from a
barrier to the end of zero_grad. Contenders are interleaved: each round runs one step of each in
an order shuffled anew (seeded by the round, the same on every rank); the first ``--warmup``
rounds are dropped. "ratio of medians" is autoshard's median step over the hand-written one's;
"median ratio" the median over rounds of the two steps' ratio in the same round (< 1: autoshard
is faster). Below: each contender's step-0 loss against the single-device model's.

    python benchmarks/pipeline.py                  # world 4, 4 stages, 8 microbatches
    python benchmarks/pipeline.py --rounds 40 --d 256 --seq 128
    python benchmarks/pipeline.py --virtual 2      # interleaved 1F1B, 2 chunks of a block per rank
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autoshard  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402


class HandStage(nn.Module):
    """What a user writes for one stage of the GPT: its part of the forward, by hand."""

    def __init__(self, gpt, blocks, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.emb, self.pos = gpt.emb, gpt.pos
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        if last:
            self.ln, self.head = gpt.ln, gpt.head

    def forward(self, x):
        if self.first:
            x = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)) if self.last else x


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _timed(step) -> float:
    dist.barrier()
    t = time.perf_counter()
    step()
    took = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def run(args) -> dict:
    from models import GPT
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, heads=args.heads, layers=8, seq=args.seq)
    one = copy.deepcopy(model)
    hand_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    with torch.no_grad():
        want = float(one(idx, tgt))

    t0 = time.perf_counter()
    pm = autoshard.parallelize(model, (idx, tgt), pipeline=dist.get_world_size(), microbatches=args.microbatches,
                               virtual=args.virtual, schedule=args.schedule, verbose=False,
                               cluster="a100-80gb-nvlink-ib")
    setup_auto = time.perf_counter() - t0
    rank, k = dist.get_rank(), dist.get_world_size()
    n = len(pm.plan.stages)
    t0 = time.perf_counter()
    mods = [HandStage(hand_model, [int(b.rpartition(".")[2]) for b in pm.plan.stages[c].blocks], c == 0, c == n - 1)
            for c in pm.chunks]
    stages = [PipelineStage(mod, c, n, torch.device("cpu")) for mod, c in zip(mods, pm.chunks)]
    kind = getattr(pipelining, "Schedule" + pm.plan.schedule)
    sched = kind(stages if len(stages) > 1 or pm.plan.schedule.startswith("Interleaved") else stages[0],
                 n_microbatches=pm.plan.microbatches, loss_fn=_loss)
    tie = dist.new_group([0, k - 1])
    ends = {pm.plan.stages[0].ranks[0], pm.plan.stages[-1].ranks[0]}
    setup_hand = time.perf_counter() - t0
    opt_auto = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    opt_hand = torch.optim.AdamW(list({id(p): p for mod in mods for p in mod.parameters()}.values()), lr=1e-4)
    seen = {}

    def step_auto():
        loss = pm(idx, tgt)
        loss.backward()
        seen.setdefault("auto", float(loss.detach()))
        opt_auto.step()
        opt_auto.zero_grad()

    def step_hand():
        losses = []
        sched.step(*((idx,) if rank == 0 else ()), target=tgt if rank == pm.plan.stages[-1].ranks[0] else None,
                   losses=losses)
        if ends == {0, k - 1} and rank in ends:   # the head tied to the embedding: both ends' gradients summed
            w = mods[0].emb.weight if rank == 0 else mods[-1].head.weight
            dist.all_reduce(w.grad, group=tie)   # (under ZB-V both ends are rank 0's, one parameter there)
        if losses:
            seen.setdefault("hand", float(torch.stack(losses).mean().detach()))
        opt_hand.step()
        opt_hand.zero_grad()

    times = {"autoshard": [], "by hand": []}
    contenders = [("autoshard", step_auto), ("by hand", step_hand)]
    for r in range(args.warmup + args.rounds):
        order = contenders[:]
        random.Random(r).shuffle(order)
        for name, fn in order:
            took = _timed(fn)
            if r >= args.warmup:
                times[name].append(took)
    return {"times": times, "want": want, "seen": seen, "setup": (setup_auto, setup_hand), "schedule": pm.plan.schedule,
            "plan": str(pm.plan) if rank == 0 else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--virtual", type=int, default=1, help="chunks per rank (> 1: interleaved 1F1B)")
    ap.add_argument("--schedule", default=None, help="torch's schedule for both, such as InterleavedZeroBubble")
    args = ap.parse_args()
    world = LocalWorld(args.world, timeout_s=600)
    try:
        results = world.run(run, args)
    finally:
        world.close()
    r0 = results[0]
    auto, hand = r0["times"]["autoshard"], r0["times"]["by hand"]
    ratios = [a / h for a, h in zip(auto, hand)]
    print(f"GPT 8 blocks d={args.d} seq={args.seq} batch={args.batch} vocab={args.vocab}, gloo world {args.world}, "
          f"{args.world} stages, {args.microbatches} microbatches, {r0['schedule']}, {args.rounds} rounds interleaved")
    print(f"{'contender':<12} {'median step':>12} {'min':>10} {'max':>10}")
    for name, ts in r0["times"].items():
        print(f"{name:<12} {statistics.median(ts) * 1e3:>10.2f}ms {min(ts) * 1e3:>8.2f}ms {max(ts) * 1e3:>8.2f}ms")
    print(f"ratio of medians (autoshard / by hand): {statistics.median(auto) / statistics.median(hand):.3f}; "
          f"median ratio: {statistics.median(ratios):.3f}")
    last = next(r for r in results if "hand" in r["seen"])   # the rank of the last stage (rank 0's under ZB-V)
    print(f"step-0 loss: one device {r0['want']:.6f}, autoshard {last['seen']['auto']:.6f}, "
          f"by hand {last['seen']['hand']:.6f}")
    print(f"set-up seconds (rank 0): autoshard {r0['setup'][0]:.1f} (plan, cut, capture, lower), "
          f"by hand {r0['setup'][1]:.1f}")
    print()
    print(r0["plan"])


if __name__ == "__main__":
    main()
