"""Large meshes: solve one mesh axis at a time (DESIGN.md section 5).

On three or four axes the integer program of ``planner.program`` has a variable for every pair of
layouts an edge can join, and there are millions (a GPT block on (8, 8, 4) has 326k, on
(4, 4, 4, 4) 9M). Such a mesh is solved by block coordinate descent instead:

    start from a plan (lifted from a coarser mesh, or the pins' own layout)
    repeat until a round improves the plan by less than the solver's gap (0.1%), or comes back
    to the axis whose step made the plan with none improving on it since:
        for each mesh axis a:
            keep every node's placements on the other axes as they are, and let the integer
            program choose every node's placement on axis a, jointly, at the exact cost

Each step solves an exact integer program of one-axis size (each node keeps only the strategies
that agree with the current plan off axis a, so the current plan is one of its solutions; where
the program's LP relaxation is whole, its plan, without CP-SAT: ``planner.relax.whole_plan``), and
its objective is the whole mesh's cost: the plan never gets worse, and it moves whole layers of
the mesh at once (turn axis 2 from data parallel to tensor parallel, across every layer). It is
a local optimum, not a proven one; ``Solution.status`` says so.

A plan on a mesh whose axes group into a coarser mesh's lifts exactly: (a*b, c) -> (a, b, c)
repeats each placement on the axes it covers, since a dim split over a then b is cut into the
same a*b chunks, in the same order, as a split over a*b.
"""
from __future__ import annotations

import math
import time
from typing import Optional

from autoshard.cost import memory
from autoshard.planner import recompute
from autoshard.planner.progress import phase, uncollected
from autoshard.cost.price import Costs
from autoshard.passes.annotate import annotate
from autoshard.planner.repeat import tie_repeated, tied_plan, twin_edges
from autoshard.planner.backends import GAP_LIMIT
from autoshard.planner.solution import MemoryBudgetError, NoBetterPlan, NoPlanInTime, Solution
from autoshard.planner.solve import solve
from autoshard.planner.tables import program_cost

EXACT_AXES = 2          # meshes of up to this many axes are always solved whole
EXACT_PAIRS = 150_000   # edge layout pairs the whole-mesh integer program may have; above, descend
# CP-SAT's deterministic seconds for one descent step: a step starts from the current plan and
# needs no proof, and a few steps whose relaxation is loose cannot be closed in minutes (the
# 7.3B golden block's axis 0 on (16, 2, 8) ran 108 s at 20x its bound); on most it is not reached
STEP_EFFORT = 0.5


def edge_pairs(graph, strategies, rep: Optional[dict] = None) -> int:
    """How many y variables the whole-mesh integer program would have (planner.program.edge_vars)."""
    rep = rep or tie_repeated(graph, strategies)
    total = 0
    for u, value, v, slot, _ in twin_edges(graph, rep):
        src = {s.outputs[value[1]] for s in strategies[u.name]}
        dst = {s.inputs[slot] for s in strategies[v.name]}
        if len(src) > 1 and len(dst) > 1:
            total += len(src) * len(dst)
    return total


def _off_axis(strat, axis):
    """The strategy's placements on every axis but ``axis``."""
    return (tuple(p[:axis] + p[axis + 1:] for p in strat.inputs),
            tuple(p[:axis] + p[axis + 1:] for p in strat.outputs))


class _ByOffAxis:
    """For a strategy list (the layers of a stack share theirs): the indices of the strategies
    that agree with strategy i off ``axis``, computed once per list and axis."""

    def __init__(self):
        self._cache: dict = {}

    def __call__(self, strats, axis, i) -> list:
        key = (id(strats), axis)
        if key not in self._cache:
            groups: dict = {}
            keys = [s.axes[:axis] + s.axes[axis + 1:] if s.axes else _off_axis(s, axis) for s in strats]
            for k, kk in enumerate(keys):
                groups.setdefault(kk, []).append(k)
            self._cache[key] = (strats, [groups[kk] for kk in keys])   # strats: keep its id alive
        return self._cache[key][1][i]


def start_choice(graph, strategies, costs: Costs, budget: Optional[float]) -> dict:
    """A plan to descend from when there is nothing to lift: every node's first strategy (all
    broadcast, or what its pin says); when that breaks the memory budget, every node's
    least-memory strategy."""
    choice = {n.name: 0 for n in graph.nodes}
    if budget is None or _memory(graph, strategies, choice, costs) <= budget:
        return choice
    return {n.name: min(range(len(strategies[n.name])),
                        key=lambda i: costs.memory(n, strategies[n.name][i]))
            for n in graph.nodes}


