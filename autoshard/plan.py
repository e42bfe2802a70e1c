"""Plan: the layout the solver chose for every tensor, with its costs and collectives.

A plan is data: it can be printed, saved as JSON, loaded and handed to ``parallelize`` on another
machine. ``make_plan`` turns a solved graph into one.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from autoshard import placement as pl
from autoshard.machine.cluster import Cluster
from autoshard.cost import comm, interleave
from autoshard.cost.memory import rank_memory
from autoshard.cost.overlap import added, edge_overlap
from autoshard.cost.step import Cost
from autoshard.report import explain, summary
from autoshard.planner import recompute
from autoshard.planner.solve import choice_cost, plan_price
from autoshard.report.summary import fmt_bytes as _fmt_bytes, fmt_s as _fmt_s  # noqa: F401 (coverage uses them)


@dataclass(frozen=True)
class Collective:
    kind: str          # all_reduce, all_gather, reduce_scatter, all_to_all
    phase: str         # forward or backward
    axes: tuple        # mesh axes it runs over
    bytes: int         # size of the tensor each rank passes in
    node: str          # the graph node it serves
    seconds: float = 0.0
    overlapped: bool = False   # started early and waited late by the schedule pass

    def __repr__(self) -> str:
        return f"{self.kind}[{self.phase}, axes={self.axes}, {_fmt_bytes(self.bytes)}] at {self.node}"


@dataclass
class NodeChoice:
    name: str
    kind: str                       # param, buffer, input, op, output
    op: str
    shapes: list                    # global shape of each tensor output
    inputs: list                    # per tensor input: per-axis placement strings
    outputs: list                   # per tensor output: per-axis placement strings
    compute: float = 0.0            # seconds, forward (+ backward when training)
    comm: float = 0.0               # seconds of the collectives this node causes
    fqn: Optional[str] = None
    module: Optional[str] = None    # an op's innermost module (``blocks.0.qkv``), from the trace

    def in_placements(self) -> list:
        return [tuple(pl.parse(p) for p in x) for x in self.inputs]

    def out_placements(self) -> list:
        return [tuple(pl.parse(p) for p in x) for x in self.outputs]


@dataclass
class Plan:
    mesh_shape: tuple
    nodes: dict                     # name -> NodeChoice, in graph order
    params: dict                    # parameter fqn (every alias) -> per-axis placement strings
    collectives: list
    cost: float                     # estimated seconds per step
    training: bool = True
    cluster: Optional[Cluster] = None
    solver: dict = field(default_factory=dict)   # status, objective, bound, gap, seconds
    input_shapes: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)   # bytes per rank: parameters, gradients, optimizer, activations, total
    breakdown: dict = field(default_factory=dict)  # seconds per part of the step (cost.step.Cost)
    schedule: dict = field(default_factory=dict)   # bucket_bytes, reshard_after_forward
    mesh_candidates: list = field(default_factory=list)  # the mesh search's ranking: mesh, bound, cost, status
    aliases: dict = field(default_factory=dict)   # a tied parameter's other names -> the name the graph uses
    recompute: dict = field(default_factory=dict)   # blocks that run their forward again in backward (planner.recompute)
    _alternatives: Optional[dict] = field(default=None, repr=False, compare=False)

    @property
    def alternatives(self) -> dict:
        """node name -> the layouts the solver could have given it, priced with every other node
        as planned: the chosen one first, then the cheapest few (``autoshard.report.explain``)."""
        if self._alternatives is None:
            priced = getattr(self, "_priced", None)
            self._alternatives = explain.alternatives(self, *priced) if priced else {}
        return self._alternatives

    def explain(self, name: str) -> str:
        """Why a parameter (by its name in the model) or a graph node is laid out as it is: its
        placement on each mesh axis, the alternatives the solver had with what each costs, and
        the pin that would force another."""
        return explain.explain(self, name)

    def formula(self, dims: Optional[dict] = None, part: str = "step", nodes=None) -> tuple:
        """``(expr, values)``: the estimated step (or its ``part``: ``compute``,
        ``communication``, ``exposed``) as a sympy expression in named sizes (``dims``, e.g.
        ``{"b": 512, "s": 1024}``: which sizes stay symbols), mesh axes, links and peak FLOP/s,
        and each symbol's value in this plan; ``expr.subs(values)`` is ``plan.cost``
        (``autoshard.report.formula``)."""
        from autoshard.report.formula import formula
        return formula(self, dims, part, nodes)

    def to_html(self, path=None) -> str:
        """One self-contained page: mesh, a timeline of one step, memory, the folded table, and
        explain for any tensor on click (``autoshard.report.html``); written to ``path`` when given."""
        from autoshard.report.html import to_html
        return to_html(self, path)

    @property
    def world(self) -> int:
        return math.prod(self.mesh_shape)

    def placement(self, name: str) -> tuple:
        """Per-axis placement strings of a parameter (by its name in the model) or a graph node."""
        if name in self.params:
            return tuple(self.params[name])
        if name in self.nodes and self.nodes[name].outputs:
            return tuple(self.nodes[name].outputs[0])
        raise KeyError(f"{name!r} is neither a parameter of the model nor a node of its graph; "
                       f"parameters: {', '.join(sorted(self.params)[:8])}...")

    # ---- reading ----------------------------------------------------------------------------
    def __str__(self) -> str:
        """The plan at a glance: mesh, step, memory, solver, the model with repeated blocks
        folded, the largest collectives (``autoshard.report.summary``)."""
        return summary.summary(self)

    def table(self) -> str:
        """Every graph node: shape, placement, collectives, compute and communication."""
        return summary.table(self)

    # ---- saving -----------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {
            "mesh_shape": list(self.mesh_shape),
            "training": self.training,
            "cost": self.cost,
            "cluster": asdict(self.cluster) if self.cluster else None,
            "solver": self.solver,
            "input_shapes": [list(s) for s in self.input_shapes],
            "memory": self.memory,
            "breakdown": self.breakdown,
            "schedule": self.schedule,
            "mesh_candidates": self.mesh_candidates,
            "aliases": self.aliases,
            "recompute": self.recompute,
            "alternatives": self.alternatives,
            "params": {k: list(v) for k, v in self.params.items()},
            "nodes": [asdict(n) for n in self.nodes.values()],
            "collectives": [dict(asdict(c), axes=list(c.axes)) for c in self.collectives],
        }
        return json.dumps(d, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        nodes = {}
        for n in d["nodes"]:
            n["shapes"] = [tuple(s) for s in n["shapes"]]
            n["inputs"] = [tuple(p) for p in n["inputs"]]
            n["outputs"] = [tuple(p) for p in n["outputs"]]
            nodes[n["name"]] = NodeChoice(**n)
        return Plan(
            mesh_shape=tuple(d["mesh_shape"]), nodes=nodes,
            params={k: tuple(v) for k, v in d["params"].items()},
            collectives=[Collective(**dict(c, axes=tuple(c["axes"]))) for c in d["collectives"]],
            cost=d["cost"], training=d["training"],
            cluster=Cluster(**d["cluster"]) if d.get("cluster") else None,
            solver=d.get("solver", {}), input_shapes=[tuple(s) for s in d.get("input_shapes", [])],
            memory=d.get("memory", {}), breakdown=d.get("breakdown", {}), schedule=d.get("schedule", {}),
            mesh_candidates=d.get("mesh_candidates", []), aliases=d.get("aliases", {}),
            recompute=d.get("recompute", {}),
            _alternatives=d.get("alternatives", {}))


def conversion_collectives(graph, costs, value, src, dst, consumer) -> list:
    """The collectives of converting ``value`` from ``src`` to ``dst`` for ``consumer``: forward,
    its dual in backward, and again in backward where the parameter is regathered."""
    producer = graph.by_name[value[0]]
    meta = graph.meta(value)
    backward = costs.training and meta.floating and consumer.kind != "output" and producer.requires_grad
    # a prefetched gather, its dual and its regather travel in a bucket, priced as Costs.convert
    steps, duals, fwd, bwd, hidden = costs.step_times(value, src, costs.handed_over(value, src, dst, consumer),
                                                      backward)
    phases = [("forward", steps, fwd, 0, hidden)]
    if backward:
        phases.append(("backward", duals, bwd, len(duals) - 1, hidden))
        if costs.regathered(value):   # converted again for the backward, which waits for it
            phases.append(("backward", steps, fwd, 0, False))
    # a prefetched gather's dual reduce-scatter, or a policy copy's, runs in the policy's reduce dtype
    reduced = costs.reduced_itemsize(value, hidden, steps)
    return [Collective(st.kind, phase, st.axes,
                       comm.step_bytes(st, reduced if phase == "backward" and sts is duals and i == bucketed
                                       else meta.itemsize), consumer.name, t, hid and i == bucketed)
            for phase, sts, times, bucketed, hid in phases
            for i, (st, t) in enumerate(zip(sts, times)) if st.is_collective]


def own_collectives(graph, costs, n, strat) -> list:
    """A node's collectives that are not conversions: a parameter's gradient all-reduce, the
    all-reduces an op's lowering issues."""
    mesh, links = costs.mesh_shape, costs.links
    out = [Collective("all_reduce", "backward", axes, nbytes, n.name, t, True)
           for axes, nbytes, t in costs.grad_syncs(n, strat)]
    if n.kind == "op":
        for c in comm.op_collectives(n, strat, graph, mesh):
            t = comm.op_collective_time(c, mesh, links)
            out.append(Collective(c.kind, c.phase, (c.axis,), c.nbytes, n.name, t))
    return out


