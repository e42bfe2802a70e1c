"""Mesh search: how ``world`` devices factor into mesh axes, chosen outside the ILP (DESIGN.md
section 5).

Every ordered factorization of ``world`` into at most ``max_axes`` axes of 2 or more devices is a
candidate; the order matters, since the last axis is innermost on the hardware (the cluster maps
it onto the fastest links). Each candidate gets a lower bound, the LP relaxation of its integer
program; candidates are solved best bound first, and one whose bound is no better than the best
plan found is pruned without solving. Every candidate's fate is kept in ``plan.mesh_candidates``.
"""
from __future__ import annotations

import math
import time
import warnings

from autoshard.passes.annotate import annotate
from autoshard.passes.solve import Costs, MemoryBudgetError, lower_bound, solve
from autoshard.plan import make_plan

MAX_SEARCH_AXES = 2   # 3- and 4-axis strategy spaces are too large to solve in seconds: name them with mesh=


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


def search(graph, world: int, cluster, pins_for, training, time_limit, bucket_bytes, budget,
           max_axes: int = MAX_SEARCH_AXES):
    """The best plan over the candidate meshes; ``pins_for(mesh_shape)`` resolves the user's
    pins for a mesh (None: the pins do not fit that mesh)."""
    start = time.perf_counter()
    candidates, pin_errors, seen = [], [], {}
    for mesh in factorizations(world, max_axes):
        entry = {"mesh": list(mesh), "bound": None, "cost": None, "status": ""}
        candidates.append(entry)
        pins = pins_for(mesh)
        if pins is None:
            entry["status"] = "pins name another number of axes"
            continue
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                strategies = annotate(graph, mesh, pins)
            for w in caught:   # once per search, not once per mesh
                seen.setdefault(str(w.message), w)
        except ValueError as e:
            entry["status"] = f"pins cannot hold: {str(e).split(':')[0]}"
            pin_errors.append(e)
            continue
        costs = Costs(graph, mesh, cluster, training, bucket_bytes)
        entry["bound"] = lower_bound(graph, strategies, costs, budget)
        entry["_work"] = (strategies, costs)
        if math.isinf(entry["bound"]):
            entry["status"] = "does not fit in memory"
    best, best_entry, errors = None, None, []
    for entry in sorted((e for e in candidates if "_work" in e and not math.isinf(e["bound"])),
                        key=lambda e: e["bound"]):
        if best is not None and entry["bound"] >= best.cost * (1 - 1e-6):
            entry["status"] = "pruned: its lower bound is no better than the best plan"
            continue
        strategies, costs = entry["_work"]
        try:
            solution = solve(graph, strategies, costs, time_limit, budget)   # time_limit: per solve
        except MemoryBudgetError as e:
            entry["status"] = "does not fit in memory"
            errors.append(e)
            continue
        plan = make_plan(graph, strategies, solution, costs)
        entry["cost"], entry["status"] = plan.cost, "solved"
        if best is None or plan.cost < best.cost:
            best, best_entry = plan, entry
    for w in seen.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    tried = [e.pop("_work") for e in candidates if "_work" in e]
    if best is None and pin_errors and all(e["bound"] is None for e in candidates):
        raise pin_errors[0]
    if best is None:
        if errors:
            raise errors[0]
        if tried:
            # solve the first for its report of the least memory it reaches
            strategies, costs = tried[0]
            solve(graph, strategies, costs, time_limit, budget)
        raise ValueError(f"no mesh of {world} devices with at most {max_axes} axes takes the pins given: "
                         + "; ".join(f"{tuple(e['mesh'])}: {e['status']}" for e in candidates))
    best_entry["status"] = "chosen"
    best.mesh_candidates = sorted(candidates, key=lambda e: (e["cost"] is None, e["cost"] or 0,
                                                             e["bound"] is None, e["bound"] or 0))
    best.solver["search_seconds"] = time.perf_counter() - start
    return best
