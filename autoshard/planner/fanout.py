"""Forked copies of a mesh search, so that its meshes are bounded, solved and refined on every
core the planning process may use (planner.search).

A mesh's work (its layouts, prices, relaxation) is independent of every other mesh's, so the
search hands each mesh to one process, its *owner*, which keeps that work and does everything
the search asks of that mesh. The meshes of a round go out as jobs that each process takes in
turn as it becomes free (``Fanout.share``), the one that takes a mesh its owner from then on: the
processes end a round together, not one mesh's time apart. The copies are forked once the work
common to every mesh is done (the capture, the one-axis plan); what they send back is small: a
mesh's candidate (its bound and status, ``search.Candidate``), a solution's choices. Whichever
process owns a mesh, it gives the same answer, and the search consumes the answers in its own
order, so the plan, the candidates and their statuses are those of the search run in one
process; only the wall time differs.

No hang, no loss: a copy that dies, or that has used no CPU for ``STALL`` seconds while it owes
an answer (a copy deadlocked on a lock some thread of the planning process held when it was
forked), is killed, and its work is done again in the planning process. Only on Linux (fork is
unsafe on macOS and missing on Windows); where one core is all there is, or
``AUTOSHARD_PLAN_WORKERS=1``, everything runs in the planning process.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import warnings

from autoshard.planner import progress
from autoshard.planner.progress import CLOCK, PHASES

MAX_WORKERS = 8
ENV = "AUTOSHARD_PLAN_WORKERS"
SHARED_JOBS = 1024   # the most jobs one ``Fanout.share`` hands out; more are run here


def available() -> int:
    """How many processes a search may use: the cores this process may run on, shared with the
    other ranks of its node under torchrun (``LOCAL_WORLD_SIZE``), at most ``MAX_WORKERS``; or
    ``AUTOSHARD_PLAN_WORKERS``; 1 but on Linux."""
    if not sys.platform.startswith("linux"):
        return 1
    asked = os.environ.get(ENV)
    if asked:
        try:
            n = int(asked)
        except ValueError:
            raise ValueError(f"{ENV} is a whole number of processes, got {asked!r}") from None
        if n < 1:
            raise ValueError(f"{ENV} is at least 1, got {n}")
        return min(n, MAX_WORKERS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # under torchrun every rank of the node may be planning at once: its share of the cores
    cores //= max(1, _int(os.environ.get("LOCAL_WORLD_SIZE")))
    return max(1, min(cores, MAX_WORKERS))


def _int(text) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return 1


class _Stuck(Exception):
    """The lock ``Fanout.share``'s jobs are taken under is held past ``Fanout.STALL``."""


class CopyFailed(RuntimeError):
    """A task raised in a forked copy an exception that could not be carried back."""


