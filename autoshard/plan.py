"""Plan: the layout the solver chose for every tensor, with its costs and collectives.

A plan is data: it can be printed, saved as JSON, loaded and handed to ``parallelize`` on another
machine. ``make_plan`` turns a solved graph into one.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from autoshard import placement as pl
from autoshard.cluster import Cluster
from autoshard.cost import comm
from autoshard.cost.memory import rank_memory
from autoshard.cost.step import Cost


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
        by_node: dict = {}
        for c in self.collectives:
            by_node.setdefault(c.node, []).append(c)
        rows = [("node", "op", "shape", "placement", "collectives", "compute", "comm")]
        for n in self.nodes.values():
            if n.kind == "output":
                continue
            colls = "; ".join(f"{c.kind}{_axes(c.axes)} {c.phase[:3]} {_fmt_bytes(c.bytes)}" for c in by_node.get(n.name, []))
            shape = "x".join(map(str, n.shapes[0])) if n.shapes else "-"
            place = pl.format_nd(n.out_placements()[0]) if n.outputs else "-"
            rows.append((n.name, n.op, shape, place, colls or "-", _fmt_s(n.compute), _fmt_s(n.comm)))
        out_colls = by_node.get("output", [])
        if out_colls:
            rows.append(("output", "output", "-", "B", "; ".join(f"{c.kind}{_axes(c.axes)} fwd {_fmt_bytes(c.bytes)}" for c in out_colls),
                         "-", _fmt_s(sum(c.seconds for c in out_colls))))
        widths = [min(max(len(r[i]) for r in rows), 60) for i in range(len(rows[0]))]
        lines = ["  ".join(str(c)[:60].ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        compute = sum(n.compute for n in self.nodes.values())
        commt = sum(c.seconds for c in self.collectives)
        hidden = sum(c.seconds for c in self.collectives if c.overlapped)
        exposed = Cost(**self.breakdown).exposed if self.breakdown else commt
        kinds: dict = {}
        for c in self.collectives:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        per_axis: dict = {}
        for c in self.collectives:
            for a in c.axes:   # a collective over several axes at once: an equal share to each
                per_axis[a] = per_axis.get(a, 0.0) + c.seconds / len(c.axes)
        head = (f"autoshard plan: mesh {tuple(self.mesh_shape)} ({self.world} devices"
                f"{', ' + self.cluster.name if self.cluster else ''}), "
                f"{'training' if self.training else 'inference'}")
        solver = self.solver
        foot = [
            "",
            f"compute {_fmt_s(compute)}  +  exposed communication {_fmt_s(exposed)}  =  {_fmt_s(self.cost)} per step (estimated)",
            f"communication {_fmt_s(commt)}, of which {_fmt_s(hidden)} is overlapped with compute by the schedule "
            f"(gradient buckets of {_fmt_bytes(self.schedule.get('bucket_bytes', 0))}, prefetched parameter gathers)"
            + ("; converted parameters are freed after forward and converted again for backward"
               if self.schedule.get("reshard_after_forward") else ""),
            "collectives: " + (", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"),
            "communication per axis: " + (", ".join(f"axis {a} {_fmt_s(t)}" for a, t in sorted(per_axis.items())) or "none"),
        ]
        if self.memory:
            m = self.memory
            foot.append("memory per rank: " + ", ".join(f"{k} {_fmt_bytes(m[k])}" for k in
                        ("parameters", "gradients", "optimizer", "activations", "total"))
                        + (f" (budget {_fmt_bytes(m['budget'])})" if m.get("budget") else ""))
        if self.mesh_candidates:
            ranked = [c for c in self.mesh_candidates if c.get("cost") is not None]
            foot.append(f"mesh search: {len(self.mesh_candidates)} shapes, {len(ranked)} solved, best first: "
                        + ", ".join(f"{tuple(c['mesh'])} {_fmt_s(c['cost'])}" for c in ranked[:5]))
        if solver:
            gap = solver.get("gap")
            foot.append(f"solver: {solver.get('status')} in {solver.get('seconds', 0):.2f} s, "
                        + (f"optimality gap {100 * gap:.2f}%" if gap is not None else
                           "a local optimum of one-axis descent (no bound on this mesh)"))
        return "\n".join([head, ""] + lines + foot)

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
            mesh_candidates=d.get("mesh_candidates", []))


def _axes(axes) -> str:
    return "(" + ",".join(map(str, axes)) + ")"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def _fmt_s(t: float) -> str:
    if t == 0:
        return "0"
    if t >= 1:
        return f"{t:.2f}s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f}ms"
    return f"{t * 1e6:.1f}us"


def make_plan(graph, strategies, solution, costs) -> Plan:
    """The chosen strategy of every node, with the collectives and costs it implies."""
    mesh, links = costs.mesh_shape, costs.links
    nodes, params, colls = {}, {}, []
    total = Cost()
    for n in graph.nodes:
        strat = strategies[n.name][solution.choice[n.name]]
        cost = costs.node(n, strat)
        for slot, value in enumerate(n.inputs):
            producer = graph.by_name[value[0]]
            src = strategies[producer.name][solution.choice[producer.name]].outputs[value[1]]
            dst = strat.inputs[slot]
            cost = cost + costs.convert(value, src, dst, n)
            meta = graph.meta(value)
            steps, hidden = costs.conversion(value, src, dst)
            phases = [("forward", steps, hidden)]
            if costs.training and meta.floating and n.kind != "output" and producer.requires_grad:
                phases.append(("backward", comm.dual_steps(steps, mesh), hidden))
                if costs.regathered(value):   # converted again for the backward, which waits for it
                    phases.append(("backward", steps, False))
            for phase, sts, hid in phases:
                for i, st in enumerate(sts):
                    if st.is_collective:
                        t = comm.step_time(st, meta.itemsize, mesh, links)
                        over = hid and i == (0 if sts is steps else len(sts) - 1)
                        colls.append(Collective(st.kind, phase, st.axes, comm.step_bytes(st, meta.itemsize),
                                                n.name, t, over))
        for axes, nbytes, t in costs.grad_syncs(n, strat):
            colls.append(Collective("all_reduce", "backward", axes, nbytes, n.name, t, True))
        if n.kind == "op":
            for c in comm.op_collectives(n, strat, graph, mesh):
                t = comm.all_reduce_time(c.nbytes, mesh[c.axis], links[c.axis])
                colls.append(Collective(c.kind, "forward", (c.axis,), c.nbytes, n.name, t))
        total = total + cost
        nodes[n.name] = NodeChoice(
            name=n.name, kind=n.kind, op=n.op_name, shapes=[m.shape for m in n.outputs],
            inputs=[pl.to_strings(p) for p in strat.inputs], outputs=[pl.to_strings(p) for p in strat.outputs],
            compute=cost.compute, comm=cost.communication, fqn=n.fqn)
    param_node = {n.fqn: n.name for n in graph.nodes if n.kind == "param"}
    for alias, fqn in graph.param_aliases.items():
        if fqn in param_node:
            params[alias] = tuple(nodes[param_node[fqn]].outputs[0])
    solver = {"status": solution.status, "objective": solution.objective, "bound": solution.bound,
              "gap": solution.gap, "seconds": solution.seconds}
    input_shapes = [graph.by_name[i].outputs[0].shape if graph.by_name[i].outputs else () for i in graph.user_inputs]
    memory = rank_memory(graph, strategies, solution.choice, mesh, costs.training, costs.reshard)
    return Plan(tuple(mesh), nodes, params, colls, total.step, costs.training, costs.cluster, solver,
                input_shapes, memory, asdict(total),
                {"bucket_bytes": costs.bucket_bytes, "reshard_after_forward": costs.reshard})
