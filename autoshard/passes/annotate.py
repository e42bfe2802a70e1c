"""Annotate: every node of the captured graph gets its legal nd signatures.

Rules speak of one mesh axis; a node's nd strategies are every combination of one-axis signatures
(the all-broadcast one included), one per axis, that leaves every tensor evenly divided and puts no
partial sum on a non-float tensor. Graph inputs may be split or broadcast on each axis; parameters
likewise (their placement is how they are stored). Pins narrow a node to the strategies whose
output matches.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field


from autoshard import placement as pl
from autoshard.placement import B, Split
from autoshard.passes.capture import Graph, Node
from autoshard.rules import OpCtx, Sig, rule_for


@dataclass(frozen=True)
class Strategy:
    inputs: tuple    # nd placement per tensor input
    outputs: tuple   # nd placement per tensor output
    # per mesh axis, which one-axis choice (signature or storage placement) it takes there; lets
    # passes.descend compare strategies off one axis without comparing placements
    axes: tuple = field(default=(), compare=False, repr=False)

    def __repr__(self) -> str:
        ins = ", ".join(pl.format_nd(p) for p in self.inputs)
        outs = ", ".join(pl.format_nd(p) for p in self.outputs)
        return f"{ins} -> {outs}" if self.inputs else outs


class UnknownOpWarning(UserWarning):
    pass


def one_axis_sigs(node: Node, graph: Graph) -> list:
    """The node's one-axis signatures, all-broadcast first. Warns once per op without a rule."""
    n_in, n_out = len(node.inputs), len(node.outputs)
    replicated = Sig((B,) * n_in, (B,) * n_out)
    rule = rule_for(node.target)
    if rule is None:
        return [replicated], False
    ctx = OpCtx(node.target, node.fx_node.args, node.fx_node.kwargs,
                [graph.meta(v).shape for v in node.inputs], [m.shape for m in node.outputs])
    sigs = [replicated]
    for s in rule(ctx):
        if len(s.inputs) != n_in or len(s.outputs) != n_out:
            raise AssertionError(f"rule for {node.op_name} returned {s} for {n_in} inputs, {n_out} outputs")
        if s not in sigs:
            sigs.append(s)
    return sigs, True


def expand(sigs: list, metas_in: list, metas_out: list, mesh_shape) -> list:
    """All valid nd combinations of one-axis signatures."""
    out = []
    for picks in itertools.product(range(len(sigs)), repeat=len(mesh_shape)):
        combo = [sigs[k] for k in picks]
        ins = tuple(tuple(c.inputs[i] for c in combo) for i in range(len(metas_in)))
        outs = tuple(tuple(c.outputs[i] for c in combo) for i in range(len(metas_out)))
        if all(pl.is_valid(m.shape, p, mesh_shape, m.floating) for m, p in zip(metas_in, ins)) and \
           all(pl.is_valid(m.shape, p, mesh_shape, m.floating) for m, p in zip(metas_out, outs)):
            out.append(Strategy(ins, outs, picks))
    return out


def storage_options(meta, mesh_shape) -> list:
    """Placements a graph input may take: split on any dim, or broadcast, per axis (never P)."""
    one_axis = [B] + [Split(d) for d in range(len(meta.shape)) if meta.shape[d] > 1]
    out = []
    for picks in itertools.product(range(len(one_axis)), repeat=len(mesh_shape)):
        combo = tuple(one_axis[k] for k in picks)
        if pl.local_shape(meta.shape, combo, mesh_shape) is not None:
            out.append(Strategy((), (combo,), picks))
    return out


def annotate(graph: Graph, mesh_shape, pins: dict | None = None) -> dict:
    """node name -> list of Strategy. Warns once for each op that has no rule."""
    strategies: dict = {}
    missing: set = set()
    expanded: dict = {}   # the layers of a stack expand the same signatures on the same shapes
    for node in graph.nodes:
        if node.kind in ("param", "buffer", "input"):
            strategies[node.name] = storage_options(node.outputs[0], mesh_shape) if node.outputs else [Strategy((), ())]
        elif node.kind == "output":
            strategies[node.name] = [Strategy(tuple((B,) * len(mesh_shape) for _ in node.inputs), ())]
        else:
            sigs, known = one_axis_sigs(node, graph)
            if not known and node.outputs:
                missing.add(node.op_name)
            metas_in = [graph.meta(v) for v in node.inputs]
            key = (tuple(sigs), tuple((m.shape, m.floating) for m in metas_in),
                   tuple((m.shape, m.floating) for m in node.outputs))
            if key not in expanded:
                expanded[key] = expand(sigs, metas_in, node.outputs, mesh_shape)
            strategies[node.name] = expanded[key]
    for op in sorted(missing):
        warnings.warn(f"autoshard has no sharding rule for {op}; it runs replicated (correct, "
                      "maybe slower)", UnknownOpWarning, stacklevel=3)
    for name, want in (pins or {}).items():
        keep = [s for s in strategies[name] if s.outputs and s.outputs[0] == want]
        if not keep:
            node = graph.by_name[name]
            choices = sorted({pl.format_nd(s.outputs[0]) for s in strategies[name] if s.outputs})
            what = f"parameter {node.fqn!r}" if node.kind == "param" else f"node {name!r} ({node.op_name})"
            shape = node.outputs[0].shape if node.outputs else ()
            raise ValueError(
                f"cannot pin {what} of shape {list(shape)} to {pl.format_nd(want)} on mesh "
                f"{tuple(mesh_shape)}: no legal layout has it (a split dim must divide evenly, "
                f"parameters are never P). Legal placements: {', '.join(choices)}")
        strategies[name] = keep
    return strategies
