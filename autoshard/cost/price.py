"""The price of every choice the solver makes: ``Costs`` turns a node's strategy and an edge's
pair of layouts into a ``cost.step.Cost`` (compute by phase, blocking communication, and the
collectives the schedule overlaps) and into bytes per rank, from the compute, communication and
memory models beside it. ``planner.tables`` reads them into the solver's integer program; ``plan``,
``explain``, ``formula`` and ``coverage`` read the same prices, so a plan's reported figures are
the ones it was chosen by."""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Optional

import torch

from autoshard import placement as pl
from autoshard.machine.cluster import Cluster
from autoshard.cost import attention, comm, compute, memory
from autoshard.cost.overlap import conversion_price, edge_kind, unhidden
from autoshard.cost.buckets import backward_left, bucket_bytes_for, covered, first_uses, grad_buckets
from autoshard.cost.step import PARTS, Cost
from autoshard.inputs import WHOLE, arrival
from autoshard.outputs import dual_at, kept_split
from autoshard.rules import flex
from autoshard.rules.moe import computed_shapes, is_grouped_mm
from autoshard.precision import CAST, grad_itemsize

if TYPE_CHECKING:
    from autoshard.ir import Graph, Node

CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default


class Costs:
    """Every cost the program needs, from the cost models, cached by layout. Each is a
    ``cost.step.Cost``: compute by phase, blocking communication, and the parameter collectives
    the schedule overlaps with compute.

    ``recompute``: the recompute mode its programs are priced in (``planner.recompute``'s
    modes), the one thing of its own; no price depends on it, so ``with_recompute`` gives a
    ``Costs`` of another mode that shares every price worked out (this module's caches and
    ``cost.overlap``'s, all in the instance's ``__dict__``)."""
    __slots__ = ("recompute", "__dict__", "__weakref__")

    def __init__(self, graph: Graph, mesh_shape, cluster: Cluster, training: bool,
                 bucket_bytes: Optional[int] = None, reshard: bool = False, recompute: str = "none",
                 inputs: str = WHOLE):
        self.recompute = recompute
        self.family = Family()   # one for these prices and every mode of them (``with_recompute``)
        self.graph, self.mesh_shape, self.cluster, self.training = graph, tuple(mesh_shape), cluster, training
        self.bucket_bytes = bucket_bytes if bucket_bytes is not None else bucket_bytes_for(cluster, self.mesh_shape)
        self.reshard = reshard   # a parameter converted for an op is converted again for its backward
        self.links = cluster.axis_links(self.mesh_shape)
        self.split_outputs = kept_split(graph, graph.outputs)   # user outputs handed back as planned
        self.inputs = inputs   # how the user inputs arrive (autoshard.inputs)
        self.arrival = arrival(graph, self.mesh_shape, inputs)   # input -> the layout its rows arrive in
        self._conv: dict = {}
        # FlexAttention's blocks its mask keeps, where the kernel skips the others
        self._kept_blocks = {n.name: flex.density(n.fx_node) for n in graph.nodes
                             if cluster.block_sparse and n.kind == "op" and n.target is flex.FLEX}
        self._node_costs: dict = {}   # (node's twin, id(strategy)) -> (strategy, Cost): ``node``
        self._twins: dict = {}        # node name -> the number of its ``_twin``
        self._twin_ids: dict = {}     # ``_twin`` -> its number
        self._conversions: dict = {}  # (tensor, src, dst) -> ``conversion``
        self._tensors: dict = {}      # value -> ``_tensor``
        self._edges: dict = {}        # (value, consumer) -> ``_edge``
        self._step_times: dict = {}   # (tensor, src, dst, backward) -> ``step_times``
        self._price_keys: dict = {}   # (value, consumer, slot) -> ``price_key``
        self._price_ids: dict = {}    # ``price_key``'s key -> its number
        self._rerun_prices: dict = {}  # ``_by_layouts``' cache of ``rerun``
        self._pairs_by_id: dict = {}  # ``_by_layouts``' cache of ``pair``
        self._pair_prices: dict = {}  # (edge price key, src, dst) -> ``pair``
        # the optimizer step's fixed part, shared by the parameters it updates
        self._updated = sum(1 for n in graph.nodes if n.kind == "param" and n.requires_grad) if training else 0
        self._copies = param_copies(graph)   # a parameter's low-precision copy, which its bucket gathers
        buckets = gather_buckets(graph, self.bucket_bytes, self._copies)   # as the schedule forms them
        self._gather_shares = gather_shares(buckets, self._copies)
        self._gather_scales = gather_scales(buckets, self._copies)
        # on a measured machine, what of each bucket's backward collective compute can run beside
        self._grad_cover, self._dual_cover = self._backward_cover(buckets) if cluster.measured and training else ({}, {})

    def with_recompute(self, mode: str) -> Costs:
        """These prices in recompute mode ``mode``: this ``Costs`` where it is in that mode
        already, else a new one sharing every cache with it, those made later too (the same
        ``__dict__``; the mode is a slot of its own)."""
        if mode == self.recompute:
            return self
        other = object.__new__(Costs)
        other.__dict__ = self.__dict__
        other.recompute = mode
        return other

    def _backward_cover(self, gathers: list) -> tuple:
        """({parameter: the part of its gradient bucket's all-reduce that backward compute can run
        beside}, {parameter or copy: that of its gather bucket's reduce-scatter}), both buckets
        formed as the schedule forms them (``cost.buckets.covered``)."""
        mesh = self.mesh_shape
        axes = tuple(a for a, n in enumerate(mesh) if n > 1)
        if not axes:
            return {}, {}
        first = first_uses(self.graph)
        left = backward_left(self.graph, self.cluster, math.prod(mesh), self.training)
        grads = covered(grad_buckets(self.graph, self.bucket_bytes), first, left,
                        lambda b: comm.group_all_reduce_time(b["bytes"], axes, mesh, self.cluster))
        group = axes if len(axes) > 1 else axes[0]
        duals = covered(gathers, first, left, lambda b: comm.step_time(
            comm.Step("reduce_scatter", group, 0, in_shape=(b["bytes"],)), 1, mesh, self.links))
        duals.update({param: duals[copy] for copy, param in self._copies.items() if copy in duals})
        return grads, duals

    def gather_share(self, value) -> float:
        """The part of its gather bucket's launch and latency a prefetched parameter pays."""
        return self._gather_shares.get(value[0], 1.0)

    def grad_syncs(self, node: Node, strat) -> list:
        """(axes, bytes, seconds) of the gradient all-reduce of a parameter stored broadcast, over
        every axis it is broadcast on at once (the schedule pass's bucket groups): bucketed, so
        its launch and latency are shared with the bucket in proportion to size, and its bytes
        move at a full bucket's rate (on a measured cluster, the rate read off the timed points at
        the bucket's size: a small tensor's own size would charge it the small sizes' latency)."""
        mesh = self.mesh_shape
        if node.kind != "param" or not (self.training and node.requires_grad):
            return []
        axes = tuple(a for a, p in enumerate(strat.outputs[0]) if isinstance(p, pl.Broadcast) and mesh[a] > 1)
        if not axes:
            return []
        meta = node.outputs[0]
        nbytes = math.prod(pl.local_shape(meta.shape, strat.outputs[0], mesh)) * grad_itemsize(self.graph, meta)
        share = min(1.0, nbytes / self.bucket_bytes)
        scale = 1.0 / share if nbytes else 1.0
        return [(axes, nbytes, comm.group_all_reduce_time(nbytes, axes, mesh, self.cluster, share, scale))]

    def scheduled(self, fwd: float, bwd: float, cover: float = 1.0) -> Cost:
        """Collectives the schedule overlaps with forward and backward compute (``fwd``, ``bwd``
        seconds): the part compute beside them can hide (``Cluster.overlap``: all on the presets,
        none on a CPU whose cores the compute already takes) and the rest, which it waits for.
        ``cover``: the part of the backward one that has compute beside it at all (a bucket's,
        ``_backward_cover``)."""
        hide = self.cluster.overlap
        return Cost(comm=(1 - hide) * fwd + (1 - hide * cover) * bwd, hidden_fwd=hide * fwd,
                    hidden_bwd=hide * cover * bwd)

    def optimizer(self, node: Node, strat) -> float:
        """Seconds of the optimizer's step over this parameter's share (``Cluster.optimizer``:
        a part of the step's fixed cost, its tensor's, its bytes')."""
        if not (self.cluster.optimizer and self.training and node.requires_grad):
            return 0.0
        fixed, per_tensor, per_byte = self.cluster.optimizer
        meta = node.outputs[0]
        nbytes = math.prod(pl.local_shape(meta.shape, strat.outputs[0], self.mesh_shape)) * meta.itemsize
        return fixed / self._updated + per_tensor + per_byte * nbytes

    def node(self, node: Node, strat) -> Cost:
        """The node's cost in this strategy, once per node and strategy: a plan's cost, its
        descent's steps and the overlap model ask for the same ones again and again."""
        twin = self._twins.get(node.name)
        if twin is None:   # a number stands for it: the key is deep, and hashed at every look-up
            twin = self._twins[node.name] = self._twin_ids.setdefault(self._twin(node), len(self._twin_ids))
        key = (twin, id(strat))
        hit = self._node_costs.get(key)
        if hit is None or hit[0] is not strat:
            hit = self._node_costs[key] = (strat, self._price_node(node, strat))
        return hit[1]

    def _twin(self, node: Node):
        """What a node's cost depends on, the same for the nodes it equals (a stack's layers
        have the same ones): an op's target, arguments (fx nodes by the order they appear in),
        tensors, whether it takes gradients and whether the user checkpoints it; a parameter's
        tensor, whether it trains, and its bucket's backward cover. By name where the cost
        reads the graph around the op: a cross-entropy's targets (``rules.nn.whole_targets``),
        an expert matmul's measured loads (``rules.moe``)."""
        if node.kind == "op" and node.target is not CROSS_ENTROPY and not is_grouped_mm(node.target):
            return ("op",) + self.graph.op_key(node) + (node.requires_grad, node.region is not None)
        if node.kind == "param":
            return ("param", tuple(node.outputs), node.requires_grad, self._grad_cover.get(node.name, 1.0))
        return ("name", node.name)

    def _price_node(self, node: Node, strat) -> Cost:
        mesh, cluster = self.mesh_shape, self.cluster
        if node.kind == "param":
            syncs = self.grad_syncs(node, strat)
            cost = self.scheduled(0.0, sum(t for _, _, t in syncs), self._grad_cover.get(node.name, 1.0))
            if cluster.measured:
                # its share fed to the program, its gradient handed back, and, where it is
                # all-reduced, copied into its bucket and out of it once reduced (runtime's
                # _GradBucket and _GradWait), each copy reading and writing its bytes
                grad = self.training and node.requires_grad
                copy = sum(4 * nbytes for _, nbytes, _ in syncs) / cluster.memory_bandwidth
                cost = cost + Cost(compute_fwd=cluster.op_overhead, compute_bwd=cluster.backward_overhead * grad + copy,
                                   optimizer=self.optimizer(node, strat))
            return cost
        if node.kind == "input":
            return self.arriving(node, strat)
        if node.kind != "op":
            return Cost()
        metas, ins, outs, itemsize = self._local(node, strat)
        ins, outs = computed_shapes(node, strat, self.graph, mesh, ins, outs)   # an expert matmul's rows
        kept = self._kept_blocks.get(node.name, 1.0)
        ring = attention.ring_axes(node, strat, mesh, metas[1].shape) if len(metas) > 1 else ()
        computed = attention.whole_keys(ins, ring, mesh) if ring else ins   # every block of keys, in turn
        t = compute.op_time(node.target, computed, outs, itemsize, cluster, kept)
        bwd = 0.0
        if self.training and node.requires_grad:
            bwd = compute.backward_time(node.target, computed, outs, itemsize, cluster, kept)
        blocking = sum(comm.op_collective_time(c, mesh, self.links)
                       for c in comm.op_collectives(node, strat, self.graph, mesh, self.arrival))
        share, sends = self._attention(node, strat, ins, itemsize, t, bwd, ring)
        t, bwd = t * share, bwd * share   # causal work balanced: the slowest rank's share
        blocking += sum(s[3] for s in sends)   # its swaps, the ring's sends that compute leaves exposed
        again = self.training and node.region is not None   # a user checkpoint region: its forward run again in backward
        return Cost(compute_fwd=t, compute_bwd=bwd + again * t, comm=(1 + again) * blocking)

    def _attention(self, node: Node, strat, ins, itemsize: int, fwd: float, bwd: float, ring) -> tuple:
        """(the slowest rank's share of the work, (phase, axis, bytes, seconds) of each send) of an
        attention node in ``strat`` (``fwd``, ``bwd``: its compute unbalanced): its causal work
        balanced where that is legal and pays, its keys and values round the ring where ``ring``
        names axes; (1.0, []) for any other op."""
        share, sends = 1.0, []
        balanced = self.balanced_attention(node, strat, ins, itemsize, fwd, bwd, ring)
        if balanced is not None:
            share, sends = balanced[0], list(balanced[1])
        if ring:
            sends += attention.ring_sends(ins, itemsize, ring, self.mesh_shape, self.links, fwd * share, bwd * share,
                                          self.training and node.requires_grad)
        return share, sends

    def balanced_attention(self, node: Node, strat, ins, itemsize: int, fwd: float, bwd: float, ring) -> Optional[tuple]:
        """(the slowest rank's share of the work, the swaps as ``attention.swap_sends``) where causal
        attention's work is balanced in ``strat`` (legal, and it pays: ``cost.attention``); None
        elsewhere."""
        axis = attention.node_balance(self.graph, node, strat, self.mesh_shape)
        if axis is None:
            return None
        share = attention.balanced_share(self.mesh_shape[axis], bool(ring))
        train = self.training and node.requires_grad
        swaps = attention.swap_sends(ins, itemsize, axis, self.links[axis], train)
        exposed = None
        if ring:   # the ring's sends, hidden behind the blocks' compute at ``s`` of it
            exposed = lambda s: sum(x[3] for x in attention.ring_sends(ins, itemsize, ring, self.mesh_shape, self.links,
                                                                       fwd * s, bwd * s, train))
        again = self.training and node.region is not None
        pays = attention.balance_pays(fwd, bwd, share, sum(s[3] for s in swaps), exposed, again)
        return (share, swaps) if pays else None

    def balances(self, node: Node, strat) -> bool:
        """Whether the plan balances this attention node's causal work in ``strat``."""
        if attention.node_balance(self.graph, node, strat, self.mesh_shape) is None:
            return False
        return self.balanced_attention(node, strat, *self._attention_parts(node, strat)) is not None

    def attention_sends(self, node: Node, strat) -> list:
        """(phase, axis, bytes, seconds) of each point-to-point send an attention node makes in
        ``strat`` (``_attention``), as its price counts them; [] for any other op."""
        if node.kind != "op" or node.target is not attention.SDPA or not strat.inputs:
            return []
        return self._attention(node, strat, *self._attention_parts(node, strat))[1]

    def _local(self, node: Node, strat) -> tuple:
        """(its inputs' metas, their local shapes and the outputs' in ``strat``, the itemsize it
        computes in) of an op node."""
        metas = [self.graph.meta(v) for v in node.inputs]
        ins = [pl.local_shape(m.shape, p, self.mesh_shape) for m, p in zip(metas, strat.inputs)]
        outs = [pl.local_shape(m.shape, p, self.mesh_shape) for m, p in zip(node.outputs, strat.outputs)]
        return metas, ins, outs, max([m.itemsize for m in metas + node.outputs if m.floating] or [4])

    def _attention_parts(self, node: Node, strat) -> tuple:
        """(local input shapes, itemsize, forward and backward compute unbalanced, ring axes) of an
        attention node, as ``_price_node`` works them out."""
        mesh, cluster = self.mesh_shape, self.cluster
        metas, ins, outs, itemsize = self._local(node, strat)
        ring = attention.ring_axes(node, strat, mesh, metas[1].shape)
        computed = attention.whole_keys(ins, ring, mesh) if ring else ins
        t = compute.op_time(node.target, computed, outs, itemsize, cluster)
        bwd = compute.backward_time(node.target, computed, outs, itemsize, cluster) \
            if self.training and node.requires_grad else 0.0
        return ins, itemsize, t, bwd, ring

    def arrival_times(self, node: Node, strat) -> tuple:
        """(steps, their duals, the seconds of each, as ``step_times``) of converting a user input
        from the layout its rows arrive in (``inputs="local"``, or a pipeline stage's crossing
        layout: ``autoshard.inputs``) to the one ``strat`` gives it; no steps where it arrives
        whole (sliced locally) or as it is wanted.
        Run before any compute, at the program's start: nothing hides them."""
        src = self.arrival.get(node.name)
        if src is None:
            return [], [], [], []
        # what a pipeline stage takes from the stage before hands its gradient back there
        received = node.name in self.graph.user_inputs[:self.graph.received]
        backward = self.training and node.outputs[0].floating and (node.requires_grad or received)
        steps, duals, fwd, bwd, _ = self.step_times((node.name, 0), src, strat.outputs[0], backward)
        return steps, duals, fwd, bwd

    def arriving(self, node: Node, strat) -> Cost:
        _, _, fwd, bwd = self.arrival_times(node, strat)
        return Cost(comm=sum(fwd) + sum(bwd))

    def memory(self, node: Node, strat) -> int:
        """Bytes per rank this choice keeps (cost.memory)."""
        return sum(memory.node_bytes(node, strat, self.mesh_shape, self.training).values())

    def regathered(self, value) -> bool:
        """Whether converting ``value`` for an op is done again for the op's backward, not kept."""
        return self.reshard and self.training and self.graph.by_name[value[0]].kind == "param"

    def kept(self, value, src, dst, consumer: Node) -> int:
        """Bytes per rank the conversion's result keeps while ``consumer`` waits for backward."""
        return memory.conversion_bytes(consumer, self.graph.meta(value), src, dst, self.mesh_shape, self.training,
                                       self._edge(value, consumer)[4])

    def _edge(self, value, consumer: Node) -> tuple:
        """What converting ``value`` for ``consumer`` depends on besides the two layouts, once
        per edge (a mesh's pricing asks for it per pair of layouts, by the ten thousand):
        whether the consumer takes it as it is (``handed_over``), whether backward runs the
        dual, whether it is made again in backward (a checkpoint region), the tensor
        (``_tensor``), and whether its result is kept for backward or made again."""
        key = (value, consumer.name)
        hit = self._edges.get(key)
        if hit is None:
            graph = self.graph
            region = memory.in_region(graph, value, consumer)
            hit = self._edges[key] = (
                consumer.kind == "output" and value in self.split_outputs,
                self.training and graph.meta(value).floating and dual_at(graph, consumer)
                and graph.by_name[value[0]].requires_grad,
                self.training and region, self._tensor(value), self.regathered(value) or region)
        return hit

    def overlapped(self, value, src) -> bool:
        """Whether the first gather of this value is prefetched in a gather bucket: a parameter's,
        or its low-precision copy's (``passes.schedule`` buckets the gathers a parameter
        placeholder feeds directly, through its gradient's all-reduce over the axes it is stored
        broadcast on (hybrid sharding: the bucket runs that all-reduce after its reduce-scatter),
        or through the cast it feeds alone)."""
        producer = self.graph.by_name[value[0]]
        if producer.name in self._copies:
            producer = self.graph.by_name[self._copies[producer.name]]
        return producer.kind == "param"

    def handed_over(self, value, src, dst, consumer: Optional[Node]):
        """The layout ``consumer`` takes ``value`` in: ``dst``, but a user output kept in its
        planned layout (``outputs="dtensor"``) is handed back as it is, converted for nothing."""
        kept = consumer is not None and consumer.kind == "output" and value in self.split_outputs
        return src if kept else dst

    def price_key(self, value, consumer: Node, slot: int) -> int:
        """What converting ``value`` for ``consumer``'s input ``slot`` costs and keeps depends on
        besides its two layouts: the tensor (a parameter's, or its copy's, by name: its
        bucket), whether backward runs its dual, converts it again or keeps it, whether the
        consumer is an output handed back as planned, and the edge's kind for the overlap
        (``cost.overlap.edge_kind``), as a number. Edges of equal keys price every pair of
        layouts alike."""
        hit = self._price_keys.get((value, consumer.name, slot))
        if hit is not None:
            return hit
        handed, backward, _, tensor, _ = self._edge(value, consumer)
        key = (tensor, backward, consumer.kind, consumer.requires_grad, self.regathered(value),
               memory.in_region(self.graph, value, consumer), handed, edge_kind(self, value, consumer, slot))
        # a small number stands for it: pairs are looked up by the thousand, and the key is deep
        number = self._price_keys[value, consumer.name, slot] = self._price_ids.setdefault(key, len(self._price_ids))
        return number

    def pair(self, value, consumer: Node, slot: int, src, dst, price: Optional[int] = None) -> tuple:
        """(price, its cost vector (``cost.step.PARTS``), bytes kept) of converting ``value``
        from ``src`` to ``dst`` for ``consumer``'s input ``slot``: ``cost.overlap.conversion_price``
        and ``kept``, once per ``price_key`` and pair of layouts. The solver's tables, the coarse
        bound and a plan's cost read the same ones. ``price``: the edge's ``price_key``, where
        the caller prices many pairs of one edge."""
        if price is None:
            price = self.price_key(value, consumer, slot)
        return _by_layouts(self._pairs_by_id, price, src, dst, self._pair, value, consumer, slot)

    def _pair(self, price: int, src, dst, value, consumer: Node, slot: int) -> tuple:
        """``pair`` by the layouts' values: equal layouts in other tuples price alike."""
        key = (price, src, dst)
        hit = self._pair_prices.get(key)
        if hit is None:
            cost = conversion_price(self, value, src, dst, consumer, slot)
            hit = self._pair_prices[key] = (cost, _parts(cost), self.kept(value, src, dst, consumer))
        return hit

    def forward_again(self, value, src, dst) -> float:
        """Seconds of a conversion's forward steps alone: what recomputing it costs again."""
        key = ("recompute", self.graph.meta(value), src, dst)
        hit = self._conv.get(key)
        if hit is None:
            meta = self.graph.meta(value)
            steps, _ = self.conversion(value, src, dst)
            hit = self._conv[key] = sum(comm.step_time(st, meta.itemsize, self.mesh_shape, self.links) for st in steps)
        return hit

    def rerun(self, value, consumer: Node, slot: int, src, dst, price: Optional[int] = None) -> float:
        """Seconds a conversion into an op of a recomputed block costs again (planner.recompute):
        its forward steps once more, and what the schedule hid of it, which a recomputed block
        does not hide (``cost.overlap.unhidden``); once per ``price_key`` and pair of layouts,
        looked up by the layouts' identities first, as ``pair``."""
        if price is None:
            price = self.price_key(value, consumer, slot)
        return _by_layouts(self._rerun_prices, price, src, dst,
                           lambda _, a, b: self.forward_again(value, a, b) + unhidden(self, value, a, b, consumer, slot))

    def conversion(self, value, src, dst, consumer: Optional[Node] = None):
        """The steps from ``src`` to ``dst``, and whether the schedule prefetches the first."""
        dst = self.handed_over(value, src, dst, consumer)
        key = (self._tensor(value), src, dst)
        hit = self._conversions.get(key)
        if hit is None:
            meta = self.graph.meta(value)
            steps = comm.transition(pl.local_shape(meta.shape, src, self.mesh_shape), src, dst, self.mesh_shape,
                                    self.links, meta.itemsize, whole=meta.shape)
            hit = self._conversions[key] = (steps, bool(steps) and steps[0].kind == "all_gather"
                                            and self.overlapped(value, src))
        return hit

    def _tensor(self, value):
        """What a conversion's steps and their seconds depend on of the tensor: its shape and
        dtype, and a parameter's (or its copy's) gather bucket, which prices its gathers and
        their duals (its part of the bucket's launch, the bucket's bytes over its own, the part
        of the dual's time backward compute covers). The equal parameters of a stack's layers
        in equal buckets price alike (a refinement's plan of the 96-layer GPT: 1,128
        parameter conversions priced by name, none left to price by this)."""
        hit = self._tensors.get(value)
        if hit is None:
            graph, name = self.graph, value[0]
            meta = graph.meta(value)
            hit = self._tensors[value] = meta if not (graph.by_name[name].kind == "param" or name in self._copies) \
                else ("param", meta, name in self._copies, self._gather_shares.get(name, 1.0),
                      self._gather_scales.get(name, 1.0), self._dual_cover.get(name, 1.0))
        return hit

    def step_times(self, value, src, dst, backward: bool) -> tuple:
        """The conversion's steps and their duals (when ``backward``), the seconds of each, and
        whether the first is prefetched: then it and its dual, the last, travel in a bucket of
        parameters, and pay their part of its launch and latency."""
        key = (self._tensor(value), src, dst, backward)
        hit = self._step_times.get(key)
        if hit is None:
            hit = self._step_times[key] = self._times(value, src, dst, backward)
        return hit

    def _times(self, value, src, dst, backward: bool) -> tuple:
        meta, mesh, links = self.graph.meta(value), self.mesh_shape, self.links
        steps, prefetched = self.conversion(value, src, dst)
        duals = comm.dual_steps(steps, mesh) if backward else []
        share = self.gather_share(value) if prefetched else 1.0
        # the bucket's bytes over the parameter's: a measured collective is priced at the bucket's size
        scale = self._gather_scales.get(value[0], 1.0) if prefetched else 1.0
        last = self.reduced_itemsize(value, prefetched, steps)
        fwd = [comm.step_time(st, meta.itemsize, mesh, links, share, scale) if i == 0
               else comm.step_time(st, meta.itemsize, mesh, links) for i, st in enumerate(steps)]
        bwd = [comm.step_time(st, last, mesh, links, share, scale) if i == len(duals) - 1
               else comm.step_time(st, meta.itemsize, mesh, links) for i, st in enumerate(duals)]
        return steps, duals, fwd, bwd, prefetched

    def reduced_itemsize(self, value, prefetched: bool, steps=()) -> int:
        """Bytes per element of a conversion's last backward step (``steps``: the conversion's):
        the dual reduce-scatter of a prefetched gather (``runtime.bucket_start``), or of any
        gather of a parameter's policy copy (``runtime.step_start``'s dtype, ``cast_all_gather``),
        runs in the policy's reduce dtype, other steps in the value's dtype."""
        meta = self.graph.meta(value)
        copy_gathered = value[0] in self._copies and bool(steps) and steps[0].kind == "all_gather"
        return grad_itemsize(self.graph, meta) if prefetched or copy_gathered else meta.itemsize

    def convert(self, value, src, dst, consumer: Node) -> Cost:
        handed, backward, rerun, tensor, _ = self._edge(value, consumer)   # rerun: made again in backward
        dst = src if handed else dst   # ``handed_over``
        # a parameter's (or its copy's) with its bucket's parts (``_tensor``)
        key = (tensor, src, dst, backward, rerun)
        hit = self._conv.get(key)
        if hit is None:
            _, _, fwd, bwd, prefetched = self.step_times(value, src, dst, backward)
            # converted again when backward needs it, where it waits
            again = sum(fwd) if backward and self.regathered(value) or rerun else 0.0
            if prefetched:
                # the first gather is prefetched; its dual, the last backward step, waits late
                hb = bwd[-1] if bwd else 0.0
                hit = (Cost(comm=sum(fwd[1:]) + sum(bwd) - hb + again)
                       + self.scheduled(fwd[0], hb, self._dual_cover.get(value[0], 1.0)))
            else:
                hit = Cost(comm=sum(fwd) + sum(bwd) + again)
            self._conv[key] = hit
        return hit


