"""Mesh search: how ``world`` devices factor into mesh axes, chosen outside the ILP (DESIGN.md
section 5).

Every ordered factorization of ``world`` into at most 4 axes of 2 or more devices is a candidate;
the order matters, since the last axis is innermost on the hardware (the cluster maps it onto the
fastest links). The search runs in two phases:

1. Meshes of one and two axes, exactly. Each gets a lower bound, the LP relaxation of its
   integer program; they are solved best bound first, and one whose bound is no better than the
   best plan found is pruned without solving.
2. Refinement, up to 4 axes. Each axis of the best two-axis mesh is split in two in every way
   ((64, 4) -> (8, 8, 4), (64, 2, 2), ...); its plan lifts onto each refinement exactly and
   improves there by one-axis descent (passes.descend). The best refinement becomes the mesh to
   refine next, while refining still pays.

Three- and four-axis meshes have too many layouts to bound or solve whole in seconds, so a mesh
that refines none of the chosen meshes is not tried; its entry in ``plan.mesh_candidates`` says
so. When the pins name three or four axes, phase 1 has nothing to solve: every mesh of that many
axes descends from the pins' own layout.
"""
from __future__ import annotations

import math
import time
import warnings

from autoshard.passes.annotate import annotate
from autoshard.passes.descend import EXACT_AXES, lift, solve_mesh
from autoshard.passes.solve import Costs, MemoryBudgetError, lower_bound, solve
from autoshard.plan import make_plan

MAX_SEARCH_AXES = 4


