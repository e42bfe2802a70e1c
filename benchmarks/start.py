"""What starting costs: ``parallelize`` and the first call of a ~1M-parameter GPT on a local gloo
group, phase by phase, and what a call with a new batch size costs afterwards.

Each run builds the model afresh and times, on rank 0:

  capture      torch.export on fake tensors, functionalized, as autoshard's graph
  annotate     every node's legal placements (the rules)
  cost         the cost model's tables
  solve        building and solving the integer program (and a descent, where one runs)
  make plan    the plan made from the solution (its collectives, memory, prices)
  lower        rewrite, checkpoint and schedule: the per-rank program
  distribute   the parameters cut into this rank's shares
  other        the rest of ``parallelize`` (the ranks agreeing, the plan sent to each)
  cpu          rank 0's CPU seconds in parallelize (on a busy machine, steadier than the wall clock)
  first call   the first forward and backward, with the example's shape

then the first call with each of two other batch sizes, 16 rows and a ragged 7, phase by phase,
with its wall and CPU seconds (its layout reused from the first plan, or planned again: the line
says which).

``cold``: the plan cache off (``AUTOSHARD_PLAN_CACHE=off``), so rank 0 plans. ``warm``: the
plan found on disk, as a restart or a resume finds it. Medians over ``--runs`` runs, back to
back in one group (the first run also pays the process's own warm-up: imports, torch's lazy
init; it is printed alone, as "first", and left out of the medians).

    python benchmarks/start.py [--world 4] [--runs 5]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autoshard  # noqa: E402
from autoshard import api  # noqa: E402
from autoshard.planner.progress import CLOCK  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402

ROWS = ("capture", "annotate", "cost", "solve", "make plan", "lower", "distribute", "other",
        "parallelize", "cpu", "first call")
LATER = {"new batch": 16, "ragged batch": 7}   # calls after the first: (rows) -> their own rows
CONFIG = dict(vocab=2048, d=128, heads=4, layers=4, seq=64)   # 1.06M parameters (embedding tied)
BATCH = 8


@contextlib.contextmanager
def timed(owner, name: str, spent: dict, key: str):
    """``owner.name`` wrapped so that its seconds add up under ``spent[key]``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, inner)


def _phases(spent: dict, clock: dict) -> dict:
    """The planner's clock (``planner.progress.CLOCK``) as this benchmark's rows."""
    return dict(spent, capture=clock["capture"], annotate=clock["annotate"], cost=clock["cost"],
                solve=clock["build"] + clock["solve"] + clock["descend"])


def one_start(cache_dir):
    """On every rank: parallelize a fresh GPT, call it, then call it with each of ``LATER``'s
    batches; rank 0's seconds per phase, and how each later call's layout was made."""
    import torch.distributed as dist
    from models import GPT
    os.environ["AUTOSHARD_PLAN_CACHE"] = cache_dir or "off"
    torch.manual_seed(0)
    model = GPT(**CONFIG)
    idx = torch.randint(0, CONFIG["vocab"], (2 * BATCH, CONFIG["seq"]))
    out: dict = {}
    with contextlib.ExitStack() as stack:
        spent: dict = {}
        for owner, name, key in ((api, "make_plan", "make plan"), (api, "lower", "lower"),
                                 (api.ParallelModule, "_distribute", "distribute")):
            stack.enter_context(timed(owner, name, spent, key))
        dist.barrier()
        CLOCK.reset()
        start, cpu = time.perf_counter(), time.process_time()
        pm = autoshard.parallelize(model, (idx[:BATCH], idx[:BATCH]), verbose=False, cluster="a100-80gb-nvlink-ib")
        spent["parallelize"] = time.perf_counter() - start
        out["start"] = _phases(dict(spent, cpu=time.process_time() - cpu), CLOCK.seconds)
        start = time.perf_counter()
        pm(idx[:BATCH], idx[:BATCH]).backward()
        out["start"]["first call"] = time.perf_counter() - start
        for what, rows in LATER.items():
            dist.barrier()
            spent.clear()
            CLOCK.reset()
            start, cpu = time.perf_counter(), time.process_time()
            pm(idx[:rows], idx[:rows]).backward()
            out[what] = _phases(dict(spent, call=time.perf_counter() - start, cpu=time.process_time() - cpu),
                                CLOCK.seconds)
            out[what]["status"] = next(reversed(pm._programs.values())).plan.solver.get("status")
    for phases in out.values():
        phases.setdefault("make plan", 0.0)
        phases.setdefault("lower", 0.0)
        phases.setdefault("distribute", 0.0)
    s = out["start"]
    s["other"] = s["parallelize"] - sum(s[k] for k in ROWS[:7])
    return out if dist.get_rank() == 0 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="runs of each, after one warm-up")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir, LocalWorld(args.world) as world:
        runs = {"cold": [], "warm": []}
        first = world.run(one_start, cache_dir)[0]   # the warm-up; it also fills the cache for the warm runs
        for _ in range(args.runs):   # interleaved, so that a busier moment weighs on both alike
            runs["cold"].append(world.run(one_start, None)[0])
            runs["warm"].append(world.run(one_start, cache_dir)[0])
    n = sum(p.numel() for p in _gpt().parameters())
    print(f"GPT {CONFIG}, {n / 1e6:.2f}M parameters, batch {BATCH}, world {args.world}, torch {torch.__version__}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'seconds, rank 0':22s} {'cold':>7s} {'warm':>7s} {'first':>7s}   (medians of {args.runs}; "
          "first: the process's first start, cold)")
    for row in ROWS:
        cells = [statistics.median(r["start"][row] for r in runs[k]) for k in ("cold", "warm")]
        print(f"{row:22s} {cells[0]:7.3f} {cells[1]:7.3f} {first['start'][row]:7.3f}")
    for what, rows in LATER.items():
        status = runs["cold"][-1][what]["status"]
        print(f"then {what} ({rows} rows): {status}")
        for row in ("capture", "annotate", "cost", "solve", "make plan", "lower", "call", "cpu"):
            cells = [statistics.median(r[what][row] for r in runs[k]) for k in ("cold", "warm")]
            print(f"  {row:20s} {cells[0]:7.3f} {cells[1]:7.3f}")


def _gpt():
    from models import GPT
    return GPT(**CONFIG)


if __name__ == "__main__":
    main()
