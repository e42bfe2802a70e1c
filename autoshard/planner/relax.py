"""The LP relaxation of the integer program (every variable continuous): the bound no plan of a
mesh beats (``lower_bound``), the linear recompute modes' bounds (``mode_bounds``), and the
relaxation's own plan where it is whole (``whole_plan``)."""
from __future__ import annotations

import math
from typing import Optional

from ortools.linear_solver import pywraplp

from autoshard.cost.price import Costs
from autoshard.ir import Graph
from autoshard.planner.progress import phase
from autoshard.planner import recompute
from autoshard.planner.backends import GAP_LIMIT, GLOP_DUAL, LP, PRIMAL
from autoshard.planner.program import build, least_bytes
from autoshard.planner.solution import Solution
from autoshard.planner.tables import program_cost, table_for, tables_of


def whole_plan(graph, strategies, costs, memory_budget, hint: Optional[dict] = None) -> Optional[Solution]:
    """The plan of the LP relaxation where every layout weight is 0 or 1: every other variable
    of the program follows from the layouts (a conversion's pair, the exposed communication's
    least value), so the relaxation's optimum is a plan of the program, and no plan beats it,
    proven without CP-SAT; its objective is the program's, as CP-SAT's would be (the
    96-layer GPT at world 1024: of four refinements' 8 descent steps, 6 whole, 0.04-0.07 s
    each with their pricing, against CP-SAT's 0.07-0.17 s after it). Where it is not whole, the
    better of its rounding (each node's heaviest strategy) and ``hint`` that fits the budget,
    when that comes within ``GAP_LIMIT`` of the relaxation's bound: the plan CP-SAT, which stops
    at that gap too, would stop at or near (the 96-layer GPT's (64, 8, 2) refinement: both
    steps' roundings 0.0009-0.0014% above their bounds, CP-SAT's plans found in 0.10-0.15 s at
    0.0000-0.0014%). Only without recomputation and user checkpoint regions, whose programs
    choose nothing beside the layouts; None elsewhere, or where neither plan is that close."""
    if recompute.mode_of(costs) != "none" or any(n.region is not None for n in graph.nodes):
        return None
    bound, weights = relaxation(graph, strategies, costs, memory_budget)
    if weights is None or math.isinf(bound):
        return None
    choice, whole = dict.fromkeys(strategies, 0), True
    for name, ws in weights.items():
        i = max(range(len(ws)), key=ws.__getitem__)
        whole = whole and ws[i] >= 1 - 1e-6
        choice[name] = i
    if whole:
        return Solution(choice, bound, bound, "OPTIMAL", 0.0, {})
    lp = tables_of(costs).relaxed_get(strategies, "relaxation", memory_budget, "none")[1] \
        if memory_budget is not None else None
    if lp is not None and getattr(lp, "mode", "none") != "none":
        return None   # its program moved to another recompute mode since (``_switch``): no row to read
    best = None
    for plan in (choice, hint):
        if plan is not None and (lp is None or _within_budget(lp, graph, strategies, plan)):
            cost = program_cost(graph, strategies, plan, costs)
            if best is None or cost < best[1]:
                best = (plan, cost)
    if best is None or best[1] - bound > GAP_LIMIT * best[1]:
        return None
    return Solution(dict(best[0]), best[1], bound, "OPTIMAL", 0.0, {})


def _within_budget(lp, graph, strategies, choice: dict) -> bool:
    """Whether the plan ``choice`` keeps the budget row of ``lp`` (a relaxation built with a
    budget), its variables set as the plan sets them: a layout's 1 where chosen, a conversion's pair 1
    where both its layouts are; False where twins, which share variables, choose apart."""
    x, placed = lp.layout
    value: dict = {}
    for name, vs in x.items():
        if vs is None:
            continue
        for i, var in enumerate(vs):
            if value.setdefault(var, i == choice[name]) != (i == choice[name]):
                return False
    for (u, v_, v, slot, *_), spots in placed:
        chosen = (strategies[u.name][choice[u.name]].outputs[v_[1]], strategies[v.name][choice[v.name]].inputs[slot])
        for var, pair in spots:
            if var is not None and var not in value:
                value[var] = pair == chosen
    terms, limit = lp.budget_row
    return sum(c for var, c in terms.items() if value.get(var)) <= limit * (1 + 1e-9)


