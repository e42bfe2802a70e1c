"""The integer program: one strategy per node, minimum estimated step time (``build``; solved by
``planner.solve.solve`` on CP-SAT, relaxed by ``planner.relax`` to an LP, both in
``planner.backends``):

    x[n, s] in {0, 1}              node n runs strategy s; the nodes of repeated blocks share
                                   their twin's x and y (planner.repeat)   (node_vars)
    sum_s x[n, s] = 1              exactly one strategy per node           (node_vars)
    y[e, a, b] in {0, 1}           edge e carries layout a, consumed as b  (edge_vars)
    sum_b y[e, a, b] = sum_{s: out_e(s) = a} x[u, s]                       (edge_vars)
    sum_a y[e, a, b] = sum_{s: in_e(s) = b}  x[v, s]                       (edge_vars)
    C_k = sum x[n, s] * node_cost_k(n, s) + sum y[e, a, b] * convert_k(a -> b)   per part k  (Sums)
    e_ph >= hidden_ph - compute_ph,  e_ph >= 0       for ph in fwd, bwd                     (build)
    sum x[n, s] * bytes(n, s) + sum y[e, a, b] * kept(a -> b) <= memory budget   (memory_terms)
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
recomputed, GLOP's where blocks are (``planner.backends.LP``).
"""
from __future__ import annotations

from typing import Optional

from autoshard.cost.step import DRAG, PARTS
from autoshard.planner.progress import phase
from autoshard.planner import recompute
from autoshard.planner.tables import Table, table_for


PICO = 1e12
# CP-SAT counts in picoseconds, or in nanoseconds where picoseconds would let a sum of the
# program's terms leave int64 (GPT-3 175B at world 1024: seconds per step over 96 layers)


INTEGER_UNITS = (PICO, 1e9)


class Sums:
    """One linear expression per cost part (``cost.step.PARTS``): coefficients on variables and a
    constant, in picoseconds."""

    def __init__(self, unit: float = PICO):
        self.unit = unit   # the LP relaxation counts in microseconds: GLOP loses precision at 1e12
        self.coef = {part: {} for part in PARTS}
        self.const = {part: 0 for part in PARTS}
        self._scaled: dict = {}   # cost vector -> its nonzero parts in ``unit``: costs repeat by the thousand

    def add(self, var, vec: tuple, times: int = 1) -> None:
        """Add ``times`` copies of a cost (``vec``: seconds per part) on ``var`` (None: the
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


def plus(*sums) -> tuple:
    """The sum of (terms, constant) pairs."""
    out, const = {}, 0
    for terms, c in sums:
        for v, k in terms.items():
            out[v] = out.get(v, 0) + k
        const += c
    return out, const


def units(table: Table) -> tuple:
    """The ``INTEGER_UNITS`` to try in turn, less those in which the sum of every cost the
    program holds passes 2^62, which CP-SAT's check for overflow refuses for certain (GPT-3
    175B's picoseconds: each of its programs was built twice)."""
    if table.magnitude is None:
        total = sum(times * sum(sum(map(abs, vec)) for vec in vecs) for _, times, vecs, _ in table.nodes)
        table.magnitude = total + sum(edge[4] * sum(sum(map(abs, vec)) for vec, _ in edge[7].values())
                                      for edge in table.edges)
    return tuple(u for u in INTEGER_UNITS if table.magnitude * u <= 2 ** 62) or INTEGER_UNITS[-1:]


def build(model, graph, strategies, costs, memory_budget, unit=PICO):
    """The integer program of the module docstring on ``model`` (``CpSat``, or ``LP`` for its
    relaxation); returns the x variables and the objective as (terms, constant), in ``unit`` per
    second."""
    table = table_for(graph, strategies, costs)
    with phase("build"):
        sums = Sums(unit)
        x = node_vars(model, table, sums)
        kept: dict = {}
        placed: list = []
        edge_vars(model, table, x, sums, kept, placed)
        model.layout, model.exposed = (x, placed), {}
        integer = unit in INTEGER_UNITS
        scale = 1 if integer else 1e-9   # the LP counts gigabytes
        again, handles = recompute.add_terms(model, table, x, placed, costs, sums, unit, integer, scale,
                                             memory_budget is not None)
        # the user's checkpoint regions: one region's activations back while its backward runs
        again = plus(again, recompute.region_terms(model, strategies, table, x, placed, costs, scale,
                                                    memory_budget is not None))
        objective = sums.terms("compute_fwd", "compute_bwd", "comm", "optimizer")
        for ph in ("fwd", "bwd"):
            # exposed = max(0, hidden - compute) of the phase (cost.step)
            hidden, work = f"hidden_{ph}", f"compute_{ph}"
            if not sums.most(hidden):
                continue
            exposed = model.int_var(0, sums.most(hidden))
            # exposed - hidden + compute >= 0
            terms, const = plus(({exposed: 1}, 0), sums.terms(hidden, scale=-1), sums.terms(work))
            model.exposed[ph] = model.at_least(terms, -const)   # _switch moves the backward's
            objective = plus(objective, ({exposed: 1}, 0), sums.terms(hidden, scale=DRAG))
        if memory_budget is not None:
            limit = int(memory_budget) if integer else memory_budget * scale
            terms, const = plus(memory_terms(table, x, scale), kept_terms(kept, scale), again)
            model.budget_ct = model.at_most(terms, limit - const)   # _switch moves its bound
            model.budget_row = (terms, limit - const)
    return x, objective, handles


def node_vars(model, table: Table, sums: Sums) -> dict:
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


def edge_vars(model, table: Table, x, sums: Sums, kept: Optional[dict] = None,
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
        # pair_prices lists every pair, src by src and within each dst by dst: y[a, b] is ys[i * len(dst) + j]
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


def memory_terms(table: Table, x, scale=1) -> tuple:
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


def least_bytes(table: Table) -> int:
    """Bytes per rank no plan without recomputation goes below: each node's least-memory
    strategy (``memory_terms``), every conversion keeping nothing (what they keep, and the
    checkpoint regions' peaks, only add)."""
    return sum(times * min(nbytes) for _, times, _, nbytes in table.nodes if nbytes)


def kept_terms(kept: dict, scale=1) -> tuple:
    """The bytes conversions keep (``edge_vars``' ``kept``) as (terms, constant)."""
    return {v: b * scale for v, b in kept.items() if v is not None}, kept.get(None, 0) * scale
