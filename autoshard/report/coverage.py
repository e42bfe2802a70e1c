"""Coverage: which ops of a traced model have sharding rules, which run replicated, and what that costs.

    model -> capture -> per aten op: its nodes, whether a rule covers it, whether it carries real
          compute, how many of its nodes can be split on the mesh
          -> for each op that runs replicated: its compute whole and split evenly, and the layout
             conversions it forces on its neighbours, priced by the solver's own cost model

A node runs replicated when every strategy annotate offers it on the mesh is all-broadcast, for
one of three reasons: the op has no rule (``rules.rule_for`` is None: annotate's UnknownOpWarning),
its rule offers no split for this node (factories, random draws, attention with dropout), or none
of the rule's splits divides this node's tensors evenly on the mesh (nor, for an op that takes
uneven splits, ``rules.uneven``, gives every rank a chunk of them that lines up). A node with no tensor input
or output, or with only scalars among them (a step counter), has nothing to split and never
counts as replicated.

What counts as real compute. An op carries real compute when either

  - it is one of the ops models spend their time in (``COMPUTE_OPS``, plus every op
    ``cost.compute`` counts FLOPs for): contractions, convolutions, attention, embedding lookups,
    normalizations, softmax and the losses built on it, pooling and upsampling. Left replicated,
    each of these costs its full work on every rank at any model size; or
  - running all its nodes replicated would add at least ``COMPUTE_SHARE`` (1%) to the step of the
    model split evenly over the world: time * (1 - 1/p) >= 1% * total / p, where time and total
    are the forward (+ backward when training) seconds of the op and of the whole graph run on
    whole tensors (``cost.compute.op_time``, as the solver prices them). This catches anything
    big in this model that the list misses (an in-place add on the residual stream), and leaves out
    bookkeeping: batch norm's ``num_batches_tracked += 1``, a position ``arange``. Views (view,
    transpose, split: results that alias their input) and ops with no tensor output (export's
    ``_assert_tensor_metadata``) never count this way: they do no work on a device, though
    ``op_time`` charges them the bytes of their tensors.

What a fallback costs, per step and per rank (``cost.price.Costs``, the numbers the solver uses):

    whole        seconds of its replicated nodes on whole tensors, forward (+ backward)
    split        the same divided by the world: every FLOP and byte shared evenly, the best a rule
                 could do
    conversions  seconds, and bytes as ``Plan.collectives`` counts them (the tensor each rank passes
                 into each collective), of converting every tensor input from an even split to
                 broadcast and every output back to an even split, forward and, where a gradient
                 flows, the dual backward: what the op costs neighbours that stay split. A graph
                 input is taken whole at no cost (every rank is handed the whole batch)
    cost         whole - split + conversions

Each op is priced alone, as if its neighbours were split: two replicated ops side by side pass
their tensor between them whole, so the sum of their conversions overstates what they force.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from autoshard import placement as pl
from autoshard.convert import dual_steps
from autoshard.api import resolve_cluster, resolve_mesh
from autoshard.machine.cluster import Cluster
from autoshard.cost import comm, compute
from autoshard.passes.annotate import Strategy, expand, one_axis_sigs, storage_options
from autoshard.ir import Graph, Node
from autoshard.passes.capture import capture
from autoshard.cost.price import Costs
from autoshard.report.summary import fmt_bytes as _fmt_bytes, fmt_s as _fmt_s
from autoshard.rules import rule_for
from autoshard.rules.uneven import allows_uneven

# an op whose replication adds this much to the step of the model split ideally carries real
# compute, whatever it is (module docstring)
COMPUTE_SHARE = 0.01

# aten op names (overload packets) that carry real compute at any size; see the module docstring
COMPUTE_OPS = frozenset({
    # contractions
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "matmul", "linear", "bilinear",
    "einsum", "tensordot", "cdist",
    # convolutions
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d",
    # attention
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    # lookups
    "embedding", "embedding_bag", "_embedding_bag",
    # normalizations
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "native_group_norm", "batch_norm",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "instance_norm",
    # softmax and the losses over it
    "softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "logsumexp",
    "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d",
    # pooling and upsampling
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
})

NO_RULE = "no rule"
NO_SPLIT = "rule offers no split"
UNEVEN = "no even split on the mesh"


def is_compute_op(target) -> bool:
    """Whether ``target`` is on the list of ops that carry real compute at any size."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target in compute.FLOPS or target.overloadpacket.__name__ in COMPUTE_OPS


