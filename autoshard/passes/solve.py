"""Solve: pick one strategy per node, minimum estimated step time.

The integer program (built by ``build_model``):

    x[n, s] in {0, 1}              node n runs strategy s                  (_node_vars)
    sum_s x[n, s] = 1              exactly one strategy per node           (_node_vars)
    y[e, a, b] in {0, 1}           edge e carries layout a, consumed as b  (_edge_vars)
    sum_b y[e, a, b] = sum_{s: out_e(s) = a} x[u, s]                       (_edge_vars)
    sum_a y[e, a, b] = sum_{s: in_e(s) = b}  x[v, s]                       (_edge_vars)
    minimise  sum x[n, s] * node_cost(n, s) + sum y[e, a, b] * convert(a -> b)

node_cost is compute (forward, plus backward when training) and, for a parameter stored
broadcast, its gradient all-reduce; convert is the conversion's forward plus its dual backward
(cost.comm). An edge whose producer or consumer has a single layout adds its cost straight onto
the other side's x. Costs are integers in picoseconds. CP-SAT runs with one worker and a fixed
seed, so the same graph gives the same plan on every machine.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from autoshard import placement as pl
from autoshard.cluster import Cluster
from autoshard.cost import comm, compute
from autoshard.passes.capture import Graph, Node

PICO = 1e12


@dataclass
class Solution:
    choice: dict        # node name -> index into its strategies
    objective: float    # seconds
    bound: float        # seconds, proven lower bound
    status: str
    seconds: float      # wall time of the solve

    @property
    def gap(self) -> float:
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


class Costs:
    """Every cost the program needs, from the cost models, cached by layout."""

    def __init__(self, graph: Graph, mesh_shape, cluster: Cluster, training: bool):
        self.graph, self.mesh_shape, self.cluster, self.training = graph, tuple(mesh_shape), cluster, training
        self.links = cluster.axis_links(self.mesh_shape)
        self._conv: dict = {}

    def node(self, node: Node, strat) -> float:
        mesh = self.mesh_shape
        if node.kind == "param":
            if not (self.training and node.requires_grad):
                return 0.0
            meta = node.outputs[0]
            local = pl.local_shape(meta.shape, strat.outputs[0], mesh)
            nbytes = math.prod(local) * meta.itemsize
            return sum(comm.all_reduce_time(nbytes, mesh[a], self.links[a])
                       for a, p in enumerate(strat.outputs[0]) if isinstance(p, pl.Broadcast) and mesh[a] > 1)
        if node.kind != "op":
            return 0.0
        metas = [self.graph.meta(v) for v in node.inputs]
        ins = [pl.local_shape(m.shape, p, mesh) for m, p in zip(metas, strat.inputs)]
        outs = [pl.local_shape(m.shape, p, mesh) for m, p in zip(node.outputs, strat.outputs)]
        itemsize = max([m.itemsize for m in metas + node.outputs if m.floating] or [4])
        t = compute.op_time(node.target, ins, outs, itemsize, self.cluster)
        if self.training and node.requires_grad:
            t *= 1 + compute.BACKWARD_FACTOR
        for c in comm.op_collectives(node, strat, self.graph, mesh):
            t += comm.all_reduce_time(c.nbytes, mesh[c.axis], self.links[c.axis])
        return t

    def convert(self, value, src, dst, consumer: Node) -> float:
        meta = self.graph.meta(value)
        backward = (self.training and meta.floating and consumer.kind != "output"
                    and self.graph.by_name[value[0]].requires_grad)
        key = (meta, src, dst, backward)
        if key not in self._conv:
            local = pl.local_shape(meta.shape, src, self.mesh_shape)
            self._conv[key] = comm.conversion_time(local, meta.itemsize, src, dst, self.mesh_shape,
                                                   self.links, backward)
        return self._conv[key]


def _ps(seconds: float) -> int:
    return int(round(seconds * PICO))


def solve(graph: Graph, strategies: dict, costs: Costs, time_limit: float = 60.0) -> Solution:
    start = time.perf_counter()
    model = cp_model.CpModel()
    x, terms, const = _node_vars(model, graph, strategies, costs)
    const += _edge_vars(model, graph, strategies, costs, x, terms)
    model.minimize(sum(c * v for v, c in terms.items() if c) + 0)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.linearization_level = 2  # the LP relaxation of this model is nearly tight
    solver.parameters.max_time_in_seconds = float(time_limit)
    status = solver.solve(model)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise ValueError("no layout satisfies the pins given; remove or change a pin")
        raise RuntimeError(f"the layout solver stopped without a plan ({name}) after {time_limit:.0f} s; "
                           "raise time_limit= or plan a smaller model")
    choice = {}
    for n in graph.nodes:
        vs = x[n.name]
        choice[n.name] = 0 if vs is None else next(i for i, v in enumerate(vs) if solver.boolean_value(v))
    obj = (solver.objective_value + const) / PICO
    bound = (solver.best_objective_bound + const) / PICO
    return Solution(choice, obj, min(bound, obj), name, time.perf_counter() - start)


def _node_vars(model, graph, strategies, costs):
    x, terms, const = {}, {}, 0
    for n in graph.nodes:
        strats = strategies[n.name]
        if not strats:
            raise AssertionError(f"node {n.name} has no strategy")
        if len(strats) == 1:
            x[n.name] = None
            const += _ps(costs.node(n, strats[0]))
            continue
        vs = [model.new_bool_var(f"x[{n.name},{i}]") for i in range(len(strats))]
        model.add_exactly_one(vs)
        x[n.name] = vs
        for v, s in zip(vs, strats):
            terms[v] = terms.get(v, 0) + _ps(costs.node(n, s))
    return x, terms, const


def _groups(strats, pick):
    out: dict = {}
    for i, s in enumerate(strats):
        out.setdefault(pick(s), []).append(i)
    return out


def _edge_vars(model, graph, strategies, costs, x, terms) -> int:
    const = 0
    for v in graph.nodes:
        for slot, value in enumerate(v.inputs):
            u = graph.by_name[value[0]]
            src = _groups(strategies[u.name], lambda s: s.outputs[value[1]])
            dst = _groups(strategies[v.name], lambda s: s.inputs[slot])
            cost = {(a, b): _ps(costs.convert(value, a, b, v)) for a in src for b in dst}
            if len(src) == 1 or len(dst) == 1:
                for (a, b), c in cost.items():
                    if not c:
                        continue
                    if len(src) == 1 and len(dst) == 1:
                        const += c
                        continue
                    side, idx = (v, dst[b]) if len(src) == 1 else (u, src[a])
                    if x[side.name] is None:
                        const += c
                        continue
                    for i in idx:
                        var = x[side.name][i]
                        terms[var] = terms.get(var, 0) + c
                continue
            y = {}
            for (a, b), c in cost.items():
                y[a, b] = model.new_bool_var(f"y[{value[0]}:{value[1]}->{v.name}:{slot},{a},{b}]")
                if c:
                    terms[y[a, b]] = terms.get(y[a, b], 0) + c
            for a, idx in src.items():
                model.add(sum(y[a, b] for b in dst) == sum(x[u.name][i] for i in idx))
            for b, idx in dst.items():
                model.add(sum(y[a, b] for a in src) == sum(x[v.name][i] for i in idx))
    return const