class Family:
    """What the ``Costs`` of one set of prices and their other recompute modes
    (``Costs.with_recompute``) have in common, as an object: whoever keeps data of its own per
    set of prices keys it by this, weakly (planner.tables)."""
    __slots__ = ("__weakref__",)


_parts = operator.attrgetter(*PARTS)   # a cost's parts as a tuple, in ``PARTS``' order


def _by_layouts(cache: dict, price: int, src, dst, make, *args):
    """``make(price, src, dst, *args)`` once per edge price key and pair of layouts in ``cache``,
    looked up by the layouts' identities: the strategies hand the same tuples over and over, and
    hashing a layout hashes each of its placements in Python. The entry holds the layouts, so
    their ids stay theirs."""
    hit = cache.get((price, id(src), id(dst)))
    if hit is None or hit[0] is not src or hit[1] is not dst:
        hit = cache[price, id(src), id(dst)] = (src, dst, make(price, src, dst, *args))
    return hit[2]


def gather_shares(buckets: list, copies: dict) -> dict:
    """Each parameter's part of the launch and latency of the gather bucket it travels in when
    its neighbours are gathered too (``buckets``: ``gather_buckets``, as ``passes.schedule``
    forms them, one collective per bucket). Half is shared by count and half by
    bytes: a whole bucket pays one launch and latency, and a few small tensors of it, gathered
    alone, still pay their count's part rather than almost nothing. A parameter with a
    low-precision copy (``copies``: ``param_copies``) travels as the copy, in its bytes and at
    its use; the parameter's name gets the same part."""
    return _per_member(buckets, copies, lambda b, size: 0.5 / len(b["members"]) + 0.5 * size / max(b["bytes"], 1))


