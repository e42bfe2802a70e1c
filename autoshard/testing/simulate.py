"""Every rank of a process group in this one process: ``SimWorld(world).run(fn, *args)`` calls
``fn`` on each rank and returns the per-rank results, as ``launch.LocalWorld`` does, with threads
for processes and collectives done in memory. It checks numerics at worlds too large for real
processes here (16, 64 ranks on two cores) by running the real thing: ``parallelize``, the emitted
program, ``runtime`` and torch.distributed are unchanged; only the backend behind the groups is
this module's.

How the threads keep to what separate processes would do:

- One rank runs at a time. A rank holds the baton while it runs and gives it up only while it
  waits for the other members of a collective, so its code between two collectives runs as if
  alone: torch.export, whose tracer patches process-wide state, and anything else not made for
  threads.
- Each rank has its own default (CPU) random generator: its state goes in and out with the
  baton, so ``torch.manual_seed(0); GPT()`` builds the same model on every rank, as in processes.
- Each rank gets its own deep copy of the arguments (LocalWorld's processes unpickle their own).
- c10d's registry of groups is per thread (``_compat.thread_local_c10d``).

Module-level globals stay shared between ranks (a function that keeps state in them, or patches
a module, sees every rank's writes), and so does everything else a process has once: the hash
seed, the warnings already shown, torch's settings. Point-to-point send and recv are not
simulated.

What it checks that a real group would not: the members of a group must call the same collective
(kind, shapes, dtypes, root) as their n-th on that group, and a run in which every rank left waits
for another is a deadlock. Either raises at once on every rank, saying where each rank stands,
where gloo would hang until its timeout or exchange the wrong bytes.
"""
from __future__ import annotations

import copy
import datetime
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from autoshard._compat import thread_local_c10d

BACKEND = "autoshard_sim"
_RUN_LOCK = threading.Lock()       # c10d's world and the registry mode are process-wide: one run at a time
_rank_ctx = threading.local()      # in a rank's thread: its _Sim and rank


class SimAborted(BaseException):
    """Raised in a rank that waits for a collective the run can no longer finish (another rank
    failed, the run deadlocked or timed out). A BaseException, so that user code catching
    Exception does not carry on as if the collective had happened."""


# ---- the run: ranks, the baton, the meetings ----------------------------------------------------

class _Sim:
    """One run of ``fn`` on ``world`` threads. ``lock`` is the baton; each rank sleeps on its own
    condition of it, and the rank that completes a collective wakes just that collective's members."""

    def __init__(self, world: int, rng_states: list):
        self.world = world
        self.lock = threading.Lock()
        self.wake = [threading.Condition(self.lock) for _ in range(world)]
        self.state = ["starting"] * world        # starting | running | waiting | done
        self.where = [None] * world              # what a waiting rank waits for, for error messages
        self.ready = [None] * world              # a waiting rank's predicate
        self.meetings: dict = {}                 # (group name, n) -> _Meeting
        self.rng = rng_states
        self.failure = None                      # why the run was stopped, when no rank raised itself
        self.aborted = False

    # called with the baton held, by the rank that stops running
    def _stuck(self) -> bool:
        live = [r for r in range(self.world) if self.state[r] != "done"]
        return bool(live) and all(self.state[r] == "waiting" and not self.ready[r]() for r in live)

    def _abort(self, why=None):
        if why is not None and self.failure is None:
            self.failure = why
        self.aborted = True
        for c in self.wake:
            c.notify_all()

    def describe(self) -> str:
        lines = []
        for r in range(self.world):
            doing = {"starting": "not started", "running": "running", "done": "returned"}.get(self.state[r])
            if doing is None:
                ready, where = self.ready[r], self.where[r]
                doing = ("going on after " if ready is not None and ready() else "waits in ") + where()
            lines.append(f"  rank {r}: {doing}")
        return "\n".join(lines)

    def wait(self, rank: int, ready, where):
        """Give up the baton until ``ready()``; this rank's random state goes with it."""
        self.state[rank], self.ready[rank], self.where[rank] = "waiting", ready, where
        if not ready() and not self.aborted and self._stuck():
            self._abort(f"deadlock: every rank waits for a collective that another rank never calls\n"
                        f"{self.describe()}")
        self.rng[rank] = torch.get_rng_state()
        while not ready() and not self.aborted:
            self.wake[rank].wait()
        torch.set_rng_state(self.rng[rank])
        self.state[rank], self.ready[rank] = "running", None
        if not ready():
            raise SimAborted(self.failure or "the run was stopped: another rank failed")

    def finish(self, rank: int, failed: bool):
        self.state[rank] = "done"
        self.rng[rank] = torch.get_rng_state()
        if failed:
            self._abort()
        elif not self.aborted and self._stuck():
            self._abort(f"deadlock: rank {rank} returned while other ranks wait for it\n{self.describe()}")