def _memory(graph, strategies, choice, costs) -> int:
    return memory.rank_memory(graph, strategies, choice, costs.mesh_shape, costs.training, costs.reshard,
                              tied_plan(graph, strategies, choice))["total"]


def descend(graph, strategies, costs: Costs, choice: dict, time_limit: float = 60.0,
            budget: Optional[float] = None, max_rounds: int = 4, settled: frozenset = frozenset()) -> Solution:
    """Block coordinate descent from ``choice`` (node name -> strategy index), one mesh axis per
    step, until a round gains less than 0.1% (the module docstring). ``settled``: axes the first
    round skips, whose step would find no better plan (``solve_mesh``'s lifted starts)."""
    # recompute="auto": the steps keep the start's answer, no block, every block's cheap ops or
    # every block recomputed (their programs are linear in the layouts, as quick as without
    # recomputation), and but for the cheap ops the end plan recomputes the fewest blocks that
    # fit (planner.recompute.best_counts)
    auto = recompute.mode_of(costs) == recompute.AUTO
    fixed = _fixed_mode(graph, strategies, choice, costs, budget) if auto else None
    with phase("descend"):
        stepped = costs.with_recompute(fixed) if auto else costs
        sol = _descend(graph, strategies, stepped, choice, time_limit, budget, max_rounds, settled)
    if auto and fixed != recompute.SELECTIVE:
        again = recompute.best_counts(graph, strategies, sol.choice, costs, budget)
        extra = recompute.chosen(graph, strategies, sol.choice, costs, again)[0]
        sol.objective, sol.recompute = program_cost(graph, strategies, sol.choice, costs, extra), again
    return sol


def _fixed_mode(graph, strategies, choice, costs, budget) -> str:
    """The linear recompute mode an ``"auto"`` descent steps in, from its start: none where the
    start fits, every block's cheap ops where that makes it fit, else every block."""
    if not recompute.best_counts(graph, strategies, choice, costs, budget):
        return "none"
    counts = recompute.best_counts(graph, strategies, choice, costs.with_recompute(recompute.SELECTIVE), budget)
    _, freed, peak, _ = recompute.chosen(graph, strategies, choice, costs, counts)
    return recompute.SELECTIVE if _memory(graph, strategies, choice, costs) - freed + peak <= budget else "blocks"


def _descend(graph, strategies, costs, choice, time_limit, budget, max_rounds, settled) -> Solution:
    start = time.perf_counter()
    naxes = len(costs.mesh_shape)
    again = recompute.best_counts(graph, strategies, choice, costs, budget)
    extra, freed, peak, _ = recompute.chosen(graph, strategies, choice, costs, again)
    best = program_cost(graph, strategies, choice, costs, extra)
    needs = _memory(graph, strategies, choice, costs) - freed + peak if budget is not None else 0
    if budget is not None and needs > budget:
        raise MemoryBudgetError(f"the starting plan needs {needs / 1e9:.2f} GB per rank, over the budget of "
                                f"{budget / 1e9:.2f} GB")
    steps, agree, subs = 0, _ByOffAxis(), {}
    made = None   # the axis whose step made the plan: every other axis solved since, none improving
    for round_ in range(max_rounds):
        improved, before, done = False, best, False
        for axis in range(naxes):
            if costs.mesh_shape[axis] == 1 or (round_ == 0 and axis in settled):
                continue
            if axis == made:   # its step would solve the program it solved last: the same plan
                done = True
                break
            keep = {n.name: agree(strategies[n.name], axis, choice[n.name]) for n in graph.nodes}
            sub = {}
            for name, idx in keep.items():   # equal index lists give one shared list (tying needs it)
                sub[name] = subs.setdefault((id(strategies[name]), tuple(idx)),
                                            [strategies[name][i] for i in idx])
            hint = {name: idx.index(choice[name]) for name, idx in keep.items()}
            left = max(1.0, time_limit - (time.perf_counter() - start))
            try:
                sol = solve(graph, sub, costs, left, budget, hint=hint, effort=STEP_EFFORT, relaxed_first=True)
            except NoPlanInTime:   # out of time with the incumbent still the best plan: keep it
                return Solution(choice, best, None, f"LOCAL_OPTIMUM ({steps} one-axis solves, stopped by the "
                                f"time limit)", time.perf_counter() - start, again)
            except NoBetterPlan:   # none found in the step's effort: the incumbent stays
                steps += 1
                continue
            steps += 1
            if sol.objective < best * (1 - 1e-9):
                choice = {name: keep[name][i] for name, i in sol.choice.items()}
                best, improved, again, made = sol.objective, True, sol.recompute, axis
        if done or not improved or best > before * (1 - GAP_LIMIT):
            break   # or a round that gained less than the solver's own gap: the next would gain less still
    return Solution(choice, best, None, f"LOCAL_OPTIMUM ({steps} one-axis solves)",
                    time.perf_counter() - start, again)


