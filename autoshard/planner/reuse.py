"""Reuse: the layout a plan chose for one set of input shapes, taken for another (another eval
batch size, a ragged last batch) without pricing or solving anything, where it is still legal.

The graph captured for the new shapes must have the plan's structure: the same nodes in the same
order, of the same kinds and ops, each with as many outputs of as many dims; only sizes differ
(``same_structure``). Every node then keeps its strategy, its inputs' and outputs' placements,
where ``passes.annotate`` offers it for the new sizes: a split dim now smaller than its axes, a
split that no longer divides where the op's rule takes no uneven split (``rules.uneven``), or a
graph input that would be stored unevenly refuses it. Where one node's is refused the caller
plans afresh, keeping the others' (their output placements pinned, ``Reuse.pins``): the solver
then chooses only for the nodes refused and the conversions around them. A chunked conversion
(``plan.schedule["chunks"]``) is kept where its linear's input still divides evenly into its
chunks; the interleaved batch (``plan.schedule["interleave"]``) checks itself
(``passes.interleave``). The layout must also fit the plan's memory budget at the new sizes
(``cost.memory.rank_memory``, every activation counted as kept: a recomputed block's saving is
not deducted, so a layout that fits only by recomputing plans afresh).

The plan made is the layout: nothing is priced for the new sizes. Its ``solver["status"]`` is
``REUSED`` and ``solver["from"]`` the input shapes it was planned for; its ``cost`` is NaN, its
nodes' seconds 0, it lists no collectives, and its ``memory`` is the bytes per rank checked
against the budget.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import NamedTuple, Optional

from autoshard import placement as pl
from autoshard.cost.memory import rank_memory
from autoshard.ir import Graph
from autoshard.passes.annotate import Strategy, UnknownOpWarning, annotate
from autoshard.plan import Plan

REUSED = "REUSED"


def same_structure(plan: Plan, graph: Graph) -> bool:
    """Whether ``graph`` is the graph ``plan`` was made from but for its sizes."""
    if len(plan.nodes) != len(graph.nodes):
        return False
    for n, (name, old) in zip(graph.nodes, plan.nodes.items()):
        if (n.name != name or n.kind != old.kind or n.op_name != old.op or n.fqn != old.fqn
                or [len(m.shape) for m in n.outputs] != [len(s) for s in old.shapes]):
            return False
    return True


class Reuse(NamedTuple):
    """What of a plan's layout holds for a graph of other sizes: the plan of it where all of it
    does (else None), and the output placement of each node (parameters aside) whose strategy
    still does, for a new plan to keep (``pin=`` by node name)."""
    plan: Optional[Plan]
    pins: dict


def reuse(plan: Plan, graph: Graph) -> Reuse:
    """``plan``'s layout for ``graph``, captured for other input shapes (the module docstring)."""
    start = time.perf_counter()
    if not same_structure(plan, graph):
        return Reuse(None, {})
    mesh = tuple(plan.mesh_shape)
    with warnings.catch_warnings():   # said once already, when the plan was made
        warnings.simplefilter("ignore", UnknownOpWarning)
        strategies = annotate(graph, mesh)
    nodes, pins, choice = {}, {}, {}
    for n in graph.nodes:
        old = plan.nodes[n.name]
        strategy = Strategy(tuple(old.in_placements()), tuple(old.out_placements()))
        if strategy in strategies[n.name]:
            choice[n.name] = strategies[n.name].index(strategy)
            nodes[n.name] = dataclasses.replace(old, shapes=[m.shape for m in n.outputs], compute=0.0, comm=0.0)
            if n.outputs and n.kind != "param":
                pins[n.name] = tuple(old.outputs[0])
    if len(nodes) < len(graph.nodes):
        return Reuse(None, pins)
    budget = plan.memory.get("budget")
    memory = dict(rank_memory(graph, strategies, choice, mesh, plan.training,
                              plan.schedule.get("reshard_after_forward", False)), budget=budget)
    if budget is not None and memory["total"] > budget:   # larger sizes: the planner finds what fits
        return Reuse(None, pins)
    chunks = [c for c in plan.schedule.get("chunks", ()) if _still_chunks(graph, nodes, mesh, *c)]
    inputs = [graph.by_name[i].outputs[0].shape if graph.by_name[i].outputs else () for i in graph.user_inputs]
    return Reuse(dataclasses.replace(
        plan, nodes=nodes, collectives=[], cost=math.nan, input_shapes=inputs, memory=memory, breakdown={},
        schedule=dict(plan.schedule, chunks=chunks), mesh_candidates=[], _alternatives={}, _priced=None,
        solver={"status": REUSED, "from": [list(s) for s in plan.input_shapes],
                "seconds": time.perf_counter() - start}), pins)


def _still_chunks(graph: Graph, nodes: dict, mesh: tuple, producer: str, consumer: str, k: int, dim: int) -> bool:
    """Whether the linear ``producer``'s input, on every rank, still cuts into ``k`` chunks on
    ``dim`` (``cost.overlap.chunk_dim``'s condition, on every rank alike)."""
    node = graph.by_name.get(producer)
    if node is None or not node.inputs:
        return False
    shape = graph.meta(node.inputs[0]).shape
    placement = nodes[producer].in_placements()[0]
    if not pl.is_even(shape, placement, mesh):
        return False
    local = pl.local_shape(shape, placement, mesh)
    return local is not None and 0 <= dim < len(local) and local[dim] >= k
