"""Solve: pick one strategy per node, minimum estimated step time.

The integer program (built by ``_build``, solved by ``solve``):

    x[n, s] in {0, 1}              node n runs strategy s; the nodes of repeated blocks share
                                   their twin's x and y (planner.repeat)   (_node_vars)
    sum_s x[n, s] = 1              exactly one strategy per node           (_node_vars)
    y[e, a, b] in {0, 1}           edge e carries layout a, consumed as b  (_edge_vars)
    sum_b y[e, a, b] = sum_{s: out_e(s) = a} x[u, s]                       (_edge_vars)
    sum_a y[e, a, b] = sum_{s: in_e(s) = b}  x[v, s]                       (_edge_vars)
    C_k = sum x[n, s] * node_cost_k(n, s) + sum y[e, a, b] * convert_k(a -> b)   per part k  (_Sums)
    e_ph >= hidden_ph - compute_ph,  e_ph >= 0       for ph in fwd, bwd                     (_build)
    sum x[n, s] * bytes(n, s) + sum y[e, a, b] * kept(a -> b) <= memory budget   (_memory_terms)
        less what recomputed blocks free, plus one block's while it runs again, and their
        forward again added to the cost                                (planner.recompute.add_terms)
    minimise  compute_fwd + compute_bwd + comm + e_fwd + e_bwd
              + DRAG * (hidden_fwd + hidden_bwd) + optimizer                                (cost.step)

node_cost is compute (forward, plus backward when training), the collectives an op's lowering
issues, and for a parameter stored broadcast its bucketed gradient all-reduce (on a measured
cluster also each launch, and a parameter's optimizer step over its share); convert is the
conversion's forward plus its dual backward (cost.comm), less what the schedule hides of an
activation's beside compute (cost.overlap.edge_price); both are priced by
``cost.price.Costs``. Parameter collectives that the schedule
pass overlaps are "hidden" parts: they cost only what their phase's compute does not cover. An
edge whose producer or consumer has a single layout adds its cost straight onto the other side's
x. Costs are integers in picoseconds (nanoseconds where picoseconds overflow int64). CP-SAT runs
with one worker and a fixed seed, so the same graph gives the same plan on every machine. The LP
relaxation (every variable continuous), which bounds a mesh and points CP-SAT at its plan, is
solved by a dual simplex without presolve: COIN-OR's CLP, which OR-Tools carries, where nothing is
recomputed, GLOP's where blocks are (``_LP``).

The program's data (every tied node's strategy costs and bytes, every tied edge's layout groups
and conversion costs) is priced once per strategies dict into a table (``_table``) that the LP
bound, the integer program and the memory report all read; a descent's steps, which offer the
same strategies again, reuse each node's and each pair of strategy lists' prices. A mesh search
asks a later mesh only for a plan under the best so far (``below``: the objective's domain).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.sat.python import cp_model

from autoshard import placement as pl
from autoshard.cost import memory
from autoshard.cost.price import Costs
from autoshard.cost.step import DRAG, PARTS, Cost
from autoshard.ir import Graph
from autoshard.planner.progress import Progress, phase
from autoshard.planner import recompute
from autoshard.planner.repeat import TABLES_KEPT, tally, tie_repeated, tied_plan, twin_edges

PICO = 1e12
# CP-SAT counts in picoseconds, or in nanoseconds where picoseconds would let a sum of the
# program's terms leave int64 (GPT-3 175B at world 1024: seconds per step over 96 layers)
INTEGER_UNITS = (PICO, 1e9)
GAP_LIMIT = 1e-3   # stop once the plan is proven within 0.1% of the best: closing the last sliver can take minutes


@dataclass
class Solution:
    choice: dict        # node name -> index into its strategies
    objective: float    # seconds
    bound: Optional[float]   # seconds, proven lower bound; None when nothing is proven (planner.descend)
    status: str
    seconds: float      # wall time of the solve
    recompute: dict = field(default_factory=dict)   # block group -> how many of its blocks recompute (planner.recompute)

    @property
    def gap(self) -> Optional[float]:
        if self.bound is None:
            return None
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


class _Sums:
    """One linear expression per cost part (``cost.step.PARTS``): coefficients on variables and a
    constant, in picoseconds."""

    def __init__(self, unit: float = PICO):
        self.unit = unit   # the LP relaxation counts in microseconds: GLOP loses precision at 1e12
        self.coef = {part: {} for part in PARTS}
        self.const = {part: 0 for part in PARTS}
        self._scaled: dict = {}   # cost vector -> its nonzero parts in ``unit``: costs repeat by the thousand

    def add(self, var, vec: tuple, times: int = 1) -> None:
        """Add ``times`` copies of a cost (``_vec``: seconds per part) on ``var`` (None: the
        constant)."""
        scaled = self._scaled.get(vec)
        if scaled is None:
            integer = self.unit in INTEGER_UNITS
            scaled = self._scaled[vec] = tuple((part, self.coef[part], int(round(x * self.unit)) if integer
                                                else x * self.unit) for part, x in zip(PARTS, vec) if x)
        if var is None:
            for part, _, c in scaled:
                self.const[part] += times * c
            return
        for _, terms, c in scaled:
            terms[var] = terms.get(var, 0) + times * c

    def terms(self, *parts, scale: float = 1.0) -> tuple:
        """(coefficient per variable, constant) of the parts' sum, each times ``scale``."""
        r = (lambda c: int(round(c))) if self.unit in INTEGER_UNITS else (lambda c: c)
        out, const = {}, 0
        for part in parts:
            for v, c in self.coef[part].items():
                out[v] = out.get(v, 0) + c * scale
            const += self.const[part] * scale
        return {v: r(c) for v, c in out.items()}, r(const)

    def most(self, part) -> int:
        return sum(max(c, 0) for c in self.coef[part].values()) + max(self.const[part], 0)