class _Meeting:
    """One collective on one group: each member's part, and the outcome once all have come."""

    def __init__(self):
        self.parts: dict = {}
        self.done = False
        self.error = None


# ---- the backend --------------------------------------------------------------------------------

def _op(opts):
    op = dist.ReduceOp.SUM if opts is None else getattr(opts.reduceOp, "op", opts.reduceOp)
    if op not in _REDUCE:
        raise NotImplementedError(f"the simulated backend reduces with {sorted(map(str, _REDUCE))}, not {op}")
    return op


def _root(opts):
    return 0 if opts is None else opts.rootRank


def _sum(ts):
    out = ts[0].clone()
    for t in ts[1:]:
        out += t
    return out


_R = dist.ReduceOp
_REDUCE = {
    _R.SUM: _sum,
    _R.AVG: lambda ts: _sum(ts) / len(ts) if ts[0].is_floating_point() else _sum(ts) // len(ts),
    _R.PRODUCT: lambda ts: torch.stack(ts).prod(0),
    _R.MIN: lambda ts: torch.stack(ts).amin(0),
    _R.MAX: lambda ts: torch.stack(ts).amax(0),
}


def _sig(ts):
    """What the members of a collective must agree on, readably: ('float32[8, 4]', ...)."""
    return tuple(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in ts)


