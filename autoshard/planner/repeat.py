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


def _blocks(graph) -> list:
    """[(members of block k, members of the block it may tie to)] for every block past the first
    ``PERIOD`` of each stack whose ops, shapes and wiring equal its base's; once per graph."""
    if "blocks" in graph.cache:
        return graph.cache["blocks"]
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
    graph.cache["blocks"] = pairs
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