def lower_bound(graph: Graph, strategies: dict, costs: Costs, memory_budget: Optional[float] = None,
                quick: bool = False) -> float:
    """Seconds no plan of this graph on this mesh can beat: the LP relaxation of the integer
    program (``LP``). inf when even the relaxation breaks the memory budget. Under
    ``recompute="auto"`` and a budget, the least of its linear modes' (``mode_bounds``);
    ``quick``: with the cheap ops recomputed bounded by their floor alone, never by their own
    relaxation, a bound as good wherever that floor prunes (a mesh search asks again, not
    quick, of a mesh it goes on to solve: the relaxations made are kept, so that costs one
    relaxation at most)."""
    if recompute.chooses(graph, strategies, costs, memory_budget):
        return min(mode_bounds(graph, strategies, costs, memory_budget, quick).values())
    return relaxation(graph, strategies, costs, memory_budget)[0]


def mode_bounds(graph, strategies, costs, memory_budget, quick: bool = False) -> dict:
    """recompute mode -> seconds none of its plans under the budget beats, for the linear modes
    ``"auto"`` chooses among. ``"none"``'s LP relaxation first: where the budget is slack at its
    optimum it binds nothing, and ``"none"`` is the only mode (recomputation only adds). Else
    ``"blocks"``'s floor (``recompute.floor``, no program); its LP relaxation only where nothing
    fits without recomputation (GPT-3 175B), to tell whether anything fits at all: elsewhere
    ``solve`` in that mode, when the floor lets it beat the best plan, has the relaxation as its
    first step anyway; and ``"selective"``'s floor, raised by its LP relaxation where the floor
    lies below ``"none"``'s bound (elsewhere no value of it moves the least; ``quick``: not
    raised but where nothing fits without recomputation, a weaker bound for
    ``lower_bound(quick=True)``). Both are ``"none"``'s program with its coefficients moved
    (``_switch``), not programs of their own. inf: nothing fits in that
    mode. A mesh search bounds each mesh with the
    least of them: the weak relaxation of the whole choice (a fractional block recomputed frees
    its memory at a fraction of its forward) would bound every mesh of the 96-layer GPT at its
    cost without a budget, and prune none."""
    out = {"none": relaxation(graph, strategies, costs.with_recompute("none"), memory_budget)[0]}
    if tables_of(costs).relaxed_get(strategies, "slack", memory_budget, "none"):
        return out
    table = table_for(graph, strategies, costs)
    out["blocks"] = recompute.floor(table, costs)
    if math.isinf(out["none"]):
        blocks = costs.with_recompute("blocks")
        out["blocks"] = max(out["blocks"], relaxation(graph, strategies, blocks, memory_budget)[0])
    selective = costs.with_recompute(recompute.SELECTIVE)
    light = recompute.floor(table, selective, light=True)
    # its relaxation only where its floor lies below "none"'s bound: elsewhere no value of
    # it moves the modes' least, and its floor is its bound (the 96-layer GPT at world 1024:
    # the floor 0.982 s on every two-axis mesh, "none"'s relaxation 0.939-0.963 s on seven
    # of the nine, a fifth of each mesh's bound saved)
    # quick: not where nothing fits without recomputation, whose relaxation says whether
    # anything fits at all (a quick bound is finite where the exact one is)
    out[recompute.SELECTIVE] = light if (quick and not math.isinf(out["none"])) or light >= out["none"] else \
        max(light, relaxation(graph, strategies, selective, memory_budget)[0])
    return out