def make_plan(graph, strategies, solution, costs) -> Plan:
    """The chosen strategy of every node, with the collectives and costs it implies. What
    ``Plan.explain`` needs (each node's alternatives, priced) is worked out when first asked for."""
    mesh = costs.mesh_shape
    nodes, params = {}, {}
    # recomputed blocks: their forward again in backward, their activations freed but one block's;
    # they run in checkpointed submodules, where the schedule overlaps and chunks nothing
    # (cost.overlap.unhidden gives back what their conversions' prices hide)
    extra, freed, peak, again = recompute.chosen(graph, strategies, solution.choice, costs, solution.recompute)
    rerun = _rerun(graph, again)
    colls, overlaps = _collectives(graph, strategies, solution.choice, costs, rerun)
    for n, strat, cost in _priced(graph, strategies, solution.choice, costs):
        nodes[n.name] = NodeChoice(
            name=n.name, kind=n.kind, op=n.op_name, shapes=[m.shape for m in n.outputs],
            inputs=[pl.to_strings(p) for p in strat.inputs], outputs=[pl.to_strings(p) for p in strat.outputs],
            compute=cost.compute, comm=cost.communication, fqn=n.fqn, module=_module(n))
    total = plan_price(graph, strategies, solution.choice, costs) + extra   # as plan_cost and a search sum it
    param_node = {n.fqn: n.name for n in graph.nodes if n.kind == "param"}
    for alias, fqn in graph.param_aliases.items():
        if fqn in param_node:
            params[alias] = tuple(nodes[param_node[fqn]].outputs[0])
    solver = {"status": solution.status, "objective": solution.objective, "bound": solution.bound,
              "gap": solution.gap, "seconds": solution.seconds}
    input_shapes = [graph.by_name[i].outputs[0].shape if graph.by_name[i].outputs else () for i in graph.user_inputs]
    memory = rank_memory(graph, strategies, solution.choice, mesh, costs.training, costs.reshard)
    memory["activations"] += peak - freed
    memory["total"] += peak - freed
    # the conversions the schedule chunks: none made in a recomputed block's submodule
    chunks = [[o.producer, o.consumer, o.chunks, o.dim] for o in overlaps if o.chunks > 1 and o.producer not in rerun]
    # the batch cut into k interleaved chunks where that hides more than it costs (cost.interleave):
    # the step the plan estimates, and that a mesh search compares, is the one it runs
    k, saved = interleave.choose(graph, strategies, solution.choice, costs, rerun, lambda: (colls, overlaps))
    parts = breakdown(total, overlaps)
    parts.update(interleave_saved=saved, exposed=parts["exposed"] - saved, hidden=parts["hidden"] + saved)
    plan = Plan(tuple(mesh), nodes, params, colls, total.step - saved, costs.training, costs.cluster, solver,
                input_shapes, memory, parts,
                {"bucket_bytes": costs.bucket_bytes, "reshard_after_forward": costs.reshard, "outputs": graph.outputs,
                 "chunks": chunks, "interleave": k},
                aliases={a: f for a, f in graph.param_aliases.items() if a != f}, recompute=again or {})
    plan._priced = (graph, strategies, solution.choice, costs, total)   # for the alternatives, on demand
    return plan