def lift(graph, coarse_strategies, coarse_choice: dict, groups, strategies) -> Optional[dict]:
    """The coarse plan on the fine mesh: ``groups[i]`` is how many fine axes coarse axis i covers
    (in order). None when a lifted strategy is not among the fine mesh's (a pin forbids it)."""
    indices: dict = {}   # per strategy list (shared by the layers of a stack)

    def nd(p):
        return tuple(q for q, k in zip(p, groups) for _ in range(k))

    choice = {}
    for n in graph.nodes:
        strats = strategies[n.name]
        if id(strats) not in indices:
            indices[id(strats)] = {s: i for i, s in enumerate(strats)}
        s = coarse_strategies[n.name][coarse_choice[n.name]]
        fine = type(s)(tuple(nd(p) for p in s.inputs), tuple(nd(p) for p in s.outputs))
        i = indices[id(strats)].get(fine)
        if i is None:
            return None
        choice[n.name] = i
    return choice


def coarsenings(mesh: tuple) -> list:
    """(coarse mesh, groups) for every way of merging neighbouring axes of ``mesh`` into fewer."""
    n, out = len(mesh), []
    for mask in range(1 << (n - 1)):        # bit i: the group ends after axis i
        sizes, run = [], 1
        for i in range(n - 1):
            if mask >> i & 1:
                sizes.append(run)
                run = 1
            else:
                run += 1
        sizes.append(run)
        if len(sizes) < n:
            ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
            coarse = tuple(math.prod(mesh[e - k:e]) for e, k in zip(ends, sizes))
            out.append((coarse, tuple(sizes)))
    return out


def solve_mesh(graph, strategies, costs: Costs, time_limit: float, budget: Optional[float],
               starts=lambda: [], settled: frozenset = frozenset()) -> Solution:
    """The whole integer program when the mesh has at most ``EXACT_AXES`` axes or the program is
    small enough; else descent from each plan ``starts()`` gives (None entries skipped), or from
    ``start_choice`` when it gives none, keeping the best. ``settled``: the axes on which the
    starts are already optimal, given their other axes (``unsplit``), which the descent's first
    round skips."""
    with uncollected():
        return _solve_mesh(graph, strategies, costs, time_limit, budget, starts, settled)


def _solve_mesh(graph, strategies, costs, time_limit, budget, starts, settled) -> Solution:
    if len(costs.mesh_shape) <= EXACT_AXES or edge_pairs(graph, strategies) <= EXACT_PAIRS:
        return solve(graph, strategies, costs, time_limit, budget)
    choices = [c for c in starts() if c is not None]
    if not choices:
        choices, settled = [start_choice(graph, strategies, costs, budget)], frozenset()
    return min((descend(graph, strategies, costs, c, time_limit, budget, settled=settled) for c in choices),
               key=lambda sol: sol.objective)


def unsplit(groups) -> frozenset:
    """The fine axes that a coarse axis covers alone (``lift``'s ``groups``). Where the coarse
    plan is a proven optimum, a descent step on such an axis asks again what the coarse solve
    chose for that axis with the others held, priced nearly alike (a collective over the split
    axes' joint group may cost a little more on the finer mesh than over the coarse axis, its
    latency paid per level of the hierarchy), so a descent's first round skips it; it is solved
    again in a later round, once a split axis's step has moved the plan. On the 96-layer GPT at
    world 1024 the eight refinements take 3.1 s instead of 4.0, the same plans."""
    fine, out = 0, set()
    for k in groups:
        if k == 1:
            out.add(fine)
        fine += k
    return frozenset(out)


def lifted_starts(graph, strategies, costs: Costs, time_limit: float, budget: Optional[float]) -> list:
    """The exact plans of every two-axis mesh this one coarsens to, lifted onto it (for a mesh
    with no pins: pins name this mesh's axes, which a coarser mesh lacks)."""
    starts = []
    for coarse, groups in coarsenings(costs.mesh_shape):
        if len(coarse) > EXACT_AXES:
            continue
        cs = annotate(graph, coarse)
        cc = Costs(graph, coarse, costs.cluster, costs.training, costs.bucket_bytes, costs.reshard,
                   recompute.mode_of(costs), costs.inputs)
        try:
            sol = solve(graph, cs, cc, time_limit, budget)
        except MemoryBudgetError:
            continue
        starts.append(lift(graph, cs, sol.choice, groups, strategies))
    return starts