def _plus(*sums) -> tuple:
    """The sum of (terms, constant) pairs."""
    out, const = {}, 0
    for terms, c in sums:
        for v, k in terms.items():
            out[v] = out.get(v, 0) + k
        const += c
    return out, const


class MemoryBudgetError(ValueError):
    """No layout fits the memory budget; the message says what the model can reach."""


def _vec(cost: Cost) -> tuple:
    """A cost's parts (``cost.step.PARTS``) as a tuple of seconds."""
    return tuple(getattr(cost, part) for part in PARTS)


@dataclass
class _Table:
    """The program's data, from the cost models, for one strategies dict on one mesh: worked out
    once, read by every program built on it (the LP bound, the integer program, the memory
    report). Tied nodes and edges appear once, with how many times they occur."""
    rep: dict     # node name -> the name of the node whose variables it shares
    nodes: list   # (node, times, cost vector per strategy, bytes per strategy)
    edges: list   # (u, value, v, slot, times, src groups, dst groups, {(a, b): (cost vector, kept bytes)})
    magnitude: Optional[float] = None   # seconds: every cost summed, times its count (``_units``)


def _units(table: _Table) -> tuple:
    """The ``INTEGER_UNITS`` to try in turn, less those in which the sum of every cost the
    program holds passes 2^62, which CP-SAT's check for overflow refuses for certain (GPT-3
    175B's picoseconds: each of its programs was built twice)."""
    if table.magnitude is None:
        total = sum(times * sum(sum(map(abs, vec)) for vec in vecs) for _, times, vecs, _ in table.nodes)
        table.magnitude = total + sum(edge[4] * sum(sum(map(abs, vec)) for vec, _ in edge[7].values())
                                      for edge in table.edges)
    return tuple(u for u in INTEGER_UNITS if table.magnitude * u <= 2 ** 62) or INTEGER_UNITS[-1:]


def _table(graph, strategies, costs: Costs) -> _Table:
    hit = costs._tables.get(id(strategies))
    if hit is not None and hit[0] is strategies:
        return hit[1]
    with phase("cost"):
        rep = tie_repeated(graph, strategies)
        count = tally(rep[n.name] for n in graph.nodes)
        nodes = []
        for n in graph.nodes:
            if rep[n.name] != n.name:
                continue
            priced = [_node_cost(costs, n, st) for st in strategies[n.name]]
            nodes.append((n, count[n.name], [c for c, _ in priced], [b for _, b in priced]))
        edges = [(u, value, v, slot, times) + _pairs(costs, strategies, u, value, v, slot)
                 for u, value, v, slot, times in twin_edges(graph, rep)]
        table = _Table(rep, nodes, edges)
    costs._tables[id(strategies)] = (strategies, table)
    while len(costs._tables) > TABLES_KEPT:
        costs._tables.pop(next(iter(costs._tables)))
    return table


def _node_cost(costs: Costs, n, strat) -> tuple:
    """(cost vector, bytes) of one node's strategy, once per mesh: a descent's steps offer the
    same strategies again."""
    key = (n.name, id(strat))
    hit = costs._nodes.get(key)
    if hit is None or hit[0] is not strat:
        hit = costs._nodes[key] = (strat, _vec(costs.node(n, strat)), costs.memory(n, strat))
    return hit[1], hit[2]