class _Done(dist.Work):
    """A finished collective: the simulated backend completes each one when its last member comes."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class _SimGroup(dist.ProcessGroup):
    """A process group whose members are threads of this process."""

    def __init__(self, sim: _Sim, name: str, rank: int, size: int, ranks: list):
        super().__init__(rank, size)
        self._sim, self._name, self._rank, self._size, self._ranks = sim, name, rank, size, ranks
        self._count = 0

    def getBackendName(self):
        return BACKEND

    @property
    def group_name(self):
        return self._name

    def __repr__(self):
        return f"SimGroup(name={self._name}, ranks={self._ranks}, rank={self._rank})"

    def _meet(self, kind: str, sig, part, work, result):
        """Add this member's ``part`` to the group's next collective; the last member to come runs
        ``work(parts in group-rank order)``. Every member must call the same ``kind`` with the
        same ``sig``."""
        sim, n = self._sim, self._count
        self._count += 1
        key = (self._name, n)
        m = sim.meetings.setdefault(key, _Meeting())
        m.parts[self._rank] = (kind, sig, part)
        if len(m.parts) == self._size:
            del sim.meetings[key]
            calls = {(k, s) for k, s, _ in m.parts.values()}
            if len(calls) > 1:
                said = "; ".join(f"rank {self._ranks[r]}: {k} {s}" for r, (k, s, _) in sorted(m.parts.items()))
                m.error = (f"collective #{n} on group {self._name} (ranks {self._ranks}) is not the same call on "
                           f"every member: {said}. Every rank must issue the same collectives in the same order.")
            else:
                try:
                    with torch.no_grad():
                        work([m.parts[r][2] for r in range(self._size)])
                except Exception as e:  # noqa: BLE001 - raised on every member below
                    m.error = f"{kind} #{n} on group {self._name} failed: {type(e).__name__}: {e}"
            m.done = True
            for r in self._ranks:
                sim.wake[r].notify()
        else:
            rank = _rank_ctx.rank
            sim.wait(rank, lambda: m.done, lambda: f"{kind} #{n} on group {self._name} (ranks {self._ranks}), "
                                                   f"{len(m.parts)} of {self._size} members there")
        if m.error:
            raise RuntimeError(m.error)
        return _Done(result)

    # -- the collectives torch.distributed calls on a group ---------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op(opts)

        def work(parts):
            for i in range(len(tensors)):
                total = _REDUCE[op]([p[i] for p in parts])
                for p in parts:
                    p[i].copy_(total)
        return self._meet("all_reduce", (op.name.lower(), _sig(tensors)), tensors, work, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        def work(parts):
            for outs, _ in parts:
                for i, out in enumerate(outs):
                    for src, (_, ins) in enumerate(parts):
                        out[src].copy_(ins[i])
        return self._meet("all_gather", _sig(input_tensors), (output_tensors, input_tensors), work, output_tensors)

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        def work(parts):
            for outs, _ in parts:
                for i, out in enumerate(outs):
                    out.copy_(torch.cat([ins[i] for _, ins in parts]).view_as(out))
        return self._meet("all_gather_single", (_sig(inputs), _sig(outputs)), (outputs, inputs), work, outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _op(opts)

        def work(parts):
            for r, (outs, _) in enumerate(parts):
                for i, out in enumerate(outs):
                    out.copy_(_REDUCE[op]([ins[i][r] for _, ins in parts]))
        return self._meet("reduce_scatter", (op.name.lower(), _sig(output_tensors)),
                          (output_tensors, input_tensors), work, output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op, p = _op(opts), self._size

        def work(parts):
            for r, (outs, _) in enumerate(parts):
                for i, out in enumerate(outs):
                    out.copy_(_REDUCE[op]([ins[i].reshape(p, -1)[r] for _, ins in parts]).view_as(out))
        return self._meet("reduce_scatter_single", (op.name.lower(), _sig(inputs), _sig(outputs)),
                          (outputs, inputs), work, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        p = self._size

        def splits(t, sizes):
            return t.split(list(sizes) if sizes else t.shape[0] // p)

        def work(parts):
            chunks = [splits(inp, isz) for _, inp, _, isz in parts]
            for r, (out, _, osz, _) in enumerate(parts):
                for src, piece in enumerate(splits(out, osz)):
                    piece.copy_(chunks[src][r])
        sig = _sig([input[:0]])    # dim 0 may be split unevenly
        return self._meet("all_to_all_single", sig, (output, input, output_split_sizes, input_split_sizes), work,
                          [output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        def work(parts):
            for r, (outs, _) in enumerate(parts):
                for src, (_, ins) in enumerate(parts):
                    outs[src].copy_(ins[r])
        return self._meet("all_to_all", len(input_tensors), (output_tensors, input_tensors), work, output_tensors)

    def broadcast(self, tensors, opts=None):
        root = _root(opts)

        def work(parts):
            for p in parts:
                for t, src in zip(p, parts[root]):
                    if t is not src:
                        t.copy_(src)
        return self._meet("broadcast", (root, _sig(tensors)), tensors, work, tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = _root(opts)

        def work(parts):
            for r, (outs, _) in enumerate(parts):
                outs[0].copy_(parts[root][1][0][r])
        return self._meet("scatter", (root, _sig(output_tensors)), (output_tensors, input_tensors), work,
                          output_tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        root = _root(opts)

        def work(parts):
            for src, (_, ins) in enumerate(parts):
                parts[root][0][0][src].copy_(ins[0])
        return self._meet("gather", (root, _sig(input_tensors)), (output_tensors, input_tensors), work,
                          output_tensors)

    def reduce(self, tensors, opts=None):
        op, root = _op(opts), _root(opts)

        def work(parts):
            for i, t in enumerate(parts[root]):
                t.copy_(_REDUCE[op]([p[i] for p in parts]))
        return self._meet("reduce", (root, op.name.lower(), _sig(tensors)), tensors, work, tensors)

    def barrier(self, opts=None):
        return self._meet("barrier", (), None, lambda parts: None, [])

    def send(self, tensors, dst, tag=0):
        raise NotImplementedError("the simulated backend has collectives only, no send/recv")

    def recv(self, tensors, src, tag=0):
        raise NotImplementedError("the simulated backend has collectives only, no send/recv")


def _create_group(opts, _backend_options):
    """c10d's constructor for the simulated backend (extended API: the group's name and ranks)."""
    sim = getattr(_rank_ctx, "sim", None)
    if sim is None:
        raise RuntimeError(f"the {BACKEND!r} backend only runs inside autoshard.testing.simulate.SimWorld.run")
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    return _SimGroup(sim, str(opts.group_id), opts.group_rank, opts.group_size, ranks)


_registered = False


def _register():
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


# ---- the user-facing world ----------------------------------------------------------------------

class SimWorld:
    """``world`` ranks as threads of this process, one group. ``run(fn, *args)`` calls ``fn`` on
    every rank (in a process group of ``world`` ranks, initialized) and returns the per-rank
    results; a failure raises here with the failing rank's traceback, a deadlock or a mismatched
    collective at once, and a run past ``timeout_s`` seconds with where each rank stands.

    Interchangeable with ``launch.LocalWorld`` for functions that keep no state in module globals.
    Each rank's default random generator lives on between runs, as a process's would."""

    def __init__(self, world: int, timeout_s: float = 600.0):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a number of ranks, at least 1, got {world!r}")
        self.world, self.timeout_s = world, timeout_s
        fresh = torch.Generator().get_state()    # a new process's default generator
        self._rng = [fresh.clone() for _ in range(world)]

    def run(self, fn, *args, **kwargs) -> list:
        name = getattr(fn, "__name__", repr(fn))
        if os.environ.get("TORCH_DIST_INIT_BARRIER") == "1":
            raise RuntimeError("TORCH_DIST_INIT_BARRIER=1 makes c10d wait on its store for every rank after "
                               "creating a group, which ranks taking turns cannot do: unset it for SimWorld")
        install, uninstall, isolate = thread_local_c10d()
        if not _RUN_LOCK.acquire(blocking=False):
            raise RuntimeError("SimWorld.run is already running in this process (from another SimWorld, or "
                               "from a rank): its ranks share c10d's state, so one run at a time")
        _register()
        main_rng, main_hook = torch.get_rng_state(), sys.excepthook   # init_process_group replaces the hook
        sim = _Sim(self.world, self._rng)
        results, errors = [None] * self.world, {}
        store = dist.HashStore()

        def rank_main(rank):
            _rank_ctx.sim, _rank_ctx.rank = sim, rank
            failed = False
            with sim.lock:
                sim.state[rank] = "running"
                torch.set_rng_state(sim.rng[rank])
                try:
                    if sim.aborted:
                        raise SimAborted(sim.failure or "the run was stopped before this rank started")
                    dist.init_process_group(BACKEND, rank=rank, world_size=self.world, store=store,
                                            timeout=datetime.timedelta(seconds=self.timeout_s))
                    try:
                        a, kw = copy.deepcopy((args, kwargs))
                        results[rank] = fn(*a, **kw)
                    finally:
                        dist.destroy_process_group()
                except BaseException as e:  # noqa: BLE001 - reported by run() with its traceback
                    failed = True
                    errors[rank] = (isinstance(e, SimAborted), traceback.format_exc())
                finally:
                    sim.finish(rank, failed)

        isolate(True)
        install()
        try:
            threads = [threading.Thread(target=rank_main, args=(r,), name=f"simrank{r}", daemon=True)
                       for r in range(self.world)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + self.timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            late = [r for r, t in enumerate(threads) if t.is_alive()]
            if late:
                stuck = self._stop(sim, threads)
                raise TimeoutError(f"{name} did not finish on every rank within {self.timeout_s:g} s:\n{stuck}")
        finally:
            uninstall()
            isolate(False)
            torch.set_rng_state(main_rng)
            sys.excepthook = main_hook
            _RUN_LOCK.release()
        if sim.failure is not None and all(aborted for aborted, _ in errors.values()):
            raise RuntimeError(f"{name} failed: {sim.failure}")
        real = {r: tb for r, (aborted, tb) in errors.items() if not aborted}
        if real:
            rank = min(real)
            raise RuntimeError(f"{name} failed on rank {rank}:\n{real[rank]}")
        if errors:
            rank = min(errors)
            raise RuntimeError(f"{name} failed on rank {rank}:\n{errors[rank][1]}")
        return results

    @staticmethod
    def _stop(sim: _Sim, threads) -> str:
        """Where each rank stands, then every waiting rank woken with SimAborted. A rank that
        keeps the baton and never lets go (a loop without collectives) is left behind, a daemon
        thread."""
        where = sim.describe()
        if sim.lock.acquire(timeout=5.0):
            try:
                sim._abort("timed out")
            finally:
                sim.lock.release()
            deadline = time.monotonic() + 5.0
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        return where

    def close(self):
        """Nothing to stop between runs (threads live for one run); for symmetry with LocalWorld."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_simulated(fn, world: int, *args, **kwargs) -> list:
    """``fn(*args, **kwargs)`` on every rank of a simulated group of ``world`` ranks."""
    return SimWorld(world).run(fn, *args, **kwargs)
