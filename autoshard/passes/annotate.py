"""Annotate: every node of the captured graph gets its legal nd signatures.

Rules speak of one mesh axis; a node's nd strategies are every combination of one-axis signatures
(the all-broadcast one included), one per axis, that leaves every tensor evenly divided (or, for
the ops ``rules.uneven`` names, unevenly where the chunks line up), puts no partial sum on a
non-float tensor and splits no input a signature needs whole on the axes after its own
(``Sig.whole_after``: the index of a split tensor's rows taken by all-to-all). Graph inputs may
be split or broadcast on each axis; parameters likewise (their placement is how they are
stored). Pins narrow a node to the strategies whose output matches (or, pinned as
``"inputs -> output"``, to that whole strategy).
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field


from autoshard import placement as pl
from autoshard.placement import B, Split
from autoshard.ir import Graph, Node, per_graph
from autoshard.outputs import output_layouts
from autoshard.passes.functionalize import SHARED_STORAGE
from autoshard.planner.progress import phase
from autoshard.rules import OpCtx, Sig, rule_for
from autoshard.rules.registry import norm_dim
from autoshard.rules.uneven import aligned, allows_uneven
from autoshard.rules.views import reshape, view_groups

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    inputs: tuple    # nd placement per tensor input
    outputs: tuple   # nd placement per tensor output
    # per mesh axis, which one-axis choice (signature or storage placement) it takes there; lets
    # planner.descend compare strategies off one axis without comparing placements
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


# ---- blocked splits: a fused projection cut into its blocks (q, k, v) ----------------------------
#
# ``q, k, v = linear(x, W_qkv).split(d, -1)``: a plain split of the 3d features over p ranks gives
# rank r features [3dr/p, 3d(r+1)/p), which straddle q, k and v, so the split needs the whole
# tensor. Cut instead within each block (S(-1)/3, rank r holds chunk r of q, of k and of v, as
# Megatron lays out its fused qkv weight), the split is local and each of q, k, v leaves S(-1).
# Only the ops on the path get the blocked signatures: the split into equal blocks, the views
# that keep the dim whole, the matmul that makes it, and the matmul's parameters' storage.

CAST = aten._to_copy.default
BLOCK_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default}


def blocked_splits(graph: Graph) -> dict:
    """node name -> (dim, groups): the output dim a node should also offer cut in ``groups``
    blocks, for a split downstream (the split node itself: its input dim)."""
    want: dict = {}
    for node in graph.nodes:
        if node.kind != "op" or node.target not in BLOCK_SPLITS or len(node.outputs) < 2:
            continue
        shape = graph.meta(node.inputs[0]).shape
        dim = norm_dim(node.fx_node.args[2] if len(node.fx_node.args) > 2 else node.fx_node.kwargs.get("dim", 0), len(shape))
        g = len(node.outputs)
        if any(m.shape[dim] * g != shape[dim] for m in node.outputs):
            continue
        want[node.name] = (dim, g)
        value, d = node.inputs[0], dim
        while True:   # back through views that keep the dim whole, to the matmul that makes it
            producer = graph.by_name[value[0]]
            if producer.kind != "op" or value[1] != 0:
                break
            if producer.target in MATMULS:
                if d == len(shape) - 1:   # the matmul's output features
                    want[producer.name] = (d, g)
                break
            if rule_for(producer.target) is not reshape:   # the view ops, every overload
                break
            a = graph.meta(producer.inputs[0]).shape
            b = producer.outputs[0].shape
            run = next(((gi, gj) for gi, gj in view_groups(a, b) or [] if gj == [d]), None)
            if run is None or len(run[0]) != 1:
                break
            want[producer.name] = (d, g)
            value, d, shape = producer.inputs[0], run[0][0], a
    return want


def blocked_sigs(node: Node, sigs: list, dim: int, groups: int) -> list:
    """The blocked forms of ``node``'s signatures that cut ``dim`` (of its output; of its input
    for the split itself): every split of the signature becomes the same split in blocks."""
    out = []
    if node.target in BLOCK_SPLITS:
        out.append(Sig((Split(dim, groups),) + (B,) * (len(node.inputs) - 1), (Split(dim),) * len(node.outputs)))
        return out
    for s in sigs:
        if s.outputs[0] == Split(dim):
            block = lambda p: Split(p.dim, groups) if isinstance(p, Split) else p   # noqa: E731
            out.append(Sig(tuple(map(block, s.inputs)), tuple(map(block, s.outputs))))
    return out


def expand(sigs: list, metas_in: list, metas_out: list, mesh_shape, uneven: bool = False) -> list:
    """All valid nd combinations of one-axis signatures. ``uneven``: the op may hold splits
    that do not divide, where its tensors' chunks line up (``rules.uneven``). A signature's
    ``whole_after`` inputs are split by no later axis than its own (``Sig``)."""
    out = []
    metas = list(metas_in) + list(metas_out)
    ordered = any(s.whole_after for s in sigs)
    for picks in itertools.product(range(len(sigs)), repeat=len(mesh_shape)):
        combo = [sigs[k] for k in picks]
        ins = tuple(tuple(c.inputs[i] for c in combo) for i in range(len(metas_in)))
        outs = tuple(tuple(c.outputs[i] for c in combo) for i in range(len(metas_out)))
        if all(pl.is_valid(m.shape, p, mesh_shape, m.floating, uneven) for m, p in zip(metas, ins + outs)) and \
           (not uneven or aligned([m.shape for m in metas], ins + outs, mesh_shape)) and \
           (not ordered or _in_order(combo, mesh_shape)):
            out.append(Strategy(ins, outs, picks))
    return out


def _in_order(combo, mesh_shape) -> bool:
    """No input a signature holds whole after its axis (``Sig.whole_after``) is split on a later axis."""
    for a, sig in enumerate(combo):
        if sig.whole_after and mesh_shape[a] > 1:
            for b in range(a + 1, len(combo)):
                if mesh_shape[b] > 1 and any(isinstance(combo[b].inputs[i], Split) for i in sig.whole_after):
                    return False
    return True


def storage_options(meta, mesh_shape, blocked=()) -> list:
    """Placements a graph input may take: split on any dim, or broadcast, per axis (never P);
    ``blocked``: blocked splits it may take too (a fused projection's weight), on one axis at
    most: a parameter lives as a DTensor, and DTensor cannot yet gather a dim cut in blocks by
    two mesh axes back whole."""
    one_axis = [B] + [Split(d) for d in range(len(meta.shape)) if meta.shape[d] > 1] + sorted(blocked, key=repr)
    out = []
    for picks in itertools.product(range(len(one_axis)), repeat=len(mesh_shape)):
        combo = tuple(one_axis[k] for k in picks)
        if sum(isinstance(p, Split) and p.groups > 1 for p in combo) > 1:
            continue
        if pl.is_valid(meta.shape, combo, mesh_shape, True):   # stored even: uneven splits are made by slicing
            out.append(Strategy((), (combo,), picks))
    return out


@per_graph
def _rules(graph: Graph) -> tuple:
    """node name -> (one-axis signatures, blocked forms included; whether a rule knew the op),
    worked out once per graph: the rules speak of one axis, whatever the mesh. The layers of a
    stack ask the rule once: nodes of the same op on the same arguments and shapes share the
    answer of the first."""
    blocked = blocked_splits(graph)
    asked: dict = {}
    out: dict = {}
    for node in graph.nodes:
        if node.kind != "op":
            continue
        key = graph.op_key(node) + (blocked.get(node.name),)
        if key not in asked:
            sigs, known = one_axis_sigs(node, graph)
            if node.name in blocked:
                sigs = sigs + [s for s in blocked_sigs(node, sigs, *blocked[node.name]) if s not in sigs]
            asked[key] = (sigs, known)
        out[node.name] = asked[key]
    stored: dict = {}     # parameter -> blocked splits a blocked matmul takes it in
    for node in graph.nodes:
        if node.name not in blocked or node.target not in MATMULS:
            continue
        for s in out[node.name][0]:
            for value, p in zip(node.inputs, s.inputs):
                if not (isinstance(p, Split) and p.groups > 1):
                    continue
                cast = graph.by_name[value[0]]
                if cast.kind == "op" and cast.target is CAST and graph.by_name[cast.inputs[0][0]].kind == "param":
                    # a parameter cast to the compute dtype (autoshard.precision) first: the cast cut in blocks too
                    sigs, known = out[cast.name]
                    more = [b for b in blocked_sigs(cast, sigs, p.dim, p.groups) if b not in sigs]
                    out[cast.name] = (sigs + more, known)
                    value = cast.inputs[0]
                if graph.by_name[value[0]].kind == "param":
                    stored.setdefault(value[0], set()).add(p)
    return out, stored


def annotate(graph: Graph, mesh_shape, pins: dict | None = None) -> dict:
    """node name -> list of Strategy. Warns once for each op that has no rule. Nodes of equal
    signatures and shapes share one list (the layers of a stack), on every call for this mesh."""
    with phase("annotate"):
        return _annotate(graph, mesh_shape, pins)


def _annotate(graph: Graph, mesh_shape, pins) -> dict:
    # once per mesh: a search asks again for each mesh it refines, and the overlap model for
    # the mesh it prices
    by_mesh = _annotated(graph)
    key = tuple(mesh_shape)
    if key not in by_mesh:
        by_mesh[key] = _unpinned(graph, mesh_shape)
    unpinned, missing = by_mesh[key]
    for op in sorted(missing):
        warnings.warn(f"autoshard has no sharding rule for {op}; it runs replicated (correct, "
                      "maybe slower)", UnknownOpWarning, stacklevel=3)
    strategies = dict(unpinned)
    for name, want in (pins or {}).items():
        whole = isinstance(want[0], tuple)   # (inputs, outputs): the node's whole strategy
        keep = [s for s in strategies[name] if ((s.inputs, s.outputs) == want if whole else
                                                s.outputs and s.outputs[0] == want)]
        if not keep:
            node = graph.by_name[name]
            choices = sorted({repr(s) if whole else pl.format_nd(s.outputs[0]) for s in strategies[name] if s.outputs})
            want = pl.format_nd(want) if not whole else \
                ", ".join(map(pl.format_nd, want[0])) + " -> " + ", ".join(map(pl.format_nd, want[1]))
            what = f"parameter {node.fqn!r}" if node.kind == "param" else f"node {name!r} ({node.op_name})"
            shape = node.outputs[0].shape if node.outputs else ()
            raise ValueError(
                f"cannot pin {what} of shape {list(shape)} to {want} on mesh "
                f"{tuple(mesh_shape)}: no legal layout has it (a split dim must divide evenly, "
                f"parameters are never P). Legal placements: {', '.join(choices)}")
        strategies[name] = keep
    return strategies


_annotated = per_graph(lambda graph: {})   # mesh -> ``_unpinned``'s answer
_expanded = per_graph(lambda graph: {})    # mesh -> {expansion key: strategies} (``_unpinned``)


@per_graph
def _expansions(graph: Graph) -> list:
    """[(node, the key its strategies are expanded by, how: mesh -> strategies)] in graph order,
    once per graph: the keys are the same on every mesh. The key is None where there is
    nothing to expand (no output, or the output node)."""
    rules, stored = _rules(graph)
    out = []
    for node in graph.nodes:
        if node.kind in ("param", "buffer", "input"):
            if not node.outputs:
                out.append((node, None, None))
                continue
            blocked = stored.get(node.name, ())
            key = ("storage", node.outputs[0], tuple(sorted(blocked, key=repr)))
            out.append((node, key, lambda mesh, meta=node.outputs[0], blocked=blocked: storage_options(meta, mesh, blocked)))
        elif node.kind == "output":
            out.append((node, None, None))
        else:
            sigs, _ = rules[node.name]
            metas_in = [graph.meta(v) for v in node.inputs]
            uneven = allows_uneven(node.target)
            key = (tuple(sigs), tuple((m.shape, m.floating) for m in metas_in),
                   tuple((m.shape, m.floating) for m in node.outputs), uneven)
            out.append((node, key, lambda mesh, sigs=sigs, metas_in=metas_in, outs=node.outputs, uneven=uneven:
                        expand(sigs, metas_in, outs, mesh, uneven)))
    return out


def _unpinned(graph: Graph, mesh_shape) -> tuple:
    """(node name -> strategies, the ops without a rule) of the mesh, before pins."""
    strategies: dict = {}
    rules = _rules(graph)[0]
    missing = {node.op_name for node in graph.nodes if node.kind == "op" and node.outputs and not rules[node.name][1]}
    # the layers of a stack expand the same signatures on the same shapes; so do later calls
    expanded = _expanded(graph).setdefault(tuple(mesh_shape), {})
    for node, key, make in _expansions(graph):
        if key is None:   # nothing to expand: no output, or the output node
            strategies[node.name] = [Strategy((), ())] if node.kind != "output" else \
                [Strategy(tuple(output_layouts(graph, mesh_shape)), ())]
            continue
        if key not in expanded:
            expanded[key] = make(mesh_shape)
        strategies[node.name] = expanded[key]
    for node in graph.nodes:   # storage an in-place op writes, seen through views: one local tensor
        if node.fx_node.meta.get(SHARED_STORAGE) and node.outputs:
            whole = [s for s in strategies[node.name] if all(all(isinstance(q, pl.Broadcast) for q in o) for o in s.outputs)]
            strategies[node.name] = whole or strategies[node.name]
    return strategies, missing