def _pairs(costs: Costs, strategies, u, value, v, slot) -> tuple:
    """(src groups, dst groups, {(a, b): (cost vector, kept bytes)}) of one edge: the producer's
    output layouts, the consumer's input layouts, and every conversion between them. Edges
    between the same strategy lists with the same tensor and consumer price alike; they share
    one answer."""
    us, vs = strategies[u.name], strategies[v.name]
    # each pair once per edge price key, whatever the strategy lists: a descent's steps offer
    # the edges their layouts again in lists of their own, and the blocks' edges repeat
    price = costs.price_key(value, v, slot)
    key = (price, value[1], slot, id(us), id(vs))
    hit = costs._pairs.get(key)
    if hit is not None and hit[0] is us and hit[1] is vs:
        return hit[2]
    src = _groups(us, lambda st: st.outputs[value[1]])
    dst = _groups(vs, lambda st: st.inputs[slot])
    pairs = {}
    for a in src:   # in this order, which _edge_vars reads its variables back by
        for b in dst:
            _, vec, kept = costs.pair(value, v, slot, a, b, price)
            pairs[a, b] = (vec, kept)
    costs._pairs[key] = (us, vs, (src, dst, pairs))
    return src, dst, pairs


def _build(model, graph, strategies, costs, memory_budget, unit=PICO):
    """The integer program of the module docstring on ``model`` (``_CpSat``, or ``_LP`` for its
    relaxation); returns the x variables and the objective as (terms, constant), in ``unit`` per
    second."""
    table = _table(graph, strategies, costs)
    with phase("build"):
        sums = _Sums(unit)
        x = _node_vars(model, table, sums)
        kept: dict = {}
        placed: list = []
        _edge_vars(model, table, x, sums, kept, placed)
        model.layout, model.exposed = (x, placed), {}
        integer = unit in INTEGER_UNITS
        scale = 1 if integer else 1e-9   # the LP counts gigabytes
        again, handles = recompute.add_terms(model, table, x, placed, costs, sums, unit, integer, scale,
                                             memory_budget is not None)
        # the user's checkpoint regions: one region's activations back while its backward runs
        again = _plus(again, recompute.region_terms(model, strategies, table, x, placed, costs, scale,
                                                    memory_budget is not None))
        objective = sums.terms("compute_fwd", "compute_bwd", "comm", "optimizer")
        for ph in ("fwd", "bwd"):
            # exposed = max(0, hidden - compute) of the phase (cost.step)
            hidden, work = f"hidden_{ph}", f"compute_{ph}"
            if not sums.most(hidden):
                continue
            exposed = model.int_var(0, sums.most(hidden))
            # exposed - hidden + compute >= 0
            terms, const = _plus(({exposed: 1}, 0), sums.terms(hidden, scale=-1), sums.terms(work))
            model.exposed[ph] = model.at_least(terms, -const)   # _switch moves the backward's
            objective = _plus(objective, ({exposed: 1}, 0), sums.terms(hidden, scale=DRAG))
        if memory_budget is not None:
            limit = int(memory_budget) if integer else memory_budget * scale
            terms, const = _plus(_memory_terms(table, x, scale), _kept_terms(kept, scale), again)
            model.budget_ct = model.at_most(terms, limit - const)   # _switch moves its bound
            model.budget_row = (terms, limit - const)
    return x, objective, handles


class NoPlanInTime(RuntimeError):
    """The solver stopped at its time limit with no plan at all (not even a proof that none fits)."""


