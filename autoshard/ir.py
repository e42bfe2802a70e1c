"""The graph the planner works on: every tensor a value ``(node name, output index)``, every node
with the metas of its tensor outputs (``passes.capture`` makes it from torch.export's program).

What a pass works out once per graph and reuses for every mesh (annotate's rule signatures,
repeat's blocks, the overlap model's readers) is kept by that pass, not written onto the graph:
``per_graph`` memos, weakly keyed by the graph, so that each fact is found beside the code that
derives it and goes with the graph.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
from torch.export import ExportedProgram


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __repr__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}[{', '.join(map(str, self.shape))}]"


Value = tuple  # (producer node name, output index)


@dataclass
class Node:
    name: str
    kind: str                      # "param", "buffer", "input", "op", "output"
    fx_node: fx.Node
    inputs: list = field(default_factory=list)    # Values, one per tensor argument, in order
    outputs: list = field(default_factory=list)   # TensorMeta, one per tensor output
    requires_grad: bool = False
    fqn: Optional[str] = None      # parameters and buffers: their name in the module
    region: Optional[int] = None   # ops: the user's torch.utils.checkpoint call it ran in, numbered
    recomputed: bool = False       # in a region, and read only there: made again in backward, not kept

    @property
    def target(self):
        return self.fx_node.target

    @property
    def op_name(self) -> str:
        if self.kind != "op":
            return self.kind
        t = self.fx_node.target
        return str(t).replace("aten.", "") if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


@dataclass(eq=False)   # a graph is itself: equal by identity, and hashed so (``per_graph``)
class Graph:
    nodes: list                     # topological order; the last is the output node
    exported: ExportedProgram
    param_aliases: dict             # every parameter fqn -> the fqn the graph uses for it
    user_inputs: list               # names of the user-input placeholders, in call order
    value_of: dict = field(default_factory=dict)   # fx node of the export -> Value (list if several)
    # the mixed precision written into it (autoshard.precision): the policy's record and the
    # caller's autocast dtype, or None
    precision: Optional[dict] = None
    # how the caller takes the user outputs: "whole" on every rank, or "dtensor" in their planned
    # layouts (autoshard.outputs), which the cost of converting them to the output depends on
    outputs: str = "whole"
    # a pipeline stage's (``planner.pipeline.capture_stage``): how many of its first user inputs
    # cross from the stage before, each rank's share in its crossing layout (``autoshard.inputs``)
    received: int = 0
    _op_keys: dict = field(default_factory=dict, init=False, repr=False)   # node name -> ``op_key``

    def __post_init__(self):
        self.by_name = {n.name: n for n in self.nodes}

    def op_key(self, node: Node) -> tuple:
        """What an op node is, apart from its name: its target, its arguments (each fx node by
        the order it first appears in, so ``mul(a, a)`` and ``mul(a, b)`` differ, constants as
        they are) and its tensors. The layers of a stack hold nodes of equal keys: annotation
        asks their rule once, and the cost model prices them once. Worked out once per node:
        every mesh's annotation and pricing asks again."""
        keys = self._op_keys
        hit = keys.get(node.name)
        if hit is None:
            order: dict = {}
            hit = keys[node.name] = (node.target, _arg_key(node.fx_node.args, order),
                                     _arg_key(node.fx_node.kwargs, order),
                                     tuple(self.meta(v) for v in node.inputs), tuple(node.outputs))
        return hit

    def meta(self, value: Value) -> TensorMeta:
        return self.by_name[value[0]].outputs[value[1]]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    def users(self) -> dict:
        """value -> [(consumer name, input slot)]"""
        out: dict = {}
        for n in self.nodes:
            for i, v in enumerate(n.inputs):
                out.setdefault(v, []).append((n.name, i))
        return out


def per_graph(make):
    """``make(graph)`` once per graph: a decorator for what a pass works out from the graph alone
    and reuses for every mesh, kept by the module that derives it (the module docstring) and
    dropped with the graph."""
    kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(make)
    def memo(graph: Graph):
        hit = kept.get(graph)
        if hit is None:
            hit = kept[graph] = make(graph)
        return hit
    return memo


def _arg_key(x, order: dict):
    """A hashable stand-in for an op's arguments (``Graph.op_key``)."""
    if isinstance(x, torch.fx.Node):
        sub = getattr(x.graph.owning_module, x.target, None) if x.op == "get_attr" else None
        if isinstance(sub, torch.fx.GraphModule):   # a higher-order op's subgraph (FlexAttention's mods)
            return ("graph", sub.code)
        return ("node", order.setdefault(x, len(order)))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_arg_key(v, order) for v in x)
    if isinstance(x, dict):
        return ("dict",) + tuple((k, _arg_key(v, order)) for k, v in sorted(x.items()))
    try:
        hash(x)
    except TypeError:
        return ("repr", repr(x))
    return x
