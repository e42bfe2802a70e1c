"""What the schedule pass gains, measured: the same plan run with and without it, back to back,
on a local gloo group (CPU processes).

  without   every collective where the rewriter put it: one blocking all-reduce per parameter
            gradient, each parameter gather blocking at its use
  with      gradients in buckets whose all-reduce starts when the bucket is complete and is
            waited on at the end of backward; parameter gathers started ahead of their use

Two plans of an MLP stack: data parallel (parameters replicated, gradients all-reduced) and
FSDP-style (parameters stored split over the ranks, gathered before use, gradients
reduce-scattered). Prints milliseconds per training step (forward, backward, SGD) and the ratio
without / with (> 1: the schedule is faster). On a CPU machine the collectives and the compute
share the same cores, so the gain here is mostly fewer, larger collectives; on GPUs the overlap
adds to it.

    python benchmarks/schedule_overlap.py [--world 2] [--layers 8] [--d 256] [--steps 10]
"""
import argparse
import time

import torch

import autoshard
from autoshard.testing.launch import LocalWorld


class MLP(torch.nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                torch.nn.Linear(4 * d, d)) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def pins(model, kind, layers):
    names = [n for n, _ in model.named_parameters()]
    if kind == "data parallel":
        return {"x": ("S(0)",)} | {n: ("B",) for n in names}
    # FSDP: parameters stored split, every matmul on the split batch
    linears = ["linear"] + [f"linear_{i}" for i in range(1, 2 * layers)]
    return {"x": ("S(0)",)} | {n: ("S(0)",) for n in names} | {n: ("S(0)",) for n in linears}


def step_time(kind, overlap, d, layers, batch, steps):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = MLP(d, layers)
    x = torch.randn(batch, d)
    pm = autoshard.parallelize(model, (x,), pin=pins(model, kind, layers), overlap=overlap,
                               bucket_bytes=4 * 2**20)
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        pm(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    prog = pm.program
    launches = prog.count("runtime_grad_sync(") + prog.count("runtime_grad_bucket(")
    return times[len(times) // 2], (launches, prog.count("runtime_bucket_start("))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    print(f"MLP stack: {a.layers} layers, d={a.d}, batch {a.batch}, {a.world} gloo processes; "
          f"median of {a.steps} steps")
    print(f"{'plan':16}{'without ms':>12}{'with ms':>10}{'ratio':>8}   gradient all-reduces, prefetched gathers")
    with LocalWorld(a.world) as w:
        for kind in ("data parallel", "FSDP"):
            res = {}
            for overlap in (False, True, False, True):   # interleaved, so drift hits both alike
                t, calls = w.run(step_time, kind, overlap, a.d, a.layers, a.batch, a.steps)[0]
                res.setdefault(overlap, []).append((t, calls))
            off = min(t for t, _ in res[False])
            on = min(t for t, _ in res[True])
            (ar0, _), (ar1, pre) = res[False][0][1], res[True][0][1]
            print(f"{kind:16}{off * 1e3:12.2f}{on * 1e3:10.2f}{off / on:8.2f}x   {ar0} -> {ar1}, {pre}")


if __name__ == "__main__":
    main()
