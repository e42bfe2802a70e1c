"""Solve: pick one strategy per node, minimum estimated step time, by the integer program of
``planner.program``: its LP relaxation first (``planner.relax``), which bounds the mesh and
whose support, solved alone, often proves its plan (``_solve_support``); then CP-SAT on the
whole program, hinted with that plan. Under ``recompute="auto"`` and a budget, each linear
recompute mode's program in turn (``_solve_choosing``). A mesh search asks a later mesh only
for a plan under the best so far (``below``: the objective's domain).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional

from ortools.sat.python import cp_model

from autoshard import placement as pl
from autoshard.cost import memory
from autoshard.cost.price import Costs
from autoshard.ir import Graph
from autoshard.planner.progress import Progress
from autoshard.planner import recompute
from autoshard.planner.backends import GAP_LIMIT, CpSat, read_choice, run
from autoshard.planner.program import INTEGER_UNITS, PICO, Sums, build, edge_vars, kept_terms, memory_terms, node_vars, \
    plus, units
from autoshard.planner.relax import lower_bound, mode_bounds, relaxation, whole_plan
from autoshard.planner.repeat import tie_repeated
from autoshard.planner.solution import MemoryBudgetError, NoBetterPlan, NoPlanInTime, Solution
from autoshard.planner.tables import choice_cost, plan_price, program_cost, table_for, tables_of

# what the planner's other modules import from here, each from the module that holds it
__all__ = ["GAP_LIMIT", "MemoryBudgetError", "NoBetterPlan", "NoPlanInTime", "Solution", "choice_cost", "lower_bound",
           "plan_price", "program_cost", "solve"]


def solve(graph: Graph, strategies: dict, costs: Costs, time_limit: float = 60.0,
          memory_budget: Optional[float] = None, hint: Optional[dict] = None,
          below: Optional[float] = None, effort: Optional[float] = None, support: bool = True,
          relaxed_first: bool = False) -> Solution:
    """The cheapest strategy per node. ``hint`` (node name -> strategy index), a plan the solver
    starts from. ``below`` (seconds): only a plan cheaper than that will do (a mesh search's best
    so far); raises ``NoBetterPlan`` when there is none. ``effort``: CP-SAT's deterministic
    seconds for the whole program once the LP's support has not proven its plan (0: return that
    plan as it is, with the LP's bound): what a mesh search spends on a mesh that only might win.
    ``support=False`` skips the LP support's plan: CP-SAT alone on the whole program, as a mesh
    search does for a mesh whose support plan it already has. ``relaxed_first``: the LP
    relaxation's plan where it is whole (``whole_plan``), before CP-SAT (a descent's steps)."""
    start = time.perf_counter()
    if relaxed_first:
        whole = whole_plan(graph, strategies, costs, memory_budget, hint)
        if whole is not None:
            return replace(whole, seconds=time.perf_counter() - start)
    if hint is None and recompute.chooses(graph, strategies, costs, memory_budget):
        found = _solve_choosing(graph, strategies, costs, time_limit, memory_budget, below, effort, support)
        return replace(found, seconds=time.perf_counter() - start)   # its bounds and every mode's solve
    relaxed = 0.0
    if hint is None:   # a whole solve (a descent's steps bring their own plan, and need no proof)
        relaxed, weights = relaxation(graph, strategies, costs, memory_budget)
        if below is not None and relaxed >= below:
            raise NoBetterPlan(True)
        if weights is not None and support:
            quick = _solve_support(graph, strategies, costs, time_limit, memory_budget, weights)
            if quick is not None and quick.objective - relaxed <= GAP_LIMIT * quick.objective and \
                    (below is None or quick.objective < below):
                return Solution(quick.choice, quick.objective, min(relaxed, quick.objective), "OPTIMAL",
                                time.perf_counter() - start, quick.recompute)
            if effort == 0:
                if quick is None or (below is not None and quick.objective >= below):
                    raise NoBetterPlan(False)
                return Solution(quick.choice, quick.objective, min(relaxed, quick.objective), "FEASIBLE",
                                time.perf_counter() - start, quick.recompute)
            hint = quick.choice if quick is not None else None
        if effort == 0 and hint is None:
            # no plan to return as it is (the LP gave no optimum: GPT-3 175B's (16, 64) with every
            # block recomputed), and CP-SAT given no time finds none: building it is wasted
            if below is not None:
                raise NoBetterPlan(False)
            raise NoPlanInTime("the layout solver was given no time and the LP relaxation no plan")
    for unit in units(table_for(graph, strategies, costs)):
        model = CpSat()
        try:
            x, objective, handles = build(model, graph, strategies, costs, memory_budget, unit)
            model.minimize(*objective)
        except TypeError:   # a variable's domain past int64
            if unit == INTEGER_UNITS[-1]:
                raise
            continue
        if "overflow" not in model.model.validate():
            break
    if below is not None:
        # as the objective's domain, not a constraint: a constraint's terms must keep their
        # largest sum within int64, and GPT-3's do not
        limit = int(round(below * unit)) - objective[1]
        if limit < 0:
            raise NoBetterPlan(True)
        model.model.proto.objective.domain.extend([0, limit])
    hinted = set()
    for name, i in (hint or {}).items():
        if x[name] is not None and id(x[name]) not in hinted:   # twins share their variables
            hinted.add(id(x[name]))
            for k, v in enumerate(x[name]):
                model.model.add_hint(v, k == i)
    solver, status = run(model.model, time_limit, Progress(f"solving mesh {tuple(costs.mesh_shape)}"), unit,
                          relaxed if 0 < relaxed < math.inf else None, effort)
    name = solver.status_name(status)
    if below is not None and status in (cp_model.INFEASIBLE, cp_model.UNKNOWN):
        raise NoBetterPlan(status == cp_model.INFEASIBLE)
    if status == cp_model.INFEASIBLE and memory_budget is not None:
        raise MemoryBudgetError(_memory_message(graph, strategies, costs, memory_budget, time_limit))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise NoPlanInTime(f"the layout solver stopped without a plan ({name}) after {time_limit:.0f} s; "
                           "raise time_limit= or plan a smaller model")
    choice = read_choice(graph, x, solver)
    again = handles.counts(solver.boolean_value)
    obj = solver.objective_value / unit
    bound = max(solver.best_objective_bound / unit, relaxed if relaxed < math.inf else 0.0)
    if name == "FEASIBLE" and obj - bound <= GAP_LIMIT * obj:   # proven by the LP's bound
        name = "OPTIMAL"
    return Solution(choice, obj, min(bound, obj), name, time.perf_counter() - start, again)


def _solve_choosing(graph, strategies, costs, time_limit, memory_budget, below, effort, support) -> Solution:
    """``recompute="auto"`` under a budget: the plan of each linear mode (no block, every block's
    cheap ops, every block recomputed) that its bound (``mode_bounds``) lets beat the best so far, best bound first
    (each solved and proven as any); each layout with the fewest blocks recomputed that fit it;
    then, where recomputation is in play, the whole choice (planner.recompute's products of
    layouts and counts, whose relaxation is weak) from the best of them, for at most
    ``recompute.EFFORT`` deterministic seconds. The bound is the modes' least: a plan
    recomputing some blocks only is sought from their layouts, where one of their plans
    recomputes any, not proven (the 96-layer GPT, whose every block recomputed cannot beat
    its plan without, is not searched for one)."""
    start = time.perf_counter()
    bounds = mode_bounds(graph, strategies, costs, memory_budget)
    bound = min(bounds.values())
    if below is not None and bound >= below:
        raise NoBetterPlan(True)
    if list(bounds) == ["none"]:   # the budget binds nothing: recomputation, which only frees memory, cannot help
        return solve(graph, strategies, costs.with_recompute("none"), time_limit, memory_budget, below=below,
                     effort=effort, support=support)
    found, beaten, proven = [], False, dict(bounds)   # proven: each mode's bound, its solve's where it ran
    # best bound first; but the mode whose plan led when this mesh was solved before first of
    # all: the others then only for a plan that beats it, at a bounded effort (a mesh search's
    # second look at the 96-layer GPT's (512, 2) spent a minute on a plan without recomputation,
    # whose bound is lower, before the plan with the cheap ops recomputed that led)
    led = tables_of(costs).relaxed_get(strategies, "led")
    for mode in sorted(bounds, key=lambda m: (m != led, bounds[m])):
        best = min((sol.objective for sol in found), default=math.inf)
        if math.isinf(bounds[mode]) or bounds[mode] >= best * (1 - GAP_LIMIT):
            continue   # nothing fits in this mode, or it cannot beat the plan found
        if below is not None and bounds[mode] >= below:
            beaten = True
            continue
        try:   # once a mode has a plan, another only for a plan that beats it, for a bounded effort
            cap = effort if not found else min(effort if effort is not None else recompute.EFFORT, recompute.EFFORT)
            target = below if not found else min(b for b in (below, best) if b is not None)
            # "blocks"' plan whatever it costs: its layout with the fewest whole blocks that fit
            # may beat what every block recomputed does not (GPT-3 175B's (64, 16))
            target = None if mode == "blocks" else target
            found.append(solve(graph, strategies, costs.with_recompute(mode), time_limit, memory_budget,
                               below=target, effort=cap, support=support))
            proven[mode] = max(proven[mode], found[-1].bound or 0.0)
        except NoBetterPlan as e:
            beaten = True
            if e.proven and target is not None:   # no plan of this mode beats the target: its bound
                proven[mode] = max(proven[mode], target)
        except (RuntimeError, MemoryBudgetError):
            pass
    if not found:
        if beaten or effort is not None:   # or a bounded look found none: a search looks again, whole
            raise NoBetterPlan(False)
        # every block recomputed is the least memory there is: its plan, or the error that says
        # nothing fits (a 96-layer GPT at world 8 found none in a mesh search's first, bounded
        # look, and the search stopped on "no plan in time" where the mesh (8,) alone had one)
        found.append(solve(graph, strategies, costs.with_recompute("blocks"), time_limit, memory_budget, below=below,
                           support=support))
    # each layout with the fewest whole blocks recomputed that fit it: a layout chosen with every
    # block's cheap ops run again too (a 6-layer GPT on (4,) under a tight budget: 2 whole blocks,
    # 9% below the cheap ops of all 6, where "blocks"' bound let its own program be skipped)
    for sol in list(found):
        again = recompute.best_counts(graph, strategies, sol.choice, costs, memory_budget)
        if again != sol.recompute:
            extra = recompute.chosen(graph, strategies, sol.choice, costs, again)[0]
            found.append(Solution(sol.choice, program_cost(graph, strategies, sol.choice, costs, extra), None,
                                  "FEASIBLE", 0.0, again))
    best = min(found, key=lambda sol: sol.objective)
    led = recompute.SELECTIVE if best.recompute.get(recompute.SELECTIVE) else \
        "blocks" if any(best.recompute.values()) else "none"
    tables_of(costs).relaxed_put(strategies, ("led",), led)
    # 0: a mesh search's first look, the best as it is; and where the best plan recomputes no
    # whole block, the choice has no count to start from (the 96-layer GPT, whose best runs
    # every block's cheap ops again)
    counted = led == "blocks"
    if counted and effort == 0:
        # a plan recomputing some blocks may beat every mode's bound: the bound of any plan, so
        # that a mesh search solves the choice when it comes back to this mesh
        proven["any"] = recompute.floor(table_for(graph, strategies, costs), costs, again=False)
    if effort != 0 and counted:
        try:
            chosen = solve(graph, strategies, costs, time_limit, memory_budget, hint=best.choice,
                           below=best.objective, effort=min(effort or recompute.EFFORT, recompute.EFFORT))
            best = chosen if chosen.objective < best.objective else best
        except NoBetterPlan:
            pass
    if below is not None and best.objective >= below:
        raise NoBetterPlan(False)
    bound = min(min(proven.values()), best.objective)
    status = "OPTIMAL" if best.objective - bound <= GAP_LIMIT * best.objective else "FEASIBLE"
    return Solution(best.choice, best.objective, bound, status, time.perf_counter() - start, best.recompute)


SUPPORT = 1e-6   # an LP weight above this puts the strategy in the relaxation's support
# CP-SAT's deterministic seconds for the plan among the support: a blink where the relaxation is
# tight, but a minute without proof where the budget binds (the 96-layer GPT's (512, 2) without
# recomputation), which the whole program, hinted with its best, does better with


SUPPORT_EFFORT = 5.0


def _solve_support(graph, strategies, costs, time_limit, memory_budget, weights) -> Optional[Solution]:
    """The best plan among the strategies the LP relaxation gives weight (fixing every node it
    decides outright): a program a fraction of the size, solved in a blink. The relaxation is
    nearly tight on these programs, so this plan is often within ``GAP_LIMIT`` of its bound,
    which proves it (a Llama-3-style model on mesh (8, 8): 0.02 s, where the whole program takes
    CP-SAT half a minute to close). None when the support holds no plan (the memory budget)."""
    rep = tie_repeated(graph, strategies)
    shared: dict = {}   # twins keep sharing their lists, so they stay tied
    sub, index = {}, {}
    for n in graph.nodes:
        w = weights.get(rep[n.name])
        idx = list(range(len(strategies[n.name]))) if w is None else [i for i, v in enumerate(w) if v > SUPPORT]
        key = (id(strategies[n.name]), tuple(idx))
        if key not in shared:
            shared[key] = [strategies[n.name][i] for i in idx]
        sub[n.name], index[n.name] = shared[key], idx
    hint = {name: max(range(len(idx)), key=lambda k: weights[rep[name]][idx[k]]) for name, idx in index.items()
            if rep[name] in weights}
    try:
        found = solve(graph, sub, costs, time_limit, memory_budget, hint=hint, effort=SUPPORT_EFFORT)
    except (MemoryBudgetError, RuntimeError):
        return None
    return Solution({name: index[name][i] for name, i in found.choice.items()}, found.objective, None,
                    found.status, found.seconds, found.recompute)


def _memory_message(graph, strategies, costs, budget, time_limit) -> str:
    """What the least memory any layout reaches is, and which tensors take it."""
    model = CpSat()
    table = table_for(graph, strategies, costs)
    x = node_vars(model, table, Sums())
    kept: dict = {}
    placed: list = []
    sums = Sums()
    edge_vars(model, table, x, sums, kept, placed)
    again, handles = recompute.add_terms(model, table, x, placed, costs, sums, PICO, True, 1, True)
    model.minimize(*plus(memory_terms(table, x), kept_terms(kept), again))
    solver, status = run(model.model, time_limit)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return f"no layout fits in a memory budget of {_gb(budget)} per rank"
    choice = read_choice(graph, x, solver)
    parts = memory.rank_memory(graph, strategies, choice, costs.mesh_shape, costs.training, costs.reshard)
    _, freed, peak, _ = recompute.chosen(graph, strategies, choice, costs, handles.counts(solver.boolean_value))
    parts["activations"] += peak - freed
    parts["total"] += peak - freed
    sizes = []
    for n in graph.nodes:
        s = strategies[n.name][choice[n.name]]
        b = costs.memory(n, s)
        if b and n.outputs:
            local = pl.local_shape(n.outputs[0].shape, s.outputs[0], costs.mesh_shape)
            sizes.append((b, n.fqn or n.name, list(local), pl.format_nd(s.outputs[0])))
    sizes.sort(key=lambda t: -t[0])
    top = "; ".join(f"{name} {shape} {place} {_gb(b)}" for b, name, shape, place in sizes[:5])
    return (f"no layout of this model fits in {_gb(budget)} per rank on mesh {tuple(costs.mesh_shape)}: the "
            f"least it can reach is {_gb(parts['total'])} (parameters {_gb(parts['parameters'])}, gradients "
            f"{_gb(parts['gradients'])}, optimizer state {_gb(parts['optimizer'])}, activations "
            f"{_gb(parts['activations'])}). Largest per rank in that layout: {top}. Raise memory_budget=, "
            "plan for more devices, or shrink the batch or the model.")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