def _priced(graph, strategies, choice: dict, costs):
    """(node, its strategy, its cost and its inputs' conversions', less what the schedule hides
    of them: ``cost.overlap.conversion_price``) of every node, in graph order."""
    for n in graph.nodes:
        strat = strategies[n.name][choice[n.name]]
        cost = costs.node(n, strat)
        for slot, value in enumerate(n.inputs):
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            cost = cost + costs.pair(value, n, slot, src, strat.inputs[slot])[0]
        yield n, strat, cost


def plan_cost(graph, strategies, solution, costs) -> float:
    """``make_plan(...).cost`` without the rest of the plan: the estimated step a mesh search
    compares plans by, before it makes the plan of the one it chooses."""
    extra, _, _, again = recompute.chosen(graph, strategies, solution.choice, costs, solution.recompute)
    rerun = _rerun(graph, again)
    saved = interleave.choose(graph, strategies, solution.choice, costs, rerun,
                              lambda: _collectives(graph, strategies, solution.choice, costs, rerun))[1]
    return choice_cost(graph, strategies, solution.choice, costs, extra) - saved   # make_plan's total, summed alike


def _rerun(graph, again) -> set:
    """The nodes of the blocks a plan recomputes (``recompute.chosen``'s last part)."""
    return {o for b in (again or {}).get("blocks", ()) for o in recompute._stack_blocks(graph)[b]}