class NoBetterPlan(Exception):
    """``solve(..., below=...)`` found no plan under the cost it was asked to beat: proven
    (``proven``), or none found within the time limit."""

    def __init__(self, proven: bool):
        super().__init__("proven" if proven else "none found in time")
        self.proven = proven

    def __reduce__(self):   # carried back from a forked copy of a mesh search (planner.fanout)
        return NoBetterPlan, (self.proven,)


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
    relaxation's plan where it is whole (``_whole``), before CP-SAT (a descent's steps)."""
    start = time.perf_counter()
    if relaxed_first:
        whole = _whole(graph, strategies, costs, memory_budget, hint)
        if whole is not None:
            return replace(whole, seconds=time.perf_counter() - start)
    if hint is None and recompute.chooses(graph, strategies, costs, memory_budget):
        found = _solve_choosing(graph, strategies, costs, time_limit, memory_budget, below, effort, support)
        return replace(found, seconds=time.perf_counter() - start)   # its bounds and every mode's solve
    relaxed = 0.0
    if hint is None:   # a whole solve (a descent's steps bring their own plan, and need no proof)
        relaxed, weights = _relaxation(graph, strategies, costs, memory_budget)
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
    for unit in _units(_table(graph, strategies, costs)):
        model = _CpSat()
        try:
            x, objective, handles = _build(model, graph, strategies, costs, memory_budget, unit)
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
    solver, status = _run(model.model, time_limit, Progress(f"solving mesh {tuple(costs.mesh_shape)}"), unit,
                          relaxed if 0 < relaxed < math.inf else None, effort)
    name = solver.status_name(status)
    if below is not None and status in (cp_model.INFEASIBLE, cp_model.UNKNOWN):
        raise NoBetterPlan(status == cp_model.INFEASIBLE)
    if status == cp_model.INFEASIBLE and memory_budget is not None:
        raise MemoryBudgetError(_memory_message(graph, strategies, costs, memory_budget, time_limit))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise NoPlanInTime(f"the layout solver stopped without a plan ({name}) after {time_limit:.0f} s; "
                           "raise time_limit= or plan a smaller model")
    choice = _choice(graph, x, solver)
    again = handles.counts(solver.boolean_value)
    obj = solver.objective_value / unit
    bound = max(solver.best_objective_bound / unit, relaxed if relaxed < math.inf else 0.0)
    if name == "FEASIBLE" and obj - bound <= GAP_LIMIT * obj:   # proven by the LP's bound
        name = "OPTIMAL"
    return Solution(choice, obj, min(bound, obj), name, time.perf_counter() - start, again)


def _whole(graph, strategies, costs, memory_budget, hint: Optional[dict] = None) -> Optional[Solution]:
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
    bound, weights = _relaxation(graph, strategies, costs, memory_budget)
    if weights is None or math.isinf(bound):
        return None
    choice, whole = dict.fromkeys(strategies, 0), True
    for name, ws in weights.items():
        i = max(range(len(ws)), key=ws.__getitem__)
        whole = whole and ws[i] >= 1 - 1e-6
        choice[name] = i
    if whole:
        return Solution(choice, bound, bound, "OPTIMAL", 0.0, {})
    lp = costs._relaxed[(id(strategies), memory_budget, "none")][2] if memory_budget is not None else None
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


def _solve_choosing(graph, strategies, costs, time_limit, memory_budget, below, effort, support) -> Solution:
    """``recompute="auto"`` under a budget: the plan of each linear mode (no block, every block's
    cheap ops, every block recomputed) that its bound (``_mode_bounds``) lets beat the best so far, best bound first
    (each solved and proven as any); each layout with the fewest blocks recomputed that fit it;
    then, where recomputation is in play, the whole choice (planner.recompute's products of
    layouts and counts, whose relaxation is weak) from the best of them, for at most
    ``recompute.EFFORT`` deterministic seconds. The bound is the modes' least: a plan
    recomputing some blocks only is sought from their layouts, where one of their plans
    recomputes any, not proven (the 96-layer GPT, whose every block recomputed cannot beat
    its plan without, is not searched for one)."""
    start = time.perf_counter()
    bounds = _mode_bounds(graph, strategies, costs, memory_budget)
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
    led = costs._relaxed.get(("led", id(strategies)))
    led = led[1] if led is not None and led[0] is strategies else None
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
    costs._relaxed[("led", id(strategies))] = (strategies, led)
    # 0: a mesh search's first look, the best as it is; and where the best plan recomputes no
    # whole block, the choice has no count to start from (the 96-layer GPT, whose best runs
    # every block's cheap ops again)
    counted = led == "blocks"
    if counted and effort == 0:
        # a plan recomputing some blocks may beat every mode's bound: the bound of any plan, so
        # that a mesh search solves the choice when it comes back to this mesh
        proven["any"] = recompute.floor(_table(graph, strategies, costs), costs, again=False)
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


def _mode_bounds(graph, strategies, costs, memory_budget, quick: bool = False) -> dict:
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
    out = {"none": _relaxation(graph, strategies, costs.with_recompute("none"), memory_budget)[0]}
    slack = costs._relaxed.get(("slack", id(strategies), memory_budget, "none"))
    if slack is not None and slack[0] is strategies:
        return out
    table = _table(graph, strategies, costs)
    out["blocks"] = recompute.floor(table, costs)
    if math.isinf(out["none"]):
        blocks = costs.with_recompute("blocks")
        out["blocks"] = max(out["blocks"], _relaxation(graph, strategies, blocks, memory_budget)[0])
    selective = costs.with_recompute(recompute.SELECTIVE)
    light = recompute.floor(table, selective, light=True)
    # its relaxation only where its floor lies below "none"'s bound: elsewhere no value of
    # it moves the modes' least, and its floor is its bound (the 96-layer GPT at world 1024:
    # the floor 0.982 s on every two-axis mesh, "none"'s relaxation 0.939-0.963 s on seven
    # of the nine, a fifth of each mesh's bound saved)
    # quick: not where nothing fits without recomputation, whose relaxation says whether
    # anything fits at all (a quick bound is finite where the exact one is)
    out[recompute.SELECTIVE] = light if (quick and not math.isinf(out["none"])) or light >= out["none"] else \
        max(light, _relaxation(graph, strategies, selective, memory_budget)[0])
    return out


class _Watch(cp_model.CpSolverSolutionCallback):
    """Each better plan the solver finds: a progress line once the solve has run a while, and the
    search stopped as soon as the plan is within ``GAP_LIMIT`` of the LP relaxation's bound
    (``relaxed``, seconds), which CP-SAT's own bound may take minutes to reach. The same graph
    gives the same sequence of plans, so where it stops is deterministic too."""

    def __init__(self, progress, unit, relaxed):
        super().__init__()
        self.progress, self.unit, self.relaxed = progress, unit, relaxed

    def on_solution_callback(self):
        obj = self.objective_value / self.unit
        bound = max(self.best_objective_bound / self.unit, self.relaxed or 0.0)
        gap = (obj - bound) / obj if obj > 0 else 0.0
        if self.progress is not None:
            self.progress.update(f"best {obj * 1e3:.3f} ms per step, {100 * gap:.2f}% from the bound")
        if self.relaxed is not None and gap <= GAP_LIMIT:
            self.stop_search()


def choice_cost(graph: Graph, strategies: dict, choice: dict, costs: Costs, extra: Cost = Cost()) -> float:
    """Estimated seconds per step of a whole plan (node name -> strategy index), with ``extra``
    (recomputed blocks' forward again: planner.recompute) on top."""
    return (plan_price(graph, strategies, choice, costs) + extra).step


def program_cost(graph: Graph, strategies: dict, choice: dict, costs: Costs, extra: Cost = Cost()) -> float:
    """A plan's estimated step as the integer program counts it (``choice_cost`` elsewhere):
    each repeated block's nodes and conversions at their twins' prices, times their count
    (planner.repeat), as the solver's objective and its LP bound do; what a descent compares its
    steps' objectives with. It differs from ``choice_cost`` where twins price apart (a
    parameter's gathers priced by its bucket), and costs a fraction of it: a descent's mesh has
    priced only its twins (0.05 s a refinement of the 96-layer GPT saved)."""
    tied = tied_plan(graph, strategies, choice)
    if tied is None:
        return choice_cost(graph, strategies, choice, costs, extra)
    count, edges = tied
    sums = [0.0] * len(PARTS)
    for n in graph.nodes:
        if n.name in count:
            for i, x in enumerate(_node_cost(costs, n, strategies[n.name][choice[n.name]])[0]):
                sums[i] += count[n.name] * x
    for u, value, v, slot, times in edges:
        src = strategies[u.name][choice[u.name]].outputs[value[1]]
        for i, x in enumerate(costs.pair(value, v, slot, src, strategies[v.name][choice[v.name]].inputs[slot])[1]):
            sums[i] += times * x
    return (Cost(*sums) + extra).step


def plan_price(graph: Graph, strategies: dict, choice: dict, costs: Costs) -> Cost:
    """What a plan's nodes and conversions cost, summed (``make_plan``'s total, ``choice_cost``'s
    before recomputation). Each price the plan pays is read once from ``costs``' caches and
    counted as often as it is paid: the layers of a stack pay the same ones (the 96-layer GPT's
    plan: 6,560 prices paid, 1,209 of them distinct; 1.2 ms, where adding ``Cost`` objects one
    by one took 16)."""
    paid: dict = {}   # id of a cached price -> [the price, how many times the plan pays it]

    def pay(cost):
        hit = paid.get(id(cost))
        if hit is None:
            paid[id(cost)] = [cost, 1]
        else:
            hit[1] += 1

    for n in graph.nodes:
        strat = strategies[n.name][choice[n.name]]
        pay(costs.node(n, strat))
        for slot, value in enumerate(n.inputs):
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            pay(costs.pair(value, n, slot, src, strat.inputs[slot])[0])   # its conversion_price
    sums = [0.0] * len(PARTS)
    for cost, times in paid.values():
        for i, x in enumerate(_vec(cost)):
            sums[i] += times * x
    return Cost(*sums)


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


def lower_bound(graph: Graph, strategies: dict, costs: Costs, memory_budget: Optional[float] = None,
                quick: bool = False) -> float:
    """Seconds no plan of this graph on this mesh can beat: the LP relaxation of the integer
    program (``_LP``). inf when even the relaxation breaks the memory budget. Under
    ``recompute="auto"`` and a budget, the least of its linear modes' (``_mode_bounds``);
    ``quick``: with the cheap ops recomputed bounded by their floor alone, never by their own
    relaxation, a bound as good wherever that floor prunes (a mesh search asks again, not
    quick, of a mesh it goes on to solve: the relaxations made are kept, so that costs one
    relaxation at most)."""
    if recompute.chooses(graph, strategies, costs, memory_budget):
        return min(_mode_bounds(graph, strategies, costs, memory_budget, quick).values())
    return _relaxation(graph, strategies, costs, memory_budget)[0]


def _relaxation(graph, strategies, costs: Costs, memory_budget) -> tuple:
    """(bound, weights) of the LP relaxation, once per strategies dict and budget: the bound in
    seconds, and each node's LP weight per strategy (None when the LP solver gave no optimum)."""
    key = (id(strategies), memory_budget, recompute.mode_of(costs))   # planner.recompute asks for several
    hit = costs._relaxed.get(key)
    if hit is not None and hit[0] is strategies:
        return hit[1]
    mode = recompute.mode_of(costs)
    base = costs._relaxed.get(("lp", id(strategies), memory_budget))
    fresh = not (base is not None and base[0] is strategies and mode in _SWITCHED)
    if fresh:
        lp = _LP()
        _, objective, _ = _build(lp, graph, strategies, costs, memory_budget, unit=1e6)
        lp.minimize(*objective)
        if mode == "none" and memory_budget is not None:   # the program the other linear modes move
            lp.mode, lp.delta, lp.peak = "none", None, None
            costs._relaxed[("lp", id(strategies), memory_budget)] = (strategies, lp)
    else:
        lp = base[1]
        _switch(lp, _table(graph, strategies, costs), costs, mode)
    if lp.params != PRIMAL:   # GLOP's primal simplex, once a dual one has lost its way, for good
        lp.engine, lp.params = ("CLP", "") if mode == "none" else ("GLOP", GLOP_DUAL)
    x = lp.layout[0]
    with phase("solve"):
        if mode == "none" and memory_budget is not None and \
                _least_bytes(_table(graph, strategies, costs)) > memory_budget:
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
            costs._relaxed[(id(strategies), None, recompute.mode_of(costs))] = (strategies, out)
            costs._relaxed[("slack",) + key] = (strategies, True)   # _mode_bounds: the budget binds nothing
    costs._relaxed[key] = (strategies, out, lp)
    while len(costs._relaxed) > 3 * TABLES_KEPT:
        costs._relaxed.pop(next(iter(costs._relaxed)))
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


class _CpSat:
    """The model-building calls ``_build`` makes, on a CP-SAT model. Linear terms are dicts of
    variable -> coefficient."""

    def __init__(self):
        self.model = cp_model.CpModel()

    def bool_var(self):
        return self.model.new_bool_var("")

    def int_var(self, lo, hi):
        return self.model.new_int_var(lo, hi, "")

    def exactly_one(self, vs):
        self.model.add_exactly_one(vs)

    def equal(self, lhs, rhs):
        """sum(lhs) == sum(rhs)"""
        self.model.add(cp_model.LinearExpr.sum(lhs) == cp_model.LinearExpr.sum(rhs))

    def at_least(self, terms: dict, bound):
        self.model.add(_weighted(terms) >= bound)

    def at_most(self, terms: dict, bound):
        self.model.add(_weighted(terms) <= bound)

    def minimize(self, terms: dict, const):
        self.model.minimize(_weighted(terms) + const)

    def hint(self, var, value):
        self.model.add_hint(var, value)


def _weighted(terms: dict):
    return cp_model.LinearExpr.weighted_sum(list(terms), list(terms.values()))


PRIMAL = "use_dual_simplex: false use_preprocessing: false"   # GLOP's primal simplex
GLOP_DUAL = "use_dual_simplex: true use_preprocessing: false"
_CLP_DUAL = pywraplp.MPSolverParameters()   # CLP's dual simplex without presolve (``_LP``)
_CLP_DUAL.SetIntegerParam(pywraplp.MPSolverParameters.LP_ALGORITHM, pywraplp.MPSolverParameters.DUAL)
_CLP_DUAL.SetIntegerParam(pywraplp.MPSolverParameters.PRESOLVE, pywraplp.MPSolverParameters.PRESOLVE_OFF)


class _Row:
    """A constraint of an ``_LP`` that ``_move`` may change: its bounds and its terms."""
    __slots__ = ("lo", "hi", "terms")

    def __init__(self, lo: float, hi: float, terms: dict):
        self.lo, self.hi, self.terms = lo, hi, terms


class _LP:
    """The same calls on a linear program (CLP or GLOP; GLOP's primal simplex where a dual one
    gives no answer): every variable continuous, a variable its index. The program is kept as
    lists and handed to the solver whole, as one protocol buffer, when solved (``solve``): a
    2-axis mesh of the 96-layer GPT (28k columns) is built in 0.035 s and handed over in 0.03 s,
    against 0.13 s set coefficient by coefficient through the solver's API."""

    def __init__(self):
        self.lb: list = []
        self.ub: list = []
        self.rows: list = []   # (lo, hi, variables, coefficients), or a _Row
        self.objective: dict = {}   # variable -> coefficient, which _move changes
        self.offset = 0.0
        # the solver: COIN-OR's CLP (in OR-Tools' wheels), its dual simplex without presolve,
        # for a program without recomputation; GLOP's dual simplex without presolve (its
        # defaults: 10x slower on a tiny T5) for one that recomputes, on which CLP's lost its
        # way (GPT-3 175B's two-axis meshes in "blocks" and "selective" modes: 5-7 s each,
        # without an optimum, where GLOP took 0.2 s). Without recomputation, CLP against GLOP:
        # the 96-layer GPT's 28 relaxations of a mesh search 0.27 s against 1.02, a tiny T5's
        # at mesh (4, 2) (157k columns) 0.17 against 1.61, a Llama-3-style model's at (8, 8)
        # (92k columns) 0.83 against 0.47; the same objectives. ``_relaxation`` sets it
        self.engine, self.params = "CLP", ""
        self.values: list = []
        self.value = 0.0

    def num_var(self, lo: float, hi: float) -> int:
        self.lb.append(lo)
        self.ub.append(hi)
        return len(self.lb) - 1

    def bool_var(self):
        return self.num_var(0.0, 1.0)

    def int_var(self, lo, hi):
        return self.num_var(float(lo), float(hi))

    def exactly_one(self, vs):
        vs = list(vs)
        self.rows.append((1.0, 1.0, vs, [1.0] * len(vs)))

    def equal(self, lhs, rhs):
        self.rows.append((0.0, 0.0, list(lhs) + list(rhs), [1.0] * len(lhs) + [-1.0] * len(rhs)))

    def _kept_row(self, lo, hi, terms: dict) -> _Row:
        row = _Row(lo, hi, {v: float(c) for v, c in terms.items()})
        self.rows.append(row)
        return row

    def at_least(self, terms: dict, bound):
        return self._kept_row(float(bound), math.inf, terms)

    def at_most(self, terms: dict, bound):
        return self._kept_row(-math.inf, float(bound), terms)

    def hint(self, var, value):
        pass   # a starting point means nothing to the simplex

    def minimize(self, terms: dict, const):
        self.objective = {v: float(c) for v, c in terms.items()}
        self.offset = float(const)

    def solve(self) -> int:
        """The solver's status on the program as it stands; ``values`` and ``value`` its optimum."""
        model = linear_solver_pb2.MPModelProto(objective_offset=self.offset)
        costs = [0.0] * len(self.lb)
        for v, c in self.objective.items():
            costs[v] = c
        for lo, hi, c in zip(self.lb, self.ub, costs):
            model.variable.add(lower_bound=lo, upper_bound=hi, objective_coefficient=c)
        for row in self.rows:
            lo, hi, vs, cs = (row.lo, row.hi, list(row.terms), list(row.terms.values())) if isinstance(row, _Row) else row
            ct = model.constraint.add(lower_bound=lo, upper_bound=hi)
            ct.var_index.extend(vs)
            ct.coefficient.extend(cs)
        solver = pywraplp.Solver.CreateSolver(self.engine)
        if self.params:
            solver.SetSolverSpecificParametersAsString(self.params)
        solver.LoadModelFromProto(model)
        status = solver.Solve(_CLP_DUAL) if self.engine == "CLP" else solver.Solve()
        if status == pywraplp.Solver.OPTIMAL:
            response = linear_solver_pb2.MPSolutionResponse()
            solver.FillSolutionResponseProto(response)
            self.values, self.value = list(response.variable_value), solver.Objective().Value()
        return status


def _run(model, time_limit, progress=None, unit=PICO, relaxed=None, effort=None):
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.linearization_level = 2  # the LP relaxation of this model is nearly tight
    solver.parameters.relative_gap_limit = GAP_LIMIT
    # branch on the LP's values: its relaxation is nearly tight, and the default search takes
    # 5x longer to find the plan the LP points at (24-layer GPT at world 256: 24 s against 4.4 s)
    solver.parameters.search_branching = cp_model.LP_SEARCH
    # presolve's probing and symmetry detection find little in this model and cost most of the
    # time (24-layer GPT on mesh (64, 4): 12 s with them, 3.5 s without, the same plan)
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.symmetry_level = 0
    solver.parameters.max_time_in_seconds = float(time_limit)
    if effort is not None:   # deterministic: the same graph stops at the same plan on any machine
        solver.parameters.max_deterministic_time = float(effort)
    with phase("solve"):
        shown = progress if progress is not None and progress.on else None
        status = solver.solve(model, _Watch(shown, unit, relaxed) if shown or relaxed else None)
    if progress is not None:
        progress.done(f"{solver.status_name(status).lower()}")
    return solver, status


def _choice(graph, x, solver) -> dict:
    return {n.name: 0 if x[n.name] is None else
            next(i for i, v in enumerate(x[n.name]) if solver.boolean_value(v)) for n in graph.nodes}


def _memory_terms(table: _Table, x, scale=1) -> tuple:
    """Bytes per rank, linear in the choices (cost.memory): (terms, constant)."""
    terms, const = {}, 0
    for n, times, _, nbytes in table.nodes:
        for i, b in enumerate(nbytes):
            b = b * scale * times
            if not b:
                continue
            if x[n.name] is None:
                const += b
            else:
                v = x[n.name][i]
                terms[v] = terms.get(v, 0) + b
    return terms, const


def _least_bytes(table: _Table) -> int:
    """Bytes per rank no plan without recomputation goes below: each node's least-memory
    strategy (``_memory_terms``), every conversion keeping nothing (what they keep, and the
    checkpoint regions' peaks, only add)."""
    return sum(times * min(nbytes) for _, times, _, nbytes in table.nodes if nbytes)


def _kept_terms(kept: dict, scale=1) -> tuple:
    """The bytes conversions keep (``_edge_vars``' ``kept``) as (terms, constant)."""
    return {v: b * scale for v, b in kept.items() if v is not None}, kept.get(None, 0) * scale


def _memory_message(graph, strategies, costs, budget, time_limit) -> str:
    """What the least memory any layout reaches is, and which tensors take it."""
    model = _CpSat()
    table = _table(graph, strategies, costs)
    x = _node_vars(model, table, _Sums())
    kept: dict = {}
    placed: list = []
    sums = _Sums()
    _edge_vars(model, table, x, sums, kept, placed)
    again, handles = recompute.add_terms(model, table, x, placed, costs, sums, PICO, True, 1, True)
    model.minimize(*_plus(_memory_terms(table, x), _kept_terms(kept), again))
    solver, status = _run(model.model, time_limit)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return f"no layout fits in a memory budget of {_gb(budget)} per rank"
    choice = _choice(graph, x, solver)
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


def _node_vars(model, table: _Table, sums: _Sums) -> dict:
    x = {}
    for n, times, vecs, _ in table.nodes:
        if not vecs:
            raise AssertionError(f"node {n.name} has no strategy")
        if len(vecs) == 1:
            x[n.name] = None
            sums.add(None, vecs[0], times)
            continue
        vs = [model.bool_var() for _ in vecs]
        model.exactly_one(vs)
        x[n.name] = vs
        for var, vec in zip(vs, vecs):
            sums.add(var, vec, times)
    for name, r in table.rep.items():   # a repeated block's node: its twin's variables and costs
        if r != name:
            x[name] = x[r]
    return x


def _groups(strats, pick):
    out: dict = {}
    for i, s in enumerate(strats):
        out.setdefault(pick(s), []).append(i)
    return out


def _edge_vars(model, table: _Table, x, sums: _Sums, kept: Optional[dict] = None,
               placed: Optional[list] = None) -> None:
    """The conversions' costs onto ``sums``, and the bytes their results keep onto ``kept``
    (variable, or None for the constant -> bytes); onto ``placed``, each edge with the variables
    each of its layout pairs landed on, [(var, (a, b))] (planner.recompute reads them)."""
    kept = {} if kept is None else kept

    def keep(var, b):
        if b:
            kept[var] = kept.get(var, 0) + b

    for edge in table.edges:
        u, value, v, slot, times, src, dst, pairs = edge
        spots: list = []
        if placed is not None:
            placed.append((edge, spots))
        if len(src) == 1 or len(dst) == 1:
            # one side fixed: the conversion's cost rides on the other side's choice
            for (a, b), (c, b_kept) in pairs.items():
                b_kept = b_kept * times
                if not any(c) and not b_kept:
                    continue
                side, idx = (v, dst[b]) if len(src) == 1 else (u, src[a])
                if (len(src) == 1 and len(dst) == 1) or x[side.name] is None:
                    sums.add(None, c, times)
                    keep(None, b_kept)
                    spots.append((None, (a, b)))
                    continue
                for i in idx:
                    sums.add(x[side.name][i], c, times)
                    keep(x[side.name][i], b_kept)
                    spots.append((x[side.name][i], (a, b)))
            continue
        # _pairs lists every pair, src by src and within each dst by dst: y[a, b] is ys[i * len(dst) + j]
        ys = []
        for pair, (c, b_kept) in pairs.items():
            var = model.bool_var()
            ys.append(var)
            sums.add(var, c, times)
            keep(var, b_kept * times)
            spots.append((var, pair))
        n = len(dst)
        xu, xv = x[u.name], x[v.name]
        for i, idx in enumerate(src.values()):
            model.equal(ys[i * n:(i + 1) * n], [xu[k] for k in idx])
        for j, idx in enumerate(dst.values()):
            model.equal(ys[j::n], [xv[k] for k in idx])
