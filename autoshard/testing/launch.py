"""Run a function on every rank of a local process group (gloo on CPU): for the demo, the tests
and quick experiments without torchrun. The group stays up across calls, and its ranks are forked
from a server process that imported torch once, so the seconds it takes to start Python and
torch are paid once per program, not once per rank and group."""
from __future__ import annotations

import datetime
import faulthandler
import os
import queue
import signal
import socket
import time
import traceback
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from autoshard.arguments import check_int, check_number

POLL_S = 0.2   # how often run looks for a rank that died without reporting
GRACE_S = 0.5  # how long it waits, once a rank failed, for the others' errors
_SIGNALS = {s.value for s in signal.Signals}


# what every rank imports before it runs anything: forked from a server that has them imported
# already, a rank starts in a blink where spawning one imports torch afresh (2-3 s of CPU each)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "autoshard"]


def _context():
    """Ranks forked from a server process that imported ``PRELOAD`` once (``forkserver``: a
    clean process with no threads, unlike this one), or spawned where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, timeout_s, jobs, results, environ):
    # forked from the server, not from the caller: the caller's environment as it is now, as a
    # spawned process would have it (multiprocessing brings the import path and directory)
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank that crashes (a signal) prints its threads' Python stacks to stderr before it dies,
    # beside the caller's "killed by signal" report
    faulthandler.enable()
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
    returns the per-rank results.

    A rank that raises, or whose process dies (a signal, ``os._exit``), is reported within a
    second or two: ``run`` raises a ``RuntimeError`` naming the rank and its error (its traceback,
    or how its process ended), after stopping the other ranks, which may be waiting for it in a
    collective. The group starts afresh at the next ``run``. ``timeout_s`` bounds every collective
    (gloo's own timeout) and, with a minute's grace, the whole of ``run``."""

    def __init__(self, world: int, backend: str = "gloo", timeout_s: float = 120.0):
        self.world = check_int("world", world, low=1, hint="the number of processes, such as 4")
        if not isinstance(backend, str) or backend not in ("gloo", "nccl", "mpi", "ucc"):
            raise ValueError(f"backend is the name of a torch.distributed backend, 'gloo' on CPUs or 'nccl' on "
                             f"GPUs; got {backend!r}")
        self.timeout_s = check_number("timeout_s", timeout_s, positive=True,
                                      hint="the seconds a collective may wait, such as 120")
        self.backend = backend
        self._procs = []

    def _start(self):
        ctx = _context()
        port = _free_port()
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world, port, self.backend, self.timeout_s, self._jobs[r], self._results,
                                         dict(os.environ)))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        if not callable(fn):
            raise TypeError(f"fn is the function to run on every rank, got {type(fn).__name__}")
        if not self._procs:
            self._start()
        name = getattr(fn, "__name__", repr(fn))
        for q in self._jobs:
            q.put((fn, args, kwargs))
        out, done, errors = [None] * self.world, set(), {}
        deadline = time.monotonic() + self.timeout_s + 60
        while len(done) < self.world and not errors:
            got = self._next_result(POLL_S)
            if got is None:
                errors.update(self._dead(done))
                if not errors and time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"{name} did not finish on every rank within {self.timeout_s + 60:.0f} s; "
                                       f"ranks {sorted(set(range(self.world)) - done)} are still running")
                continue
            rank, ok, value = got
            done.add(rank)
            if ok:
                out[rank] = ForkingPickler.loads(value)
            else:
                errors[rank] = value
        if errors:
            # a rank that died makes its peers' collectives fail at once ("connection reset"): the
            # cause is the dead rank, else the first to report. The others may be waiting for it
            # in a collective, where they would wait for the collective timeout: stop them now
            end = time.monotonic() + GRACE_S
            while (got := self._next_result(max(end - time.monotonic(), 0))) is not None:
                if not got[1]:
                    errors.setdefault(got[0], got[2])
            dead = self._dead(set())
            rank = next(iter(dead or errors))
            cause = dead.get(rank) or errors[rank]
            others = [r for r in range(self.world) if r != rank and r not in dead]
            self.close(stop=True)
            stopped = f" (ranks {others} were stopped)" if others else ""
            raise RuntimeError(f"{name} failed on rank {rank}{stopped}:\n{cause}")
        return out

    def _next_result(self, timeout):
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def _dead(self, done) -> dict:
        """Ranks whose process ended without reporting, and how it ended."""
        dead = {}
        for rank, p in enumerate(self._procs):
            if rank not in done and p.exitcode is not None:
                code = p.exitcode
                how = (f"killed by signal {signal.Signals(-code).name}" if code < 0 and -code in _SIGNALS
                       else f"exited with code {code}")
                dead[rank] = f"its process (pid {p.pid}) {how} before returning"
        return dead

    def close(self, stop: bool = False):
        """End every rank's process: let each leave its loop, or with ``stop`` terminate it at once
        (a rank blocked in a collective never reads its queue). None is left running."""
        if not stop:
            for q in getattr(self, "_jobs", []):
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - a queue whose reader is gone
                    pass
        for p in self._procs:
            if stop and p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=2 if stop else 10)
            if p.is_alive():
                p.kill()
                p.join()
        for q in [*getattr(self, "_jobs", []), getattr(self, "_results", None)]:
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_local(fn, world: int, *args, backend: str = "gloo", **kwargs) -> list:
    """Start ``world`` processes, run ``fn(*args, **kwargs)`` on each, return the results."""
    with LocalWorld(world, backend) as w:
        return w.run(fn, *args, **kwargs)