class Fanout:
    """``count`` processes (this one and ``count - 1`` forked copies) that run named tasks
    (``handlers``: name -> function, the same in every copy, since the copies are forks).

    ``ask(owner, name, *args)`` queues a task on its owner (0: this process, run at once) and
    returns a ticket; ``answer(ticket)`` its result, raising what it raised (pickled across,
    or ``CopyFailed`` with its traceback). A copy's answers come back in the order asked.
    ``share(name, jobs)`` runs a list of tasks on whichever process is free first (each takes
    the next job not yet taken, this one too): (owner, ticket) per job."""

    STALL = 60.0   # seconds a copy that owes an answer may go without CPU before it is taken for hung

    def __init__(self, count: int, handlers: dict):
        reap()   # the copies of an earlier search that have ended since
        self.handlers = handlers
        self.copies = []   # [connection, pid, tickets pending] per copy; None once lost
        self.done = {}     # ticket -> ("ok", value) or ("err", payload)
        self.tasks = {}    # ticket -> (owner, name, args)
        self.next = 0
        # ``share``'s jobs, taken one at a time by whichever process is free: the batch being
        # shared, the next job to take, and who took each (its process number)
        if count > 1:   # shared with the copies: made before they are forked
            self._batch = multiprocessing.Value("l", 0)   # its lock guards all three
            self._taken = multiprocessing.Value("l", 0, lock=False)
            self._takers = multiprocessing.Array("l", SHARED_JOBS, lock=False)
        self.me = 0   # this process's number: 0 the planning process, i a copy
        for _ in range(count - 1):
            # os.fork, not multiprocessing.Process: a search may run in a daemonic process (a
            # rank of launch.LocalWorld), which multiprocessing forbids to have children
            parent, child = multiprocessing.Pipe()
            sys.stderr.flush()
            sys.stdout.flush()
            try:
                with warnings.catch_warnings():
                    # Python 3.12 warns that a fork of a threaded process may deadlock: STALL
                    # catches a copy that does
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            except OSError:   # no more processes to be had: the copies so far do the work
                parent.close()
                child.close()
                break
            if pid == 0:   # the copy
                self.me = len(self.copies) + 1
                parent.close()
                for other in self.copies:   # the earlier copies' ends: theirs to see closed
                    other[0].close()
                self._serve(child)   # never returns
            child.close()
            self.copies.append([parent, pid, []])

    @property
    def count(self) -> int:
        return 1 + len(self.copies)

    def _serve(self, conn) -> None:
        """A copy's loop: run each task asked, send back its answer and the phases' seconds. A
        thread takes the tasks in as they come, so that the planning process never waits to hand
        one over while this copy waits to hand back an answer (both pipes full)."""
        progress._shown.append(False)   # the planning process speaks for the search
        asked: queue.Queue = queue.Queue()

        def take():
            try:
                while True:
                    msg = conn.recv()
                    asked.put(msg)
                    if msg is None:
                        return
            except (EOFError, OSError):
                asked.put(None)

        threading.Thread(target=take, daemon=True).start()
        try:
            while True:
                msg = asked.get()
                if msg is None:
                    break
                ticket, name, args = msg
                if ticket is None:   # a share: every job still untaken, one at a time
                    batch, base, jobs = args
                    while (i := self._take(batch, len(jobs))) is not None:
                        self._answer(conn, base + i, name, jobs[i])
                else:
                    self._answer(conn, ticket, name, args)
        except (KeyboardInterrupt, BrokenPipeError, OSError):
            pass
        finally:
            os._exit(0)   # neither atexit handlers nor the parent's buffers run twice

    def _answer(self, conn, ticket: int, name: str, args) -> None:
        before = dict(CLOCK.seconds)
        outcome = _carried(self._run(name, args))
        spent = {p: CLOCK.seconds[p] - before[p] for p in PHASES}
        conn.send((ticket, outcome, spent))

    def _take(self, batch: int, count: int):
        """The index of the next job of ``batch`` nobody has taken, now this process's; None
        when all are taken (or the batch is over: a copy late to its last look). The planning
        process waits ``STALL`` seconds at most for the lock: a copy killed holding it (by the
        kernel, out of memory) would hold it for ever; it then raises ``_Stuck``."""
        lock = self._batch.get_lock()
        if not lock.acquire(timeout=self.STALL if self.me == 0 else None):
            raise _Stuck
        try:
            i = self._taken.value
            if self._batch.value != batch or i >= count:
                return None
            self._taken.value = i + 1
            self._takers[i] = self.me
            return i
        finally:
            lock.release()

    def share(self, name: str, jobs: list, first=None) -> list:
        """Run ``name(*job)`` for every job of ``jobs``, each on whichever process is free to
        take it first: the copies take jobs as they finish the ones before, and this process
        runs what it takes at once. Returns (owner, ticket) per job, in order, once every job
        is taken; ``answer(ticket)`` gives its result as for ``ask``. Where every job costs
        about as much, the processes end at once, where tasks given out in turn leave the
        last to end one job behind (the 96-layer GPT's nine two-axis bounds, 0.43-0.79 s each:
        0.85 s apart). ``first()``: run here once the copies have the jobs, before this process
        takes any (work of its own the copies need not wait for)."""
        live = [i + 1 for i, c in enumerate(self.copies) if c is not None]
        if not live or len(jobs) > SHARED_JOBS:
            if first is not None:
                first()
            return [(0, self.ask(0, name, *job)) for job in jobs]
        lock = self._batch.get_lock()
        if not lock.acquire(timeout=self.STALL):   # held for ever by a copy killed with it: see _take
            for owner in live:
                self._lose(owner)
            return self.share(name, jobs, first)
        try:
            self._batch.value += 1
            self._taken.value = 0
            batch = self._batch.value
        finally:
            lock.release()
        base, self.next = self.next, self.next + len(jobs)
        for owner in live:
            try:
                self.copies[owner - 1][0].send((None, name, (batch, base, jobs)))
            except (OSError, ValueError):
                self._lose(owner)
        if first is not None:
            first()
        mine = set()
        try:
            while (i := self._take(batch, len(jobs))) is not None:
                mine.add(i)
                self.tasks[base + i] = (0, name, jobs[i])
                self.done[base + i] = self._run(name, jobs[i])
        except _Stuck:   # the copies can take nothing more: they go, and what none took is done here
            mine.update(range(self._taken.value, len(jobs)))
            for i in range(self._taken.value, len(jobs)):
                self.tasks[base + i] = (0, name, jobs[i])
                self.done[base + i] = self._run(name, jobs[i])
            for owner in live:
                self._lose(owner)
        out = []
        for i, job in enumerate(jobs):
            owner = 0 if i in mine else self._takers[i]
            if owner:
                self.tasks[base + i] = (owner, name, job)
                copy = self.copies[owner - 1]
                if copy is None:   # lost meanwhile: done here
                    self.done[base + i] = self._run(name, job)
                else:
                    copy[2].append(base + i)
            out.append((owner, base + i))
        return out

    def _run(self, name, args):
        try:
            return ("ok", self.handlers[name](*args))
        except Exception as e:   # raised where the search asks for the answer
            return ("err", e)

    def ask(self, owner: int, name: str, *args) -> int:
        ticket, self.next = self.next, self.next + 1
        self.tasks[ticket] = (owner, name, args)
        copy = self.copies[owner - 1] if owner > 0 else None
        if copy is None:
            self.done[ticket] = self._run(name, args)
            return ticket
        try:
            copy[0].send((ticket, name, args))
            copy[2].append(ticket)
        except (OSError, ValueError):
            self._lose(owner)
        return ticket

    def answer(self, ticket: int):
        while ticket not in self.done:
            owner = self.tasks[ticket][0]
            copy = self.copies[owner - 1]
            if copy is None or not copy[2]:
                self._lose(owner)
                continue
            conn, pid = copy[0], copy[1]
            if not _answers(conn, pid, self.STALL):
                self._lose(owner)
                continue
            try:
                got, outcome, spent = conn.recv()
            except (EOFError, OSError):
                self._lose(owner)
                continue
            copy[2].remove(got)
            self.done[got] = (outcome[0], pickle.loads(outcome[1])) if outcome[0] == "err" else outcome
            for p, s in spent.items():
                CLOCK.seconds[p] += s
        status, value = self.done.pop(ticket)
        del self.tasks[ticket]
        if status == "err":
            raise value
        return value

    def _lose(self, owner: int) -> None:
        """A copy died or hung: kill it, and run its tasks still unanswered here."""
        copy = self.copies[owner - 1]
        if copy is not None:
            self.copies[owner - 1] = None
            _stop(copy)
        for ticket, (o, name, args) in list(self.tasks.items()):
            if o == owner and ticket not in self.done:
                self.done[ticket] = self._run(name, args)

    def close(self) -> None:
        """Tell each copy to end, and go on: a copy ends in a few tens of milliseconds (its
        memory handed back), which the planning process need not wait for. The copies still
        ending are reaped later (``reap``): by the next ``Fanout``, or when this process exits,
        each killed if it has not ended within ``ENDING`` seconds of being told."""
        for i, copy in enumerate(self.copies):
            if copy is not None:
                try:
                    copy[0].send(None)
                except (OSError, ValueError):
                    pass
                copy[0].close()
                _ending.append((copy[1], time.monotonic() + ENDING))
                self.copies[i] = None
        reap()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _answers(conn, pid: int, stall: float) -> bool:
    """Wait for an answer on ``conn`` (or its end: a copy that dies closes it): False once the
    copy ``pid`` has used no CPU for ``stall`` seconds, hung."""
    used, since = _cpu(pid), time.monotonic()
    while not conn.poll(min(1.0, stall)):
        now, cpu = time.monotonic(), _cpu(pid)
        if cpu is None or cpu != used:   # None: no /proc to read; a dead copy's pipe ends anyway
            used, since = cpu, now
        elif now - since >= stall:
            return False
    return True