def relaxation(graph, strategies, costs: Costs, memory_budget) -> tuple:
    """(bound, weights) of the LP relaxation, once per strategies dict and budget: the bound in
    seconds, and each node's LP weight per strategy (None when the LP solver gave no optimum)."""
    kept = tables_of(costs)
    mode = recompute.mode_of(costs)
    key = ("relaxation", memory_budget, mode)   # planner.recompute asks for several
    hit = kept.relaxed_get(strategies, *key)
    if hit is not None:
        return hit[0]
    base = kept.relaxed_get(strategies, "program", memory_budget)
    fresh = not (base is not None and mode in _SWITCHED)
    if fresh:
        lp = LP()
        _, objective, _ = build(lp, graph, strategies, costs, memory_budget, unit=1e6)
        lp.minimize(*objective)
        if mode == "none" and memory_budget is not None:   # the program the other linear modes move
            lp.mode, lp.delta, lp.peak = "none", None, None
            kept.relaxed_put(strategies, ("program", memory_budget), lp)
    else:
        lp = base
        _switch(lp, table_for(graph, strategies, costs), costs, mode)
    if lp.params != PRIMAL:   # GLOP's primal simplex, once a dual one has lost its way, for good
        lp.engine, lp.params = ("CLP", "") if mode == "none" else ("GLOP", GLOP_DUAL)
    x = lp.layout[0]
    with phase("solve"):
        if mode == "none" and memory_budget is not None and \
                least_bytes(table_for(graph, strategies, costs)) > memory_budget:
            # every node's least bytes alone break the budget: infeasible without the simplex
            # (GPT-3 175B: two simplex runs per mesh, the dual's failing)
            status = pywraplp.Solver.INFEASIBLE
        else:
            status = lp.solve()
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.INFEASIBLE):
            # a dual simplex may lose its way on programs that nothing fits (GLOP's on GPT-3
            # 175B without recomputation: ABNORMAL on every mesh, so no bound pruned any);
            # GLOP's primal simplex proves them infeasible in a tenth of a second
            lp.engine, lp.params = "GLOP", PRIMAL
            status = lp.solve()
    if status == pywraplp.Solver.INFEASIBLE:
        out = (math.inf, None)
    elif status != pywraplp.Solver.OPTIMAL:
        out = (0.0, None)
    else:
        values: dict = {}   # twins share their variables: read each list once
        weights = {name: values[id(vs)] if id(vs) in values else values.setdefault(id(vs), [lp.values[v] for v in vs])
                   for name, vs in x.items() if vs is not None}
        out = (lp.value / 1e6, weights)
        row = getattr(lp, "budget_row", None) if fresh else None   # a moved program's row has moved
        if row is not None and sum(c * lp.values[v] for v, c in row[0].items()) < row[1] * (1 - 1e-6):
            # the budget is slack at the optimum: the LP without it has the same optimum (convex),
            # so a later ask without a budget need not be solved again
            kept.relaxed_put(strategies, ("relaxation", None, mode), (out, None))
            kept.relaxed_put(strategies, ("slack", memory_budget, mode), True)   # mode_bounds: the budget binds nothing
    kept.relaxed_put(strategies, key, (out, lp))
    kept.trim()
    return out


_SWITCHED = ("none", "blocks", recompute.SELECTIVE)   # the linear modes, one program between them


def _switch(lp, table, costs, mode: str) -> None:
    """Turn ``lp``, the LP relaxation built without recomputation under a budget, into
    ``mode``'s (any of ``_SWITCHED``) in place: every block's forward again onto the objective
    (and onto the backward's compute, which the exposed communication's row subtracts), what it
    frees off the budget row, one block's back on it (the peak). Only coefficients and bounds
    move, so a mesh's linear modes cost one program's build, not three."""
    if lp.mode == mode:
        return
    if lp.delta is not None:
        _move(lp, lp.delta, -1)   # back to "none"
    lp.mode, lp.delta = mode, None
    if mode == "none":
        return
    x, placed = lp.layout
    forms = recompute._forms(table, x, placed, costs, 1e6, False, 1e-9, light=mode == recompute.SELECTIVE)
    if lp.peak is None:
        lp.peak = lp.num_var(0.0, math.inf)
    # peak >= D(x) for each class of blocks: rows of their own, dropped (lower bound -inf) on the way back
    rows = [lp.at_least(recompute._minus({lp.peak: 1}, d.terms), d.const) for _, (_, _, d) in forms.values()]
    lp.delta = (recompute.every_block(forms), rows)
    _move(lp, lp.delta, 1)


def _move(lp, delta, sign: int) -> None:
    """Add (``sign`` 1) or take back (-1) ``_switch``'s change of coefficients."""
    (cost, (freed, less)), rows = delta
    budget, exposed = lp.budget_ct, lp.exposed.get("bwd")

    def shift(coef: dict, terms: dict) -> None:
        for var, c in terms.items():
            coef[var] = coef.get(var, 0.0) + sign * c

    for part, (terms, const) in cost.items():
        shift(lp.objective, terms)
        lp.offset += sign * const
    if exposed is not None:   # exposed - hidden + compute >= 0
        terms, const = cost["compute_bwd"]
        shift(exposed.terms, terms)
        exposed.lo -= sign * const
    shift(budget.terms, freed)
    budget.hi -= sign * less
    budget.terms[lp.peak] = 1.0 if sign > 0 else 0.0
    if sign < 0:
        for row in rows:
            row.lo = -math.inf
