"""Repeated blocks: the layers of a stack (``blocks.0``, ``blocks.1``, ...) that are the same
computation on the same shapes share one set of solver variables, so a 96-layer model costs the
solver what a 2-layer one does (DESIGN.md section 5).

Blocks are tied with period 2: every even layer takes block 0's layout and every odd layer block
1's, which keeps the layouts that alternate per layer (3-D tensor parallelism swaps its input and
output axes every layer) within reach. A block is tied only when its ops, shapes, internal
wiring, parameters and legal strategies (pins included) all equal those of the block it is tied
to; anything else keeps its own variables. Tied nodes and edges have equal costs, so the solver
prices one and counts it as many times as it occurs.
"""
from __future__ import annotations

from typing import Optional

from torch.export.graph_signature import OutputKind

from autoshard.ir import per_graph

PERIOD = 2


def _block_of(node):
    """(container path, index) of the first numbered module the node lives in, or None."""
    if node.kind in ("param", "buffer"):
        paths = [node.fqn or ""]
    elif node.kind == "op":
        stack = node.fx_node.meta.get("nn_module_stack") or {}
        paths = [v[0] for v in stack.values()]
    else:
        return None
    for path in paths:
        parts = path.split(".")
        for i, p in enumerate(parts):
            if p.isdigit() and i > 0:
                return ".".join(parts[:i]), int(p)
    return None


def _signature(members, graph, container):
    """What must agree for two blocks to share variables, but their strategies (``tie_repeated``
    compares those, per mesh)."""
    pos = {n.name: i for i, n in enumerate(members)}
    sig = []
    for n in members:
        ins = []
        for v in n.inputs:
            if v[0] in pos:
                ins.append(("in", pos[v[0]], v[1]))
            else:
                ins.append(("ext", graph.meta(v).shape))
        rel = n.fqn.split(".", len(container.split(".")) + 1)[-1] if n.fqn else None
        sig.append((n.kind, n.op_name, rel, n.requires_grad, tuple(m.shape for m in n.outputs),
                    tuple(m.dtype for m in n.outputs), tuple(ins)))
    return tuple(sig)


@per_graph
def _blocks(graph) -> list:
    """[(members of block k, members of the block it may tie to)] for every block past the first
    ``PERIOD`` of each stack whose ops, shapes and wiring equal its base's; once per graph."""
    blocks: dict = {}
    for n in graph.nodes:
        b = _block_of(n)
        if b is not None:
            blocks.setdefault(b[0], {}).setdefault(b[1], []).append(n)
    pairs = []
    for container, by_index in blocks.items():
        sigs = {k: _signature(ms, graph, container) for k, ms in by_index.items()}
        indices = sorted(by_index)
        for k in indices[PERIOD:]:
            base = indices[indices.index(k) % PERIOD]
            if sigs[k] == sigs[base]:
                pairs.append(([n.name for n in by_index[k]], [m.name for m in by_index[base]]))
    return pairs


def tie_repeated(graph, strategies) -> dict:
    """node name -> the name of the node whose variables it shares (itself when untied)."""
    rep = {n.name: n.name for n in graph.nodes}
    for names, bases in _blocks(graph):
        # the legal strategies (pins included) must agree too; the layers of a stack share their
        # lists (passes.annotate), so this is mostly a comparison of identities
        if all(strategies[a] is strategies[b] or strategies[a] == strategies[b] for a, b in zip(names, bases)):
            for a, b in zip(names, bases):
                rep[a] = b
    return rep


@per_graph
def stack_blocks(graph) -> dict:
    """block name -> its op node names, for every block of a stack of two or more that may run
    its forward twice; once per graph."""
    found: dict = {}
    for n in graph.nodes:
        if n.kind != "op":
            continue
        b = _block_of(n)
        if b is not None:
            found.setdefault(b[0], {}).setdefault(b[1], []).append(n.name)
    out = {}
    written = _written_buffers(graph)
    for container, by_index in found.items():
        if len(by_index) < 2:
            continue
        for k in sorted(by_index):
            names = by_index[k]
            # a block the user checkpoints already recomputes (passes.checkpoint.user_regions)
            if all(_repeatable(graph.by_name[m], written) for m in names):
                out[f"{container}.{k}"] = names
    return out


def _written_buffers(graph) -> set:
    """The names of the buffer nodes whose buffer the step writes (export's BUFFER_MUTATION
    outputs, which the parallel module copies in after the call): a checkpointed block fed such
    a buffer would find it changed when backward runs the block again."""
    targets = {s.target for s in graph.exported.graph_signature.output_specs
               if s.kind == OutputKind.BUFFER_MUTATION}
    return {n.name for n in graph.nodes if n.kind == "buffer" and n.fqn in targets}


def _repeatable(node, written: set) -> bool:
    """Whether running the op again changes nothing (no mutation, no running statistics, no
    read of a buffer the step writes), and the user's own checkpoint does not already run it
    again (``Node.region``)."""
    if getattr(node, "region", None) is not None:
        return False
    if any(v[0] in written for v in node.inputs if v is not None):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    return "batch_norm" not in node.op_name


TABLES_KEPT = 4   # a descent builds a new strategies dict per step; keep the last few tables only


def tied_plan(graph, strategies, choice) -> Optional[tuple]:
    """({node: how many nodes take its layout}, [(producer, value, consumer, slot, how many such
    edges)]) of a plan whose repeated blocks' nodes (planner.repeat) take their twins' strategies,
    as every plan the solver makes does: what it keeps is theirs times their count (bytes
    depend on the tensors and ops alone, alike in tied blocks), and what it costs as the
    solver counts it (``planner.tables.program_cost``). None for a plan that does not, or a graph with user
    checkpoint regions (whose blocks may checkpoint apart)."""
    if any(n.region is not None for n in graph.nodes):
        return None
    rep = tie_repeated(graph, strategies)
    if not all(choice[name] == choice[twin] for name, twin in rep.items() if name != twin):
        return None
    return tally(rep[n.name] for n in graph.nodes), _tied_edges(graph, rep)


_ties = per_graph(lambda graph: {})   # tuple(rep.items()) -> ``twin_edges``, the last TABLES_KEPT


def _tied_edges(graph, rep: dict) -> list:
    """``twin_edges``, once per graph and tying (a descent's steps tie alike)."""
    kept = _ties(graph)
    key = tuple(rep.items())
    hit = kept.get(key)
    if hit is None:
        hit = kept[key] = twin_edges(graph, rep)
        while len(kept) > TABLES_KEPT:
            kept.pop(next(iter(kept)))
    return hit


def twin_edges(graph, rep: dict) -> list:
    """(producer, value, consumer, slot, times) once per set of twin edges: the edges of repeated
    blocks that join twin nodes share their variables and their costs (planner.repeat)."""
    first, count = {}, {}
    for v in graph.nodes:
        for slot, value in enumerate(v.inputs):
            key = (rep[value[0]], value[1], rep[v.name], slot)
            if key not in first:
                first[key] = (graph.by_name[value[0]], value, v, slot)
            count[key] = count.get(key, 0) + 1
    return [first[k] + (count[k],) for k in first]


def tally(keys) -> dict:
    out: dict = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out
