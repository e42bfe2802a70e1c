"""The solvers the program is handed to: CP-SAT for the integer program (``CpSat``, ``run``), and
COIN-OR's CLP or GLOP for its LP relaxation (``LP``), each behind the same model-building calls
(``planner.program.build``)."""
from __future__ import annotations

import math

from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.sat.python import cp_model

from autoshard.planner.progress import phase
from autoshard.planner.program import PICO


GAP_LIMIT = 1e-3   # stop once the plan is proven within 0.1% of the best: closing the last sliver can take minutes


class CpSat:
    """The model-building calls ``build`` makes, on a CP-SAT model. Linear terms are dicts of
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


_CLP_DUAL = pywraplp.MPSolverParameters()   # CLP's dual simplex without presolve (``LP``)


_CLP_DUAL.SetIntegerParam(pywraplp.MPSolverParameters.LP_ALGORITHM, pywraplp.MPSolverParameters.DUAL)


_CLP_DUAL.SetIntegerParam(pywraplp.MPSolverParameters.PRESOLVE, pywraplp.MPSolverParameters.PRESOLVE_OFF)


class _Row:
    """A constraint of an ``LP`` that ``_move`` may change: its bounds and its terms."""
    __slots__ = ("lo", "hi", "terms")

    def __init__(self, lo: float, hi: float, terms: dict):
        self.lo, self.hi, self.terms = lo, hi, terms


class LP:
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
        # (92k columns) 0.83 against 0.47; the same objectives. ``relaxation`` sets it
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


def run(model, time_limit, progress=None, unit=PICO, relaxed=None, effort=None):
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


def read_choice(graph, x, solver) -> dict:
    return {n.name: 0 if x[n.name] is None else
            next(i for i, v in enumerate(x[n.name]) if solver.boolean_value(v)) for n in graph.nodes}
