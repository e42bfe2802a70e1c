"""How long LocalWorld takes to report a rank that fails in the middle of a collective, for each
way a rank can fail, and whether any process is left: the other ranks wait in an all-reduce for
the failed one, under a 300 s collective timeout that must not be what ends them.

    python benchmarks/faults.py [--world 4]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from autoshard.testing.launch import LocalWorld  # noqa: E402
from test_faults import fail_in_collective, gone, pids  # noqa: E402 - the very failures the tests make

WAYS = ("raise", "SIGKILL", "SIGSEGV", "SIGTERM", "exit")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    world = ap.parse_args().world
    w = LocalWorld(world, timeout_s=300)
    print(f"world {world}, collective timeout 300 s; the failing rank: {world // 2}")
    print(f"{'how':8s} {'reported after':>14s} {'left alive':>10s}  error")
    for how in WAYS:
        before = w.run(pids)
        start = time.monotonic()
        try:
            w.run(fail_in_collective, world // 2, how)
            print(f"{how:8s} not reported")
            continue
        except RuntimeError as e:
            seconds = time.monotonic() - start
            cause = str(e).strip().splitlines()[-1]
        print(f"{how:8s} {seconds:12.2f} s {sum(not gone(p) for p in before):10d}  {cause[:80]}")
    w.close()


if __name__ == "__main__":
    main()