@dataclass(frozen=True)
class OpCoverage:
    """One aten op (overload) of the graph: its nodes, rule, compute, and fallback cost."""
    op: str                        # e.g. "linear.default"
    nodes: int
    has_rule: bool
    compute: bool                  # carries real compute (module docstring)
    time: float                    # seconds of all its nodes on whole tensors, forward (+ backward)
    replicated: tuple = ()         # names of the nodes that run replicated on the mesh
    why: tuple = ()                # why they do: NO_RULE, NO_SPLIT, UNEVEN
    whole_time: float = 0.0        # seconds of the replicated nodes on whole tensors
    split_time: float = 0.0        # the same shared evenly over the world
    conversion_time: float = 0.0   # seconds of the conversions they force, forward and backward
    conversion_bytes: int = 0      # bytes passed into those conversions' collectives

    @property
    def falls_back(self) -> bool:
        return bool(self.replicated)

    @property
    def fallback_cost(self) -> float:
        """Seconds per step and rank its replicated nodes cost over splitting them evenly."""
        return self.whole_time - self.split_time + self.conversion_time


@dataclass(frozen=True)
class Coverage:
    """Per op of a traced model: rule, compute, the nodes that run replicated and what they cost.
    ``str()`` prints it as tables with a one-line verdict."""
    model: str
    mesh_shape: tuple
    cluster: Cluster
    training: bool
    ops: tuple          # OpCoverage, the most time first
    total_time: float   # seconds of every op node on whole tensors, forward (+ backward)

    @property
    def world(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def nodes(self) -> int:
        return sum(o.nodes for o in self.ops)

    @property
    def with_rules(self) -> list:
        return [o for o in self.ops if o.has_rule]

    @property
    def without_rules(self) -> list:
        return [o for o in self.ops if not o.has_rule]

    @property
    def fallbacks(self) -> list:
        """Ops with a node that runs replicated, the costliest first."""
        return sorted((o for o in self.ops if o.falls_back), key=lambda o: (-o.fallback_cost, o.op))

    @property
    def compute_fallbacks(self) -> list:
        """The fallbacks that carry real compute: empty when every compute op runs split."""
        return [o for o in self.fallbacks if o.compute]

    @property
    def fallback_cost(self) -> float:
        return sum(o.fallback_cost for o in self.fallbacks)

    def op(self, name: str) -> OpCoverage:
        """The row of one op, by its aten overload name (``"linear.default"``)."""
        for o in self.ops:
            if o.op == name:
                return o
        close = difflib.get_close_matches(name, [o.op for o in self.ops], n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise KeyError(f"{name!r} is not an op of {self.model}'s graph.{hint}")

    @property
    def verdict(self) -> str:
        if self.compute_fallbacks:
            named = ", ".join(f"{o.op} ({'; '.join(o.why)}, {_fmt_t(o.fallback_cost)} per step)"
                              for o in self.compute_fallbacks)
            return f"{len(self.compute_fallbacks)} compute op(s) fall back: {named}"
        if self.fallbacks:
            return (f"every compute op has a rule and runs split; {len(self.fallbacks)} op(s) without real "
                    f"compute run replicated ({_fmt_t(self.fallback_cost)} per step)")
        return "every op has a rule and runs split; nothing falls back"

    def __str__(self) -> str:
        head = (f"autoshard coverage: {self.model}, {self.nodes} op nodes of {len(self.ops)} ops, mesh "
                f"{tuple(self.mesh_shape)} ({self.world} devices, {self.cluster.name}), "
                f"{'training' if self.training else 'inference'}")
        rows = [("op", "nodes", "rule", "compute", "time", "share", "split", "replicated")]
        for o in self.ops:
            share = f"{100 * o.time / self.total_time:.1f}%" if self.total_time else "-"
            rows.append((o.op, str(o.nodes), "yes" if o.has_rule else "no", "yes" if o.compute else "no",
                         _fmt_t(o.time), share, str(o.nodes - len(o.replicated)), str(len(o.replicated))))
        lines = [head, ""] + _table(rows, right=(1, 4, 5, 6, 7))
        lines.append("")
        lines.append(f"ops with rules: {len(self.with_rules)} ({sum(o.nodes for o in self.with_rules)} nodes); "
                     f"without: {len(self.without_rules)} ({sum(o.nodes for o in self.without_rules)} nodes)"
                     + (": " + ", ".join(o.op for o in self.without_rules) if self.without_rules else ""))
        if self.fallbacks:
            lines.append("")
            lines.append("runs replicated (seconds per step and rank: whole, split evenly over the world, "
                         "conversions it forces; cost = whole - split + conversions)")
            rows = [("op", "nodes", "why", "compute", "whole", "split", "conversions", "cost")]
            for o in self.fallbacks:
                rows.append((o.op, str(len(o.replicated)), "; ".join(o.why), "yes" if o.compute else "no",
                             _fmt_t(o.whole_time), _fmt_t(o.split_time),
                             f"{_fmt_t(o.conversion_time)} ({_fmt_bytes(o.conversion_bytes)})",
                             _fmt_t(o.fallback_cost)))
            lines += _table(rows, right=(1, 4, 5, 6, 7))
        lines += ["", f"verdict: {self.verdict}"]
        return "\n".join(lines)


def _fmt_t(t: float) -> str:
    return f"{t * 1e9:.1f}ns" if 0 < t < 1e-7 else _fmt_s(t)


def _table(rows, right=()) -> list:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


# ---- building ----------------------------------------------------------------------------------

def coverage(model: nn.Module, example_inputs, *, world: Optional[int] = None, mesh=None, cluster=None,
             training: bool = True) -> Coverage:
    """Which ops of ``model`` have sharding rules, which run replicated, and what that costs.

    Traces the model as ``plan`` does (torch.export on the meta device; an untraceable model
    raises ``CaptureError``) and prices every fallback for ``world`` devices (or a ``mesh``) of
    ``cluster``; without either, one node of the cluster (8 devices for the presets). Prints as
    a table; ``coverage(...).compute_fallbacks`` is empty when every op carrying real compute
    runs split."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cluster = resolve_cluster(cluster)
    if world is None and mesh is None:
        world = cluster.gpus_per_node
    mesh_shape = resolve_mesh(world, mesh)
    return coverage_of(capture(model, example_inputs), mesh_shape, cluster, training, type(model).__name__)


def coverage_of(graph: Graph, mesh_shape, cluster=None, training: bool = True, model: str = "model") -> Coverage:
    """The coverage of an already captured graph on ``mesh_shape``."""
    cluster = resolve_cluster(cluster)
    mesh_shape = tuple(mesh_shape)
    world = math.prod(mesh_shape)
    costs = Costs(graph, mesh_shape, cluster, training)
    by_op: dict = {}
    for node in graph.nodes:
        if node.kind == "op":
            by_op.setdefault(node.op_name, []).append(node)
    times = {n.name: costs.node(n, _whole(n, mesh_shape)).compute for ns in by_op.values() for n in ns}
    total = sum(times.values())
    ops = []
    for name, nodes in by_op.items():
        time = sum(times[n.name] for n in nodes)
        heavy = total > 0 and time * (world - 1) >= COMPUTE_SHARE * total and not _moves_no_data(nodes[0])
        replicated, why, conv_s, conv_b = [], [], 0.0, 0
        for n in nodes:
            reason = _why_replicated(n, graph, mesh_shape)
            if reason is None:
                continue
            replicated.append(n.name)
            if reason not in why:
                why.append(reason)
            s, b = _conversions(n, graph, costs)
            conv_s, conv_b = conv_s + s, conv_b + b
        whole = sum(times[n] for n in replicated)
        ops.append(OpCoverage(
            op=name, nodes=len(nodes), has_rule=rule_for(nodes[0].target) is not None,
            compute=is_compute_op(nodes[0].target) or heavy, time=time, replicated=tuple(replicated),
            why=tuple(why), whole_time=whole, split_time=whole / world, conversion_time=conv_s,
            conversion_bytes=conv_b))
    ops.sort(key=lambda o: (-o.time, o.op))
    return Coverage(model, mesh_shape, cluster, training, tuple(ops), total)


def _moves_no_data(node: Node) -> bool:
    """A view (its result aliases its input without writing it: view, transpose, split, ...) or an
    op with no tensor output (a metadata assert): no work on a device, though ``op_time`` charges
    them the bytes of their tensors. In-place ops alias and write, and do carry work."""
    if not node.outputs:
        return True
    schema = getattr(node.target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def _whole(node: Node, mesh_shape) -> Strategy:
    b = (pl.B,) * len(mesh_shape)
    return Strategy(tuple(b for _ in node.inputs), tuple(b for _ in node.outputs))


def _why_replicated(node: Node, graph: Graph, mesh_shape) -> Optional[str]:
    """Why the node runs replicated on the mesh, or None when it can run split."""
    if all(not graph.meta(v).shape for v in node.inputs) and all(not m.shape for m in node.outputs):
        return None   # no tensor, or only scalars (a step counter): nothing any layout splits
    sigs, known = one_axis_sigs(node, graph)
    if not known:
        return NO_RULE
    if len(sigs) == 1:
        return NO_SPLIT
    whole = _whole(node, mesh_shape)
    strategies = expand(sigs, [graph.meta(v) for v in node.inputs], node.outputs, mesh_shape,
                        allows_uneven(node.target))
    return UNEVEN if all(s == whole for s in strategies) else None


def _even_split(meta, mesh_shape) -> Optional[tuple]:
    """An nd placement that splits the tensor on as many axes as it can, or None when it cannot be
    split at all (or there is one device)."""
    if math.prod(mesh_shape) == 1:
        return None
    options = [s.outputs[0] for s in storage_options(meta, mesh_shape)]
    best = min(options, key=lambda p: sum(isinstance(q, pl.Broadcast) for q in p))
    return None if all(isinstance(q, pl.Broadcast) for q in best) else best


def _conversions(node: Node, graph: Graph, costs: Costs) -> tuple:
    """(seconds, collective bytes) of gathering the node's inputs (but graph inputs) from an even
    split and splitting its outputs again, forward and, where a gradient flows, backward."""
    mesh = costs.mesh_shape
    whole = (pl.B,) * len(mesh)
    moves = [(v, _even_split(graph.meta(v), mesh), whole) for v in node.inputs
             if graph.by_name[v[0]].kind != "input"]
    moves += [((node.name, i), whole, _even_split(m, mesh)) for i, m in enumerate(node.outputs)]
    seconds, nbytes = 0.0, 0
    for value, src, dst in moves:
        if src is None or dst is None:
            continue
        seconds += costs.convert(value, src, dst, node).communication
        meta = graph.meta(value)
        steps, _ = costs.conversion(value, src, dst)
        # a gradient flows back through the conversion exactly when Costs.convert charges its dual
        if costs.training and meta.floating and graph.by_name[value[0]].requires_grad:
            steps = steps + dual_steps(steps, mesh)
        nbytes += sum(comm.step_bytes(st, meta.itemsize) for st in steps if st.is_collective)
    return seconds, nbytes
