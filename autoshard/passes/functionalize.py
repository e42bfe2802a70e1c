"""Functionalize: in-place ops become their out-of-place forms before planning.

Models write ``x += y``, ``nn.ReLU(inplace=True)``, ``scores.masked_fill_(mask, -inf)``,
``out.index_put_(idx, vals, accumulate=True)``, ``w.div_(w.sum(-1, keepdim=True))``; torch.export
keeps them as ``add_``, ``relu_``, ``masked_fill_``, ``index_put_``, ``div_``. The planner's rules are
written for the out-of-place ops, and a layout conversion in front of an in-place op would
mutate a copy. So each in-place node whose overwritten tensor is never read again at its old
value takes its out-of-place op (``add_.Tensor`` -> ``add.Tensor``, same arguments): torch.export
already routes every later use of the tensor through the in-place node, so only aliases can
still see the old storage. The node keeps its name and everything else.

A buffer written in place (a step counter, a running average) is written out of place as well,
and its last value returned as the buffer's new value (export's BUFFER_MUTATION output), which
the parallel module copies into the buffer after each call.

An in-place node stays as it is (with no rule, it runs replicated) where functionalizing would
change what the model computes:

  - it writes into a parameter or a user input, whose mutation the caller sees after the call,
    or into a view of a buffer (a part of it);
  - a view of the same storage (the tensor it writes, the tensor that is a view of, or any other
    view of either) is read after it, or made after it: that read must see the write;
  - the out-of-place op would give another shape or dtype (an in-place op keeps its target's
    dtype where the out-of-place one promotes: a bf16 tensor added to in float32).

Such a write is right only where every tensor sharing its storage is one local tensor on each
rank, as on one device: the nodes holding that storage are marked (``SHARED_STORAGE``), kept
broadcast by annotate (a layout conversion between them would copy), and converted afresh for
each consumer outside them (a conversion made before the write must not serve a read after it).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
# fx meta key: a node holding storage that an in-place op left in place writes (passes.annotate
# keeps it broadcast, passes.rewrite converts it afresh for each consumer)
SHARED_STORAGE = "autoshard_shared_storage"


def out_of_place(target) -> Optional[torch._ops.OpOverload]:
    """The out-of-place overload of an in-place aten op (``mul_.Tensor`` -> ``mul.Tensor``): the
    same overload of the packet named without the trailing underscore, taking the same arguments."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    name = target.overloadpacket.__name__
    if not (name.endswith("_") and not name.endswith("__") and schema.arguments
            and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write):
        return None
    packet = getattr(aten, name[:-1], None)
    functional = getattr(packet, target._overloadname, None) if packet is not None else None
    if functional is None:
        return None
    theirs = [(a.name, str(a.type)) for a in functional._schema.arguments]
    if theirs != [(a.name, str(a.type)) for a in schema.arguments]:
        return None
    return functional


def copied(self, src, non_blocking: bool = False):
    """``copy(self, src)`` as the program runs it (``rewrite.LOWERINGS``): aten's has no
    derivative. ``src`` cast to self's dtype and broadcast to its shape, in a tensor of its own."""
    return src.to(self.dtype).expand(self.shape).clone()


def _aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s result shares storage with its first argument: a view, an in-place op,
    or an element of a multi-output view (``split``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _aliases_input(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and node.args and isinstance(node.args[0], fx.Node))


def _storage(node: fx.Node) -> tuple:
    """(the node that made the storage ``node`` holds, every node that holds it)."""
    root = node
    while _aliases_input(root):
        root = root.args[0]
    holders, todo = [], [root]
    while todo:
        n = todo.pop()
        holders.append(n)
        todo.extend(u for u in n.users if _aliases_input(u) and u.args[0] is n)
    return root, holders


def _after(node: fx.Node, holders: list, order: dict) -> bool:
    """Whether a holder of the storage other than ``node`` and what derives from it is made or
    read after ``node``."""
    mine = {node}
    for n in holders:   # holders come parent first
        if _aliases_input(n) and n.args[0] in mine:
            mine.add(n)
    at = order[node]
    return any(order[h] > at or any(order[u] > at for u in h.users)
               for h in holders if h not in mine)


def _meta(x):
    if isinstance(x, fx.Node):
        val = x.meta.get("val")
        return torch.empty(val.shape, dtype=val.dtype, device="meta") if isinstance(val, torch.Tensor) else val
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    return x


def _same_result(node: fx.Node, functional) -> bool:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    try:
        out = functional(*_meta(node.args), **{k: _meta(v) for k, v in node.kwargs.items()})
    except Exception:  # noqa: BLE001 - an op the meta device cannot run: keep the in-place op
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(val.shape) and out.dtype == val.dtype


_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default}


