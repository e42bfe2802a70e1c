"""A plan for the mesh search to descend from that refining two-axis plans does not reach: AxoNN's
own best-ranked 4-D grid (``cost.axonn.rank``), laid out by ``schemes.axonn_4d``.

Descent changes one mesh axis at a time (``planner.descend``). AxoNN's layout alternates two
tensor-parallel axes between a block's linears (x and y swap roles from one linear to the next),
which no one-axis step from a lifted two-axis plan makes, and a two-axis step from one does not
find either. Where activation collectives are priced as the schedule hides them
(``cost.overlap``), each beside the matmuls next to it, that layout can be the cheapest there is:
a 7.3B GPT block on 256 A100s, AxoNN's (2, 8, 16) at 47.0 ms against 50.5 ms for the best plan
descended from two axes. So the search also descends from it, on its mesh, unpinned.

The grid is ranked by AxoNN's formulas for the graph's linear layers as the schemes find them
(``schemes.roles``: a block's closing linears transposed); a model without blocks of linears has
no such start.
"""
from __future__ import annotations

import math
from typing import Optional

from autoshard import schemes
from autoshard.cost import axonn
from autoshard.passes.annotate import annotate
from autoshard.planner.descend import descend, solve_mesh
from autoshard.planner.solution import MemoryBudgetError


def axonn_start(graph, world: int, cluster, budget: Optional[float]) -> Optional[tuple]:
    """(mesh, pins by parameter name) of AxoNN's best-ranked grid for ``world`` devices, as
    ``schemes`` lays it out; None where the model has no blocks for it, no grid divides its
    shapes or fits ``budget``, or the grid is plain data parallelism (the search has that)."""
    linears = schemes.linear_layers(graph)
    if not linears:
        return None
    layers = [axonn.Layer(lin.weight_shape[lin.in_dim], lin.n_out, lin.kind == "row") for lin in linears]
    tokens = math.prod(graph.meta(linears[0].x).shape[:-1])
    ranked = axonn.rank(layers, tokens, world, cluster, memory_budget=budget)
    if not ranked:
        return None
    scheme, mesh, roles = axonn.as_scheme(ranked[0])
    if scheme == "data_parallel":
        return None
    try:
        return mesh, schemes.SCHEMES[scheme](None, None, mesh, graph=graph, **roles)
    except ValueError:   # the schemes find no blocks, or a split does not divide
        return None


def descend_from_pins(graph, strategies, costs, pins: dict, time_limit: float, budget: Optional[float]):
    """The plan of ``strategies`` (a mesh's, unpinned) descended from the pinned plan of ``pins``
    (node name -> placement); None where the pins fit no plan in the budget."""
    pinned = annotate(graph, costs.mesh_shape, pins)
    try:
        sol = solve_mesh(graph, pinned, costs, time_limit, budget)
    except MemoryBudgetError:
        return None
    index: dict = {}
    choice = {}
    for n in graph.nodes:
        full = strategies[n.name]
        at = index.get(id(full))
        if at is None:
            at = index[id(full)] = {st: i for i, st in enumerate(full)}
        choice[n.name] = at[pinned[n.name][sol.choice[n.name]]]
    return descend(graph, strategies, costs, choice, time_limit, budget)
