"""A coarse lower bound of a mesh's integer program, for a mesh search to prune a mesh before
its program is priced and built.

Each tensor's layouts fall into two classes, whole (broadcast on every axis) and not whole;
each node's strategies into classes by the classes of their inputs and outputs (a parameter's
by its exact layout: what it is stored as decides its gradient's collectives). A class costs
the least of its members, and an edge between two classes the least conversion from a layout of
one to a layout of the other: nothing where they share one, otherwise priced pair by pair. The
LP relaxation of that program (GLOP) bounds the mesh's own from below: any plan, or any point
of the mesh's LP, summed class by class is a point of this one costing no more. The parts of
the objective that a plan can only add are left out (the exposed part of overlapped
communication, recomputation) and so is the memory budget, which can only raise the bound.

The bound is tight where the best plan keeps activations whole (tiny models, whose every
collective costs more than the compute it would save): there it proves in a blink, without the
mesh's hundred thousand layout pairs, that a second axis cannot beat one. Elsewhere it is weak,
and the search goes on to the mesh's own relaxation (``planner.relax.lower_bound``).
"""
from __future__ import annotations

import math

from ortools.linear_solver import pywraplp

from autoshard import placement as pl
from autoshard.cost.step import DRAG
from autoshard.planner.progress import phase
from autoshard.planner.repeat import tie_repeated

UNIT = 1e6   # GLOP counts microseconds: it loses precision at picoseconds


def _seconds(cost) -> float:
    """The part of a ``cost.step.Cost`` every plan pays linearly: all but the exposed part of
    overlapped communication, which is never negative (``Cost.step``)."""
    return cost.compute_fwd + cost.compute_bwd + cost.comm + DRAG * (cost.hidden_fwd + cost.hidden_bwd) + cost.optimizer


def _whole(layout) -> bool:
    return all(isinstance(p, pl.Broadcast) for p in layout)


def _classes(node, strats, costs) -> dict:
    """class key -> [least seconds, input layouts per slot, output layouts per output] of the
    node's strategies; the key is (input classes, output classes), where a parameter's output
    class is its layout itself."""
    out: dict = {}
    for st in strats:
        if node.kind == "param":
            key = ((), tuple(st.outputs))
        else:
            key = (tuple(_whole(a) for a in st.inputs), tuple(_whole(a) for a in st.outputs))
        c = out.setdefault(key, [math.inf, [set() for _ in st.inputs], [set() for _ in st.outputs]])
        c[0] = min(c[0], _seconds(costs.node(node, st)))
        for i, a in enumerate(st.inputs):
            c[1][i].add(a)
        for i, a in enumerate(st.outputs):
            c[2][i].add(a)
    return out


def coarse_bound(graph, strategies: dict, costs) -> float:
    """Seconds no plan on ``costs``' mesh beats, from the coarse program of the module
    docstring. Tied blocks (planner.repeat) are priced once and counted."""
    with phase("cost"):
        nodes, edges = _coarse(graph, strategies, costs)
    with phase("build"):
        lp = pywraplp.Solver.CreateSolver("GLOP")
        objective = lp.Objective()
        x = {}
        for name, times, classes in nodes:
            row = lp.Constraint(1.0, 1.0)   # one class per node
            x[name] = {}
            for key, c in classes.items():
                var = x[name][key] = lp.NumVar(0.0, 1.0, "")
                row.SetCoefficient(var, 1.0)
                objective.SetCoefficient(var, times * c * UNIT)
        for u, out, v, slot, times, prices in edges:
            y = {}
            for pair, c in prices.items():
                y[pair] = lp.NumVar(0.0, 1.0, "")
                objective.SetCoefficient(y[pair], times * c * UNIT)
            # the edge's classes agree with its producer's and its consumer's
            for side, node, pick in ((0, u, lambda key: key[1][out]), (1, v, lambda key: key[0][slot])):
                for k in {pair[side] for pair in prices}:
                    row = lp.Constraint(0.0, 0.0)
                    for pair, var in y.items():
                        if pair[side] == k:
                            row.SetCoefficient(var, 1.0)
                    for key, var in x[node].items():
                        if pick(key) == k:
                            row.SetCoefficient(var, -1.0)
        objective.SetMinimization()
    with phase("solve"):
        status = lp.Solve()
    return objective.Value() / UNIT if status == pywraplp.Solver.OPTIMAL else 0.0   # 0: proves nothing


def _coarse(graph, strategies, costs) -> tuple:
    """The coarse program's data: [(node, times, {class: seconds})] and [(producer, output
    index, consumer, slot, times, {(class made, class taken): seconds})], once per set of tied
    nodes and edges."""
    rep = tie_repeated(graph, strategies)
    times: dict = {}
    for n in graph.nodes:
        times[rep[n.name]] = times.get(rep[n.name], 0) + 1
    classes = {n.name: _classes(n, strategies[n.name], costs) for n in graph.nodes if rep[n.name] == n.name}
    nodes = [(name, times[name], {key: c[0] for key, c in cl.items()}) for name, cl in classes.items()]
    first: dict = {}
    for v in graph.nodes:
        for slot, value in enumerate(v.inputs):
            key = (rep[value[0]], value[1], rep[v.name], slot)
            first.setdefault(key, [value, v, 0])[2] += 1
    edges = []
    for (u, out, v_rep, slot), (value, v, count) in first.items():
        made: dict = {}   # the producer's output class -> its layouts
        for (_, outs), (_, _, layouts) in classes[u].items():
            made.setdefault(outs[out], set()).update(layouts[out])
        taken: dict = {}   # the consumer's input class -> its layouts
        for (ins, _), (_, layouts, _) in classes[v_rep].items():
            taken.setdefault(ins[slot], set()).update(layouts[slot])
        # every price is a time, never negative: where both sides have a layout in common, the
        # least conversion is none
        price = costs.price_key(value, v, slot)
        prices = {(a, b): 0.0 if srcs & dsts else
                  min(_seconds(costs.pair(value, v, slot, s, d, price)[0]) for s in srcs for d in dsts)
                  for a, srcs in made.items() for b, dsts in taken.items()}
        edges.append((u, out, v_rep, slot, count, prices))
    return nodes, edges
