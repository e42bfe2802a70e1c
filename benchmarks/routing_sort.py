"""The routing's stable argsort of N integer keys (expert ids of the (token, expert) pairs, 8
experts) whole on every rank against split over a gloo group of 4 (``runtime.scans.sort``: the
ranges and histograms all-gathered, the (position, index) pairs sent by one all-to-all), on this
machine's CPUs. Both are timed on every rank, interleaved, and the slowest rank's median of each
is printed with their ratio (split / whole, under 1: the split is faster).

    python benchmarks/routing_sort.py [--sizes 256 4096 65536 1048576] [--repeats 15]

The split form pays three collectives' latency whatever N, and sorts N / 4 keys; the whole form
sorts all N on every rank. Small N (routing a few thousand pairs) is cheaper whole, which is what
the planner concludes too at the sizes of the suite's mixtures.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autoshard import runtime
from autoshard.runtime import scans
from autoshard.testing.launch import LocalWorld


def timed(sizes, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = runtime.RankMesh(init_device_mesh("cpu", (dist.get_world_size(),)), torch.Generator())
    p, me = mesh.size(0), mesh.coord(0)
    out = {}
    for n in sizes:
        keys = torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(n))
        mine = keys.chunk(p)[me]
        runs = {"whole": [], "split": []}
        with runtime.active(mesh):
            for i in range(repeats + 2):
                for kind in ("whole", "split") if i % 2 else ("split", "whole"):
                    dist.barrier()
                    start = time.perf_counter()
                    torch.argsort(keys, stable=True) if kind == "whole" else scans.sort(mine, axis=(0,))
                    took = time.perf_counter() - start
                    if i >= 2:   # the first two warm up
                        runs[kind].append(took)
            assert torch.equal(scans.sort(mine, axis=(0,)), torch.argsort(keys, stable=True).chunk(p)[me])
        out[n] = {kind: statistics.median(ts) for kind, ts in runs.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 4096, 65536, 1 << 20])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    with LocalWorld(4) as world:
        per_rank = world.run(timed, args.sizes, args.repeats)
    print(f"{'keys':>9}  {'whole (ms)':>10}  {'split (ms)':>10}  {'split / whole':>13}")
    for n in args.sizes:
        whole = max(r[n]["whole"] for r in per_rank)
        split = max(r[n]["split"] for r in per_rank)
        print(f"{n:>9}  {whole * 1e3:>10.3f}  {split * 1e3:>10.3f}  {split / whole:>13.2f}")


if __name__ == "__main__":
    main()