def _cpu(pid: int):
    """The CPU ticks process ``pid`` has used (user and system), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _carried(outcome: tuple) -> tuple:
    """An answer as a copy sends it: a raised exception pickled (its own, or ``CopyFailed``
    with its traceback where it does not survive pickling)."""
    if outcome[0] != "err":
        return outcome
    e = outcome[1]
    try:
        pickled = pickle.dumps(e)
        pickle.loads(pickled)
    except Exception:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        pickled = pickle.dumps(CopyFailed(f"a forked copy of the mesh search failed:\n{text}"))
    return ("err", pickled)


ENDING = 5.0   # seconds a copy told to end may take before it is killed
_ending: list = []   # (pid, deadline) of the copies told to end and not yet reaped


def reap(wait: bool = False) -> None:
    """Reap the copies told to end that have ended (``wait``: wait for each, up to its deadline),
    and kill those past their deadline."""
    for entry in list(_ending):
        if _ended(*entry, wait):
            _ending.remove(entry)


def _ended(pid: int, deadline: float, wait: bool) -> bool:
    """Whether the copy ``pid`` has been reaped: it had ended, or was past ``deadline`` and is
    killed; ``wait``: until one or the other."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:   # reaped already
            return True
        if done:
            return True
        if time.monotonic() >= deadline:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            return True
        if not wait:
            return False
        time.sleep(0.01)


atexit.register(reap, True)


def _stop(copy, wait: float = 0.0) -> None:
    """Reap a copy: wait up to ``wait`` seconds for it to end, then kill it."""
    conn, pid, _ = copy
    conn.close()
    _ended(pid, time.monotonic() + wait, True)