def _collectives(graph, strategies, choice: dict, costs, rerun: set) -> tuple:
    """(the plan's collectives as the schedule runs them, in graph order; the ``cost.overlap``
    records of its conversions outside the recomputed blocks ``rerun``)."""
    colls, overlaps = [], []
    for n in graph.nodes:
        strat = strategies[n.name][choice[n.name]]
        for slot, value in enumerate(n.inputs):
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            dst = strat.inputs[slot]
            # what the schedule hides of it, and how it chunks it (cost.overlap)
            o = edge_overlap(costs, value, src, dst, n, slot)
            o_run = o if n.name not in rerun else None
            colls += _as_run(conversion_collectives(graph, costs, value, src, dst, n), o_run)
            overlaps += [o_run] if o_run is not None else []
        colls += own_collectives(graph, costs, n, strat)
    return colls, overlaps


def _as_run(colls: list, o) -> list:
    """A conversion's collectives as the schedule runs them: where it chunks the conversion
    (``o``, its ``cost.overlap.Overlap``), each phase's step takes the k chunks' seconds."""
    if o is None or o.chunks == 1:
        return colls
    return [dataclasses.replace(c, seconds=o.fwd if c.phase == "forward" else o.bwd) for c in colls]


def breakdown(total: Cost, overlaps: list) -> dict:
    """The step's parts (``cost.step.Cost``); in seconds its ``compute``, the communication it
    waits for (``exposed``, with the overlap's drag) and the communication hidden behind compute
    (``hidden``); and what the schedule hides of the activations' collectives, the chunks'
    drag deducted (``activations_hidden``), which the step counts (``cost.overlap``)."""
    overflow = max(0.0, total.hidden_fwd - total.compute_fwd) + max(0.0, total.hidden_bwd - total.compute_bwd)
    return asdict(total) | {"compute": total.compute, "exposed": total.exposed,
                            "hidden": total.hidden_fwd + total.hidden_bwd - overflow,
                            "activations_hidden": -sum(added(o) for o in overlaps)}


def _module(node) -> Optional[str]:
    """The innermost module an op was traced in (torch.export's ``nn_module_stack``)."""
    stack = node.fx_node.meta.get("nn_module_stack") if node.kind == "op" else None
    return list(stack.values())[-1][0] if stack else None
