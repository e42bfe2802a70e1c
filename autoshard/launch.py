"""Run a function on every rank of a local process group (gloo on CPU): for the demo, the tests
and quick experiments without torchrun. The group stays up across calls, so the seconds it takes
to start Python and torch in each process are paid once."""
from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, timeout_s, jobs, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            # pickled here: the queue would pickle in a thread of its own, and a result that cannot
            # cross (a tensor that requires grad) would be dropped there, the caller left waiting
            results.put((rank, True, bytes(ForkingPickler.dumps(fn(*args, **kwargs)))))
        except BaseException:  # noqa: BLE001 - reported to the caller with its traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class LocalWorld:
    """``world`` processes in one process group. ``run(fn, *args)`` calls ``fn`` on every rank and
    returns the per-rank results; a failure on any rank raises here with that rank's traceback."""

    def __init__(self, world: int, backend: str = "gloo", timeout_s: float = 120.0):
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        self.world, self.backend, self.timeout_s = world, backend, timeout_s
        self._procs = []

    def _start(self):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world, port, self.backend, self.timeout_s, self._jobs[r], self._results))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        if not self._procs:
            self._start()
        for q in self._jobs:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world, {}
        for _ in range(self.world):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout_s + 60)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on every rank within "
                                   f"{self.timeout_s + 60:.0f} s") from None
            if ok:
                out[rank] = ForkingPickler.loads(value)
            else:
                errors[rank] = value
        if errors:
            self.close()  # a failed collective can leave the group unusable: start afresh next time
            rank = min(errors)
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on rank {rank}:\n{errors[rank]}")
        return out

    def close(self):
        for q in getattr(self, "_jobs", []):
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_local(fn, world: int, *args, backend: str = "gloo", **kwargs) -> list:
    """Start ``world`` processes, run ``fn(*args, **kwargs)`` on each, return the results."""
    with LocalWorld(world, backend) as w:
        return w.run(fn, *args, **kwargs)
