"""Plan: the layout the solver chose for every tensor, with its costs and collectives.

A plan is data: it can be printed, saved as JSON, loaded and handed to ``parallelize`` on another
machine. ``planner.make.make_plan`` turns a solved graph into one.

Its reports (``str(plan)``, ``table``, ``explain``, ``formula``, ``to_html``) are functions of its
data in ``autoshard/report/``, kept here as methods for the reader's convenience. The reports never
import this module (they read a plan's fields, whatever made it), so the imports run one way,
plan -> report, and no circle closes; what only the planner can price (each node's alternatives)
the planner leaves on the plan it makes (its declared field ``_priced``, a ``planner.make.Priced``,
named here for the type checker only), so this module imports no planner.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from autoshard import placement as pl
from autoshard.machine.cluster import Cluster
from autoshard.report import explain, summary
from autoshard.report.summary import fmt_bytes

if TYPE_CHECKING:
    from autoshard.planner.make import Priced


@dataclass(frozen=True)
class Collective:
    kind: str          # all_reduce, all_gather, reduce_scatter, all_to_all, send (attention's ring and swaps)
    phase: str         # forward or backward
    axes: tuple        # mesh axes it runs over
    bytes: int         # size of the tensor each rank passes in
    node: str          # the graph node it serves
    seconds: float = 0.0
    overlapped: bool = False   # started early and waited late by the schedule pass

    def __repr__(self) -> str:
        return f"{self.kind}[{self.phase}, axes={self.axes}, {fmt_bytes(self.bytes)}] at {self.node}"


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
    arrival: dict = field(default_factory=dict)   # user input -> the layout its rows arrive in (inputs="local")
    _alternatives: Optional[dict] = field(default=None, repr=False, compare=False)
    # what the planner priced the plan from, for what is worked out only when asked for (its
    # alternatives, its formula); None on a plan read from JSON, which does not hold the graph
    _priced: Optional[Priced] = field(default=None, repr=False, compare=False)

    @property
    def alternatives(self) -> dict:
        """node name -> the layouts the solver could have given it, priced with every other node
        as planned: the chosen one first, then the cheapest few (``planner.make.alternatives``,
        read by ``autoshard.report.explain``)."""
        if self._alternatives is None:
            self._alternatives = self._priced.alternatives(self) if self._priced else {}
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
            "arrival": {k: list(v) for k, v in self.arrival.items()},
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
            recompute=d.get("recompute", {}), arrival={k: tuple(v) for k, v in d.get("arrival", {}).items()},
            _alternatives=d.get("alternatives", {}))

