"""Where planning spends its time, and what a long search shows while it runs.

``CLOCK`` adds up the seconds of each planning phase in this process (capture, annotate, cost,
build, solve, descend), each exclusive of the phases it encloses: a descent's own bookkeeping is
``descend``, the integer programs it builds and solves are ``build`` and ``solve``.
``benchmarks/plan_scale.py`` reads it.

A mesh search or a solve that runs longer than ``QUIET_SECONDS`` reports on stderr, at most once
a ``EVERY`` seconds: meshes done, the best plan so far, the time taken. ``plan(...,
verbose=False)`` silences it (``shown``).
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time

PHASES = ("capture", "annotate", "cost", "build", "solve", "descend")
QUIET_SECONDS = 2.0   # shorter than this, planning says nothing
EVERY = 1.0           # seconds between two lines


class Clock:
    """Seconds per phase, each exclusive of the phases opened inside it."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._open: list = []   # [phase, started] of the enclosing phases, innermost last

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        now = time.perf_counter()
        if self._open:   # the enclosing phase stops counting while this one runs
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            _, started = self._open.pop()
            self.seconds[name] += now - started
            if self._open:
                self._open[-1][1] = now


CLOCK = Clock()
phase = CLOCK.phase


@contextlib.contextmanager
def uncollected():
    """Python's cyclic garbage collector off while planning, back as it was after. Planning
    keeps millions of small objects (layouts, prices, solver variables) alive in its caches and
    makes few reference cycles; the collector, which walks every live object whenever enough
    new ones have piled up, took 28% of the 96-layer GPT's mesh search (19.5 s of CPU without
    it against 27.2 s with it). Cycles made meanwhile are collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

_shown = [True]


@contextlib.contextmanager
def shown(verbose: bool):
    """Progress lines on (``verbose=True``) or off while planning inside this block."""
    if not isinstance(verbose, bool):
        raise TypeError(f"verbose is True or False, got {verbose!r}")
    _shown.append(verbose)
    try:
        yield
    finally:
        _shown.pop()


class Progress:
    """Lines on stderr for one long-running task (a mesh search, a solve), once it has run
    ``QUIET_SECONDS``."""

    def __init__(self, what: str):
        self.what, self.start, self.last = what, time.perf_counter(), None
        self.on = _shown[-1]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.on or now - self.start < QUIET_SECONDS:
            return
        if not force and self.last is not None and now - self.last < EVERY:
            return
        self.last = now
        print(f"autoshard: {self.what}: {text}, {now - self.start:.1f} s", file=sys.stderr, flush=True)

    def done(self, text: str) -> None:
        """The last line, shown only when earlier ones were."""
        if self.last is not None:
            self.update(text, force=True)