def gather_scales(buckets: list, copies: dict) -> dict:
    """Each parameter's gather bucket's bytes over its own (``buckets``: ``gather_buckets``): a
    measured collective slower per byte as it grows (``cost.comm.fitted_time``) is priced at the
    size it runs at, the bucket's, each member paying its bytes' part."""
    return _per_member(buckets, copies, lambda b, size: b["bytes"] / max(size, 1))


def _per_member(buckets: list, copies: dict, part) -> dict:
    """{name: part(its bucket, its bytes)} of every member of the gather ``buckets``
    (``gather_buckets``), and of each parameter whose copy (``copies``) is one."""
    out = {name: part(b, size) for b in buckets for name, size in b["members"]}
    out.update({param: out[copy] for copy, param in copies.items() if copy in out})
    return out


def gather_buckets(graph: Graph, cap: int, copies: Optional[dict] = None) -> list:
    """The gather buckets the schedule forms (parameters in use order, one dtype, up to ``cap``
    gathered bytes): [{"dtype", "members": [(name,
    bytes), ...], "bytes"}, ...]."""
    copies = copies or {}
    first: dict = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            first.setdefault(v[0], i)
    copied = set(copies.values())
    params = sorted((n for n in graph.nodes if n.name in first and (n.name in copies or
                                                                     n.kind == "param" and n.name not in copied)),
                    key=lambda n: first[n.name])
    buckets: list = []
    for n in params:
        meta = n.outputs[0]
        size = meta.numel * meta.itemsize
        b = buckets[-1] if buckets else None
        if b is None or b["dtype"] != meta.dtype or b["bytes"] + size > cap:
            b = {"dtype": meta.dtype, "members": [], "bytes": 0}
            buckets.append(b)
        b["members"].append((n.name, size))
        b["bytes"] += size
    return buckets


def param_copies(graph: Graph) -> dict:
    """{cast node: parameter} for each parameter whose only reader is one cast to another
    floating dtype (a mixed-precision policy's ``param_dtype`` copy, or autocast's): the
    schedule gathers the copy in the parameter's bucket, the cast done there."""
    readers: dict = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v[0], []).append(n)
    return {r[0].name: p.name for p in graph.nodes if p.kind == "param"
            for r in [readers.get(p.name, [])]
            if len(r) == 1 and r[0].kind == "op" and r[0].target is CAST and len(r[0].inputs) == 1
            and r[0].outputs and r[0].outputs[0].floating}