def _scattered(g: fx.Graph, node: fx.Node, functional, root: fx.Node, holders: list, order: dict) -> bool:
    """A write into slices of a tensor the graph made (``t = x.new_empty(...); t[..., :k].copy_(a);
    t[..., k:].copy_(b)``, DeepSeek-V3's keys; ``shifted[:, 1:] = ids[:, :-1]``, BART's labels)
    made out of place: the written slice's new value, scattered back up the chain of slices
    (``slice_scatter`` / ``select_scatter``), and every later use of the tensor reads the result.
    Only where nothing else sees the old storage after the write: no other view of it made before
    and read after, no later use of the slices but the write. Whether it was made."""
    chain, view = [], node.args[0]
    while view is not root:
        if view.target not in _SCATTERS or view.kwargs:
            return False
        chain.append(view)
        view = view.args[0]
    at = order[node]
    mine = set(chain) | {node, root}
    if any(h not in mine and order[h] < at and any(order[u] > at for u in h.users) for h in holders):
        return False
    if any(u is not node and u not in chain and order[u] > at for c in chain for u in c.users):
        return False
    if not _same_result(node, functional):
        return False
    keep = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "custom") if k in node.meta}
    with g.inserting_after(node):
        value = g.call_function(functional, node.args, node.kwargs)
    value.meta = dict(keep, val=node.meta["val"])
    last = value
    for v in chain:   # the slice's new value written into its parent, up to the root
        with g.inserting_after(last):
            last = g.call_function(_SCATTERS[v.target], (v.args[0], last) + tuple(v.args[1:]))
        last.meta = dict(keep, val=v.args[0].meta["val"])
    node.replace_all_uses_with(value)
    for u in list(root.users):
        if u in order and order[u] > at:
            u.replace_input_with(root, last)
    g.erase_node(node)
    return True


def functionalize(gm: fx.GraphModule, signature=None) -> list:
    """In place on ``gm`` (as ``capture.inline_regions``): every in-place node that can take its
    out-of-place op, takes it. With the program's ``signature`` (an ExportGraphSignature, also
    changed in place), a buffer written whole in place (a running average, a step counter) is
    written out of place too, its last value returned as the buffer's new value (a
    BUFFER_MUTATION output, which the parallel module copies into the buffer after the call).
    Returns the in-place nodes left as they are."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    buffers = _buffer_placeholders(gm, signature)   # placeholder -> buffer name
    holds = {}   # node -> the buffer whose new value it holds
    kept, changed = [], False
    for node in list(gm.graph.nodes):
        functional = out_of_place(node.target) if node.op == "call_function" else None
        if functional is None or not isinstance(node.args[0], fx.Node):
            continue
        root, holders = _storage(node.args[0])
        buffer = buffers.get(root, holds.get(root)) if node.args[0] is root else None
        fresh = root.op == "call_function" and root not in holds
        if fresh and node.args[0] is not root and _scattered(gm.graph, node, functional, root, holders, order):
            order, changed = {n: i for i, n in enumerate(gm.graph.nodes)}, True
            continue
        if (not fresh and buffer is None) or _after(node, holders, order) or not _same_result(node, functional):
            kept.append(node)
            for h in holders:
                h.meta[SHARED_STORAGE] = True
            continue
        node.target, changed = functional, True
        if buffer is not None:
            holds[node] = buffer
    if holds:
        _return_buffers(gm, signature, {b: n for n, b in holds.items()})   # each buffer's last value
    if changed:
        gm.recompile()
    return kept


def _buffer_placeholders(gm: fx.GraphModule, signature) -> dict:
    if signature is None:
        return {}
    from torch.export.graph_signature import InputKind
    names = {s.arg.name: s.target for s in signature.input_specs if s.kind == InputKind.BUFFER}
    return {n: names[n.name] for n in gm.graph.nodes if n.op == "placeholder" and n.name in names}


def _return_buffers(gm: fx.GraphModule, signature, last: dict) -> None:
    """Return ``last[buffer]`` as each buffer's new value, ahead of the user outputs (export's order)."""
    from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = tuple(last.values())
    out.args = (values + tuple(out.args[0]),) + tuple(out.args[1:])
    specs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(n.name), b) for b, n in last.items()]
    signature.output_specs[:0] = specs
