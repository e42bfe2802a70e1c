"""examples/train.py's training, autoshard against FSDP2 written by hand, on a local gloo group.

Both train the example's small Llama (Meta's RMSNorm, rotary embeddings, SwiGLU) under the same
bf16 policy (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), fp32 masters and
AdamW, each rank feeding its own rows from a ``DistributedSampler`` as a torchrun script does:

  autoshard  ``parallelize(model, example, inputs="local", mp_policy=POLICY, cluster=...)``
  FSDP2      ``fully_shard`` on each block, then on the root, with the same policy

Contenders are interleaved: each round runs one step of each on the same rows, in an order
shuffled anew each round (the same on every rank); a step is timed from a barrier to the end of
zero_grad, as the slowest rank's; the first ``--warmup`` rounds are dropped; medians.

Before the steps, what a start costs autoshard: a first start in an empty cache directory (the
machine measured, the plan made, both kept on disk), a restart on a fresh copy of the model (both
read back), and a resume: a restart and a DCP load of a checkpoint the first module saved. The
first step of each module is timed apart.

    python benchmarks/train_example.py                 # world 4, 40 rounds
    python benchmarks/train_example.py --world 2 --rounds 20 --dim 128
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train as example  # noqa: E402 - examples/train.py: the model, the data and the policy

import autoshard  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402


def _timed(fn) -> tuple:
    dist.barrier()
    begin = time.perf_counter()
    out = fn()
    seconds = torch.tensor(time.perf_counter() - begin)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)   # the slowest rank's
    return out, seconds.item()


def _step(module, opt, tokens, targets):
    loss = module(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _parallelized(args, cache_dir):
    """(module, optimizer, parallelize's seconds, the first step's seconds)."""
    os.environ["AUTOSHARD_PLAN_CACHE"] = cache_dir
    model = example.build(args, "cpu")
    sample = (torch.zeros(args.batch, args.seq, dtype=torch.long),) * 2
    module, made = _timed(lambda: autoshard.parallelize(model, sample, inputs="local", mp_policy=example.POLICY,
                                                        cluster=args.cluster, verbose=False))
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.1)
    _, first = _timed(lambda: _step(module, opt, *sample))
    return module, opt, made, first


def _fsdp2(args):
    model = example.build(args, "cpu")
    for block in model.layers:
        fully_shard(block, mp_policy=example.POLICY)
    fully_shard(model, mp_policy=example.POLICY)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def run(args, root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    warm = os.path.join(root, "kept")
    start = {}
    mod, opt, start["first start: parallelize"], start["first start: first step"] = _parallelized(args, warm)
    _, _, start["restart: parallelize"], start["restart: first step"] = _parallelized(args, warm)
    model_sd, optim_sd = get_state_dict(mod, opt)
    ckpt = os.path.join(root, "ckpt")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)

    def resume():
        again, opt2, _, _ = _parallelized(args, warm)
        msd, osd = get_state_dict(again, opt2)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(again, opt2, model_state_dict=msd, optim_state_dict=osd)
        return again, opt2
    (auto, auto_opt), start["resume: restart's parallelize + DCP load"] = _timed(resume)

    fsdp, fsdp_opt = _fsdp2(args)
    contenders = {"autoshard": (auto, auto_opt), "FSDP2": (fsdp, fsdp_opt)}
    data = example.dataset(args.batch * world * (args.rounds + args.warmup), args.seq, args.vocab)
    rows = example.batches(data, args.batch, world, rank, args.seed)
    times = {name: [] for name in contenders}
    for r in range(args.warmup + args.rounds):
        _, tokens, targets = next(rows)
        order = list(contenders)
        random.Random(r).shuffle(order)
        for name in order:
            module, opt = contenders[name]
            _, seconds = _timed(lambda: _step(module, opt, tokens, targets))
            if r >= args.warmup:
                times[name].append(seconds)
    return {"start": start, "times": times, "plan": str(auto.plan).splitlines()[0] if rank == 0 else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other option is examples/train.py's (--batch, --seq, --dim, ...).")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    ours, rest = p.parse_known_args(argv)
    args = example.parse(rest)   # the model's and the data's options, as the example takes them
    args.rounds, args.warmup = ours.rounds, ours.warmup
    args.cluster = args.cluster or "measure"
    with tempfile.TemporaryDirectory() as root, LocalWorld(args.world, timeout_s=600.0) as group:
        out = group.run(run, args, root)[0]
    params = sum(q.numel() for q in example.build(args, "meta").parameters())
    print(f"examples/train.py's Llama: {params / 1e3:.0f}k parameters, gloo world {args.world}, "
          f"{args.batch} rows x {args.seq} tokens per rank, bf16 policy, AdamW; {out['plan']}")
    print("\nstart (s, slowest rank):")
    for name, seconds in out["start"].items():
        print(f"  {name:38s} {seconds:7.2f}")
    t = out["times"]
    a, f = statistics.median(t["autoshard"]), statistics.median(t["FSDP2"])
    ratios = statistics.median(x / y for x, y in zip(t["autoshard"], t["FSDP2"]))
    tokens = args.batch * args.seq * args.world
    print(f"\nsteps ({args.rounds} rounds after {args.warmup}, interleaved; median ms, tokens/s):")
    print(f"  autoshard {1e3 * a:8.1f} ms  {tokens / a:9.0f} tok/s")
    print(f"  FSDP2     {1e3 * f:8.1f} ms  {tokens / f:9.0f} tok/s")
    print(f"  autoshard / FSDP2: ratio of medians {a / f:.3f}, median ratio {ratios:.3f}")


if __name__ == "__main__":
    main()
