"""bf16 mixed precision (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 masters and gradient
reduction) against fp32, and autoshard against FSDP2 under the same policy, on a local gloo group.

Contenders, each from the same weights on the same global batch, AdamW:

  fsdp2 fp32        ``fully_shard`` on each block, then the root, each rank its share of the batch
  fsdp2 bf16        the same with ``mp_policy=MixedPrecisionPolicy(bf16, reduce fp32)``
  autoshard fp32    ``parallelize`` pinned to ``schemes.fsdp`` (the same layout as FSDP2)
  autoshard bf16    the same with ``mp_policy=`` the same policy
  autoshard default bf16   autoshard's own plan under the policy

Both sides keep the gathered parameters from forward to backward (``reshard_after_forward=False``).
Contenders take turns step by step (round r starts at contender r), a step is the slowest rank's,
from a barrier to the end of zero_grad; medians over ``--rounds`` after ``--warmup``. The GPT is
benchmarks/vs_torch.py's. On a CPU, bf16 matmuls are only faster where the processor has bf16
instructions (AVX512-BF16, AMX); the loss of each contender's first step is printed beside fp32's.

    python benchmarks/precision.py                 # world 2, about a minute on 2 cores
    python benchmarks/precision.py --world 4 --rounds 20
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, os.path.dirname(__file__))
import vs_torch  # noqa: E402 - the GPT, the contender and the batch share of benchmarks/vs_torch.py

import autoshard  # noqa: E402
from autoshard import schemes  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CONTENDERS = ["fsdp2 fp32", "fsdp2 bf16", "autoshard fp32", "autoshard bf16", "autoshard default bf16"]


def make(name, base, batch, a):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = copy.deepcopy(base)
    policy = POLICY if name.endswith("bf16") else MixedPrecisionPolicy()
    if name.startswith("fsdp2"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        c = vs_torch.Contender(model, vs_torch.share(batch), True)
    else:
        kw = dict(mp_policy=POLICY) if name.endswith("bf16") else {}
        if "default" not in name:
            kw["pin"] = schemes.fsdp(model, batch, (dist.get_world_size(),))
        c = vs_torch.Contender(autoshard.parallelize(model, batch, time_limit=a.time_limit, **kw), batch, False)
    c.opt = torch.optim.AdamW(c.model.parameters(), lr=1e-3)
    return c


def run(a):
    torch.set_num_threads(1)
    vs_torch.quiet_warnings()
    base, batch, _, what = vs_torch.build(a, "gpt")
    built = {n: make(n, base, batch, a) for n in CONTENDERS}
    times, first, _ = vs_torch.interleaved(built, a.warmup, a.rounds)
    losses = {}
    for n in CONTENDERS:
        x = first[n].float()
        if built[n].sharded_batch:   # an FSDP2 rank's loss is its share's mean
            dist.all_reduce(x)
            x /= dist.get_world_size()
        losses[n] = x.item()
    plan = built["autoshard default bf16"].model.plan
    gathers = {n: _gathers(built[n].model.program) for n in CONTENDERS if n.startswith("autoshard")}
    return dict(what=what, times=times, losses=losses, default_plan=vs_torch.plan_summary(plan), gathers=gathers) \
        if dist.get_rank() == 0 else None


def _gathers(program: str) -> str:
    """How the program gathers parameters: its buckets (one all-gather each), those that cast
    their shares to bf16 first, and the parameters gathered one by one."""
    calls = [line for line in program.splitlines() if "autoshard_runtime_bucket_start(" in line]
    bf16 = sum("dtype = torch.bfloat16" in line for line in calls)
    alone = program.count("autoshard_runtime_all_gather(") + program.count("autoshard_runtime_step_start(")
    return f"{len(calls)} gather buckets ({bf16} in bf16), {alone} other collectives started alone"


def report(a, res):
    med = {n: statistics.median(t) * 1e3 for n, t in res["times"].items()}
    ratio = lambda x, y: statistics.median(p / q for p, q in zip(res["times"][x], res["times"][y]))  # noqa: E731
    print(f"{res['what']}; world {a.world}, {a.rounds} rounds after {a.warmup}, medians (ms per step)")
    print(f"{'contender':<24} {'ms':>8}  {'vs its fp32':>12}  {'vs fsdp2 bf16':>14}  {'step-0 loss':>12}")
    for n in CONTENDERS:
        own = n.replace("bf16", "fp32").replace(" default", "")
        vs_fp32 = f"{med[n] / med[own]:.2f} ({ratio(n, own):.2f})" if n != own else "-"
        vs_peer = f"{med[n] / med['fsdp2 bf16']:.2f} ({ratio(n, 'fsdp2 bf16'):.2f})" if n != "fsdp2 bf16" else "-"
        print(f"{n:<24} {med[n]:>8.1f}  {vs_fp32:>12}  {vs_peer:>14}  {res['losses'][n]:>12.5f}")
    print("(ratio of medians, median of per-round ratios; below 1 the row is faster)")
    print(f"autoshard's own plan under the policy: {res['default_plan']}")
    for n, text in res["gathers"].items():
        print(f"{n}: {text}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=20.0)
    # vs_torch.build's GPT sizes
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    with LocalWorld(a.world, timeout_s=600) as w:
        report(a, w.run(run, a)[0])


if __name__ == "__main__":
    main()