def factorizations(world: int, max_axes: int) -> list:
    """Ordered factorizations of ``world`` into 1..max_axes factors of at least 2 ((world,) first)."""
    out = [(world,)]

    def extend(prefix, rest, left):
        if left == 0:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                if rest // f == 1:
                    if len(prefix) >= 1:
                        out.append(prefix + (f,))
                else:
                    extend(prefix + (f,), rest // f, left - 1)

    extend((), world, max_axes)
    return sorted(set(out), key=lambda m: (len(m), m))


def splits(mesh: tuple) -> list:
    """(finer mesh, groups): each axis of ``mesh`` split into two ordered factors, one at a time."""
    out = []
    for i, n in enumerate(mesh):
        for f in range(2, n // 2 + 1):
            if n % f == 0:
                fine = mesh[:i] + (f, n // f) + mesh[i + 1:]
                out.append((fine, tuple(2 if j == i else 1 for j in range(len(mesh)))))
    return out


class _Candidates:
    """Every candidate mesh's entry (mesh, bound, cost, status) and its annotated work."""

    def __init__(self, graph, world, cluster, pins_for, training, bucket_bytes, max_axes, reshard=False):
        self.graph, self.cluster, self.training, self.bucket_bytes = graph, cluster, training, bucket_bytes
        self.reshard = reshard
        self.pins_for = pins_for
        self.entries = {m: {"mesh": list(m), "bound": None, "cost": None, "status": "not tried: refines none "
                            "of the meshes chosen so far"} for m in factorizations(world, max_axes)}
        self.pin_errors, self.warned = [], {}

    def work(self, mesh):
        """(strategies, costs) of the mesh, or None when the pins do not fit it."""
        entry = self.entries[mesh]
        if "_work" in entry:
            return entry["_work"]
        pins = self.pins_for(mesh)
        if pins is None:
            entry["status"] = "pins name another number of axes"
            return None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                strategies = annotate(self.graph, mesh, pins)
            for w in caught:   # once per search, not once per mesh
                self.warned.setdefault(str(w.message), w)
        except ValueError as e:
            entry["status"] = f"pins cannot hold: {str(e).split(':')[0]}"
            self.pin_errors.append(e)
            return None
        entry["_work"] = (strategies, Costs(self.graph, mesh, self.cluster, self.training, self.bucket_bytes,
                                            self.reshard))
        return entry["_work"]


def search(graph, world: int, cluster, pins_for, training, time_limit, bucket_bytes, budget,
           max_axes: int = MAX_SEARCH_AXES, reshard: bool = False):
    """The best plan over the candidate meshes; ``pins_for(mesh_shape)`` resolves the user's
    pins for a mesh (None: the pins do not fit that mesh)."""
    start = time.perf_counter()
    cands = _Candidates(graph, world, cluster, pins_for, training, bucket_bytes, max_axes, reshard)
    errors: list = []
    best = None     # (plan, mesh, strategies, choice)
    widest = None   # the same, of the best mesh with EXACT_AXES axes

    # phase 1: one and two axes, bounded and solved whole
    small = [m for m in cands.entries if len(m) <= EXACT_AXES]
    for mesh in small:
        work = cands.work(mesh)
        if work is None:
            continue
        entry = cands.entries[mesh]
        entry["bound"] = lower_bound(graph, *work, budget)
        entry["status"] = "does not fit in memory" if math.isinf(entry["bound"]) else "bounded"
    for mesh in sorted((m for m in small if cands.entries[m]["status"] == "bounded"),
                       key=lambda m: cands.entries[m]["bound"]):
        entry = cands.entries[mesh]
        if best is not None and entry["bound"] >= best[0].cost * (1 - 1e-6):
            entry["status"] = "pruned: its lower bound is no better than the best plan"
            continue
        strategies, costs = entry["_work"]
        try:
            solution = solve(graph, strategies, costs, time_limit, budget)   # time_limit: per solve
        except MemoryBudgetError as e:
            entry["status"] = "does not fit in memory"
            errors.append(e)
            continue
        got = _record(graph, strategies, solution, costs, entry, mesh)
        best = _better(best, got)
        if len(mesh) == EXACT_AXES:
            widest = _better(widest, got)

    # phase 2: refine the best two-axis mesh (one axis is refined by the two-axis meshes
    # already), one axis split at a time. A mesh of more axes may beat the bound of the mesh it
    # refines, so when every two-axis mesh was pruned, the one with the best bound is solved
    # to refine it
    pruned = [m for m in small if len(m) == EXACT_AXES and cands.entries[m]["status"].startswith("pruned")]
    if widest is None and pruned and max_axes > EXACT_AXES:
        mesh = min(pruned, key=lambda m: cands.entries[m]["bound"])
        entry = cands.entries[mesh]
        strategies, costs = entry["_work"]
        try:
            widest = _record(graph, strategies, solve(graph, strategies, costs, time_limit, budget),
                             costs, entry, mesh)
        except MemoryBudgetError:
            entry["status"] = "does not fit in memory"
    frontier = [widest] if widest is not None else []
    if best is None:   # the pins name more axes than phase 1 solves: descend from the pins
        for mesh in [m for m in cands.entries if len(m) > EXACT_AXES]:
            best = _better(best, _descend_from(cands, graph, mesh, None, time_limit, budget, errors))
    while frontier:
        plan, mesh, strategies, choice = frontier.pop()
        round_best = None
        for fine, groups in splits(mesh):
            if len(fine) > max_axes or fine not in cands.entries or cands.entries[fine]["cost"] is not None:
                continue
            lifted = (strategies, choice, groups)
            round_best = _better(round_best, _descend_from(cands, graph, fine, lifted, time_limit, budget, errors))
        if round_best is not None and round_best[0].cost < plan.cost * (1 - 1e-6):
            frontier.append(round_best)
            if round_best[0].cost < best[0].cost:
                best = round_best

    for w in cands.warned.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    tried = [e.pop("_work") for e in cands.entries.values() if "_work" in e]
    candidates = list(cands.entries.values())
    if best is None and cands.pin_errors and all(e["bound"] is None and e["cost"] is None for e in candidates):
        raise cands.pin_errors[0]
    if best is None:
        if errors:
            raise errors[0]
        if tried:
            # solve the first for its report of the least memory it reaches
            strategies, costs = tried[0]
            solve(graph, strategies, costs, time_limit, budget)
        raise ValueError(f"no mesh of {world} devices with at most {max_axes} axes takes the pins given: "
                         + "; ".join(f"{tuple(e['mesh'])}: {e['status']}" for e in candidates))
    plan = best[0]
    cands.entries[best[1]]["status"] = "chosen"
    plan.mesh_candidates = sorted(candidates, key=lambda e: (e["cost"] is None, e["cost"] or 0,
                                                             e["bound"] is None, e["bound"] or 0))
    plan.solver["search_seconds"] = time.perf_counter() - start
    return plan


def _record(graph, strategies, solution, costs, entry, mesh):
    """A solved candidate's plan in its entry; (plan, mesh, strategies, choice)."""
    plan = make_plan(graph, strategies, solution, costs)
    entry["cost"] = plan.cost
    entry["status"] = f"refined ({solution.status.lower()})" if solution.status.startswith("LOCAL") else "solved"
    return plan, mesh, strategies, solution.choice


def _better(a, b):
    """The cheaper of two (plan, ...) results, either of which may be None."""
    if a is None or (b is not None and b[0].cost < a[0].cost):
        return b
    return a


def _descend_from(cands, graph, mesh, lifted, time_limit, budget, errors):
    """Descend on ``mesh`` from the lifted coarse plan (or the pins' layout): its result, or
    None."""
    work = cands.work(mesh)
    if work is None:
        return None
    strategies, costs = work
    entry = cands.entries[mesh]
    try:
        solution = solve_mesh(graph, strategies, costs, time_limit, budget,
                              lambda: [lift(graph, *lifted, strategies)] if lifted else [])
    except MemoryBudgetError as e:
        entry["status"] = "does not fit in memory"
        errors.append(e)
        return None
    return _record(graph, strategies, solution, costs, entry, mesh)
