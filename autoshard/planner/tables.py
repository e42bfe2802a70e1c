"""What the solver works out from the cost models and keeps: the program's data (every tied node's
strategy costs and bytes, every tied edge's layout groups and conversion costs), priced once per
strategies dict into a table (``table_for``) that the LP bound, the integer program and the
memory report all read; a descent's steps, which offer the same strategies again, reuse each
node's and each pair of strategy lists' prices. They are the planner's, kept per set of prices
in a ``SolverTables`` (``tables_of``), not on the ``Costs`` that prices them. And a plan's price,
read from the same prices (``plan_price``, ``choice_cost``, ``program_cost``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

from autoshard.cost.price import Costs
from autoshard.cost.step import PARTS, Cost
from autoshard.ir import Graph
from autoshard.planner.progress import phase
from autoshard.planner.repeat import TABLES_KEPT, tally, tie_repeated, tied_plan, twin_edges


class SolverTables:
    """What the solver keeps from one set of prices (a ``Costs`` and its other recompute modes:
    ``Costs.with_recompute``) for the next program it builds on them: a descent's steps, a
    mesh search's second look and the recompute modes ask again. Strategies dicts and lists
    hash by value or not at all, so entries are keyed by their ids, and each entry holds its
    objects, so that those ids stay theirs."""

    def __init__(self):
        self.tables: dict = {}   # id(strategies) -> (strategies, Table): ``table_for``, the last TABLES_KEPT
        self.nodes: dict = {}    # (node name, id(strategy)) -> (strategy, cost vector, bytes): ``node_cost``
        # (edge price key, output index, slot, id(producer's list), id(consumer's list))
        #   -> (the two lists, (src groups, dst groups, pairs)): ``pair_prices``
        self.pairs: dict = {}
        # (id(strategies), kind, ...) -> (strategies, value), the last 3 * TABLES_KEPT (``trim``):
        #   ("relaxation", budget, mode) -> ((bound, weights), its LP or None)   planner.relax.relaxation
        #   ("program", budget) -> the LP without recomputation that the linear modes move (``_switch``)
        #   ("slack", budget, mode) -> True: the budget binds nothing at the relaxation's optimum
        #   ("led",) -> the recompute mode whose plan led                     planner.solve._solve_choosing
        self.relaxed: dict = {}

    def relaxed_get(self, strategies, *key):
        """The value kept for ``strategies`` under ``key`` (``relaxed``), or None."""
        hit = self.relaxed.get((id(strategies),) + key)
        return hit[1] if hit is not None and hit[0] is strategies else None

    def relaxed_put(self, strategies, key: tuple, value) -> None:
        self.relaxed[(id(strategies),) + key] = (strategies, value)

    def trim(self) -> None:
        """Drop the oldest relaxations past 3 * TABLES_KEPT (a descent builds a strategies dict per step)."""
        while len(self.relaxed) > 3 * TABLES_KEPT:
            self.relaxed.pop(next(iter(self.relaxed)))


# Costs.family -> its SolverTables: they go when the prices go
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tables_of(costs: Costs) -> SolverTables:
    """The solver's tables for ``costs``' prices, shared by their recompute modes; made at the first ask."""
    hit = _KEPT.get(costs.family)
    if hit is None:
        hit = _KEPT[costs.family] = SolverTables()
    return hit


def vec(cost: Cost) -> tuple:
    """A cost's parts (``cost.step.PARTS``) as a tuple of seconds."""
    return tuple(getattr(cost, part) for part in PARTS)


@dataclass
class Table:
    """The program's data, from the cost models, for one strategies dict on one mesh: worked out
    once, read by every program built on it (the LP bound, the integer program, the memory
    report). Tied nodes and edges appear once, with how many times they occur."""
    rep: dict     # node name -> the name of the node whose variables it shares
    nodes: list   # (node, times, cost vector per strategy, bytes per strategy)
    edges: list   # (u, value, v, slot, times, src groups, dst groups, {(a, b): (cost vector, kept bytes)})
    magnitude: Optional[float] = None   # seconds: every cost summed, times its count (``units``)


def table_for(graph, strategies, costs: Costs) -> Table:
    """The program's data for ``strategies`` on ``costs``' mesh, once per strategies dict."""
    kept = tables_of(costs)
    hit = kept.tables.get(id(strategies))
    if hit is not None and hit[0] is strategies:
        return hit[1]
    with phase("cost"):
        rep = tie_repeated(graph, strategies)
        count = tally(rep[n.name] for n in graph.nodes)
        nodes = []
        for n in graph.nodes:
            if rep[n.name] != n.name:
                continue
            priced = [node_cost(costs, n, st, kept) for st in strategies[n.name]]
            nodes.append((n, count[n.name], [c for c, _ in priced], [b for _, b in priced]))
        edges = [(u, value, v, slot, times) + pair_prices(costs, strategies, u, value, v, slot, kept)
                 for u, value, v, slot, times in twin_edges(graph, rep)]
        table = Table(rep, nodes, edges)
    kept.tables[id(strategies)] = (strategies, table)
    while len(kept.tables) > TABLES_KEPT:
        kept.tables.pop(next(iter(kept.tables)))
    return table


def node_cost(costs: Costs, n, strat, kept: Optional[SolverTables] = None) -> tuple:
    """(cost vector, bytes) of one node's strategy, once per mesh: a descent's steps offer the
    same strategies again. ``kept``: ``tables_of(costs)``, where the caller has it."""
    nodes = (kept or tables_of(costs)).nodes
    key = (n.name, id(strat))
    hit = nodes.get(key)
    if hit is None or hit[0] is not strat:
        hit = nodes[key] = (strat, vec(costs.node(n, strat)), costs.memory(n, strat))
    return hit[1], hit[2]


def pair_prices(costs: Costs, strategies, u, value, v, slot, kept: SolverTables) -> tuple:
    """(src groups, dst groups, {(a, b): (cost vector, kept bytes)}) of one edge: the producer's
    output layouts, the consumer's input layouts, and every conversion between them. Edges
    between the same strategy lists with the same tensor and consumer price alike; they share
    one answer."""
    us, vs = strategies[u.name], strategies[v.name]
    # each pair once per edge price key, whatever the strategy lists: a descent's steps offer
    # the edges their layouts again in lists of their own, and the blocks' edges repeat
    price = costs.price_key(value, v, slot)
    key = (price, value[1], slot, id(us), id(vs))
    hit = kept.pairs.get(key)
    if hit is not None and hit[0] is us and hit[1] is vs:
        return hit[2]
    src = _groups(us, lambda st: st.outputs[value[1]])
    dst = _groups(vs, lambda st: st.inputs[slot])
    pairs = {}
    for a in src:   # in this order, which edge_vars reads its variables back by
        for b in dst:
            _, parts, kept_bytes = costs.pair(value, v, slot, a, b, price)
            pairs[a, b] = (parts, kept_bytes)
    kept.pairs[key] = (us, vs, (src, dst, pairs))
    return src, dst, pairs


def _groups(strats, pick):
    out: dict = {}
    for i, s in enumerate(strats):
        out.setdefault(pick(s), []).append(i)
    return out


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
    kept = tables_of(costs)
    for n in graph.nodes:
        if n.name in count:
            for i, x in enumerate(node_cost(costs, n, strategies[n.name][choice[n.name]], kept)[0]):
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
        for i, x in enumerate(vec(cost)):
            sums[i] += times * x
    return Cost(*sums)
