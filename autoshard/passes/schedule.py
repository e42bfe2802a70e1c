"""Schedule: the per-rank program with its parameter collectives split into start/wait pairs and
moved, so that communication overlaps compute.

    gradient all-reduce   parameters stored broadcast are grouped into buckets of about
                          ``bucket_bytes`` (neighbours in backward order, one dtype, one set of
                          axes). A bucket's one all-reduce starts when all its gradients are
                          complete and is waited on after the backward compute that is ready.
    parameter gather      parameters stored split and all-gathered before use (or their casts
                          to a policy's param_dtype, gathered in its bytes and reduce-scattered in
                          its reduce_dtype) are grouped into
                          buckets of about ``bucket_bytes`` gathered (neighbours in use order, one
                          group, one dtype), each one all-gather, as FSDP gathers a module's
                          parameters at once. It starts early, with at most ``prefetch_bytes`` of
                          gathers in flight, and is waited on at the first use. The dual
                          reduce-scatter, also one per bucket, starts as soon as the bucket's
                          gradients are complete and is waited on late. With
                          reshard_after_forward, backward gathers a bucket again, once, when the
                          first of its parameters is needed. A parameter also stored broadcast
                          on other axes (hybrid sharding) travels in these buckets too: its
                          bucket then all-reduces the reduce-scattered gradients over those
                          axes, started when the next bucket's gradients are complete.

    activation step       every other collective between ops (the rewriter's conversions of
                          activations, and of parameters no bucket took) starts right after its
                          input is made and is waited on right before its first use; a gather
                          only linears take computes this rank's own rows while it flies, and the
                          conversions the plan chose to chunk run chunk by chunk
                          (``passes.overdecompose``).

The cost model prices this schedule: bucketed all-reduces share one launch and latency per
bucket, and parameter collectives hide behind the compute of their phase (``cost.price``,
``planner.solve``), and what the activation steps hide too (``cost.overlap``).
A policy copy no bucket took (one whose master's gradient all-reduce or placeholder feeds more
than this gather) is gathered by an activation step that casts (``step_start``'s ``dtype``), and
without the schedule by ``runtime.cast_all_gather`` (``fuse_cast_gathers``, run on every
program): either way its gradient is reduce-scattered in ``reduce_dtype``. The casts of
parameters kept whole, side by side at the program's start, become one ``runtime.cast_many``
per run (``batch_casts``, run on every program too).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard import runtime
from autoshard.cost.buckets import BUCKET_BYTES
from autoshard.passes.interleave import interleave as interleave_batch
from autoshard.passes.overdecompose import overdecompose
from autoshard.precision import CAST

PREFETCH_BYTES = 64 * 2**20   # gathered parameters held ahead of their use


def schedule(program: fx.GraphModule, bucket_bytes: int = BUCKET_BYTES,
             prefetch_bytes: int = PREFETCH_BYTES, chunks=(), interleave: int = 1,
             weights_later: bool = True) -> fx.GraphModule:
    """A new program with the parameter collectives of ``program`` scheduled; ``program`` is not
    changed. Its ``meta["joint_axes"]`` lists the axis sets whose groups the runtime must create
    (the rewriter's, and the gradient buckets'). ``chunks``: the conversions to overdecompose, as
    the plan chose them (``plan.schedule["chunks"]``, ``passes.overdecompose``); the program's
    ``meta["chunked"]`` lists those it chunked. ``interleave``: how many chunks of the batch the
    ops that act on each sample alone run in, one after the other segment by segment
    (``plan.schedule["interleave"]``, ``passes.interleave``); the program's
    ``meta["interleaved"]`` says how many ops it cut. ``weights_later=False`` leaves every linear's
    weight gradient in its own backward (no ``linear_dw_later``: see ``_weight_grads_later``)."""
    g = fx.Graph()
    g.output(g.graph_copy(program.graph, {}))
    g, cut = interleave_batch(g, interleave, program.meta["mesh_shape"])
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    start = _Cursor(g, placeholders[-1] if placeholders else None)
    gathers = [(n, found) for n in nodes if n.op == "call_function" and n.target is runtime.all_gather
               and "sizes" not in n.kwargs for found in [_gathered_share(n)] if found is not None]
    # a hybrid-sharded parameter's all-reduce over its broadcast axes: done by its gather bucket
    taken = {sync for _, (_, _, sync) in gathers if sync is not None}
    joint = _bucket_gradients(g, nodes, order, start, bucket_bytes, taken)
    _prefetch_gathers(g, gathers, start, prefetch_bytes, program.meta["mesh_shape"], bucket_bytes)
    chunked = overdecompose(g, chunks)
    _start_steps_early(g, start)
    if weights_later:
        _weight_grads_later(g)
    g.lint()
    gm = fx.GraphModule(program, g, class_name="RankProgram")
    gm.meta.update(program.meta)
    gm.meta["passes"] = list(program.meta.get("passes", [])) + ["schedule"]
    gm.meta["joint_axes"] = sorted(joint | set(program.meta.get("joint_axes", ())))
    gm.meta["chunked"] = chunked
    gm.meta["interleaved"] = cut
    return gm


class _Cursor:
    """Appends nodes one after another after an anchor (the program's start, or a wait)."""

    def __init__(self, g: fx.Graph, anchor):
        self.g, self.anchor = g, anchor

    def call(self, fn, args, kwargs=None):
        if self.anchor is None:
            ctx = self.g.inserting_before(next(iter(self.g.nodes)))
        else:
            ctx = self.g.inserting_after(self.anchor)
        with ctx:
            node = self.g.call_function(fn, args, kwargs or {})
        self.anchor = node
        return node


def _local_bytes(ph: fx.Node) -> int:
    meta = ph.meta["local"]
    return math.prod(meta.shape) * meta.itemsize


def _bucket_gradients(g, nodes, order, start: _Cursor, cap: int, taken=frozenset()) -> set:
    syncs = [n for n in nodes if n.op == "call_function" and n.target is runtime.grad_sync and n.users
             and n.args[0].op == "placeholder" and len(n.args[0].users) == 1 and n not in taken]
    first_use = {n: min(order[u] for u in n.users) for n in syncs}
    buckets, open_ = [], {}
    # gradients complete in reverse order of first use: fill buckets in that order
    for n in sorted(syncs, key=lambda n: -first_use[n]):
        key = (tuple(n.args[1]), n.args[0].meta["local"].dtype)
        size = _local_bytes(n.args[0])
        b = open_.get(key)
        if b is None or (b["bytes"] and b["bytes"] + size > cap):
            b = open_[key] = {"axes": key[0], "members": [], "bytes": 0}
            buckets.append(b)
        b["members"].append(n)
        b["bytes"] += size
    for i, b in enumerate(buckets):
        members = sorted(b["members"], key=first_use.get)
        h = start.call(runtime.pending, (f"grad_bucket_{i}",))
        waited = start.call(runtime.grad_wait, (h, *[n.args[0] for n in members]))
        waited = [start.call(operator.getitem, (waited, i)) for i in range(len(members))]
        first = min((u for n in members for u in n.users), key=order.get)
        with g.inserting_before(first):
            launch = g.call_function(runtime.grad_bucket, (h, b["axes"], *waited))
            for i, n in enumerate(members):
                out = g.call_function(operator.getitem, (launch, i))
                n.replace_all_uses_with(out)
                g.erase_node(n)
    return {b["axes"] for b in buckets if len(b["axes"]) > 1}


def _gathered_share(n):
    """(placeholder, dtype to cast it to or None, its grad_sync or None) where the all-gather
    ``n`` gathers a parameter's share: the placeholder itself, used by nothing else (but the
    recipe that makes the gathered parameter again for backward, runtime.regather), or a cast of
    it that a mixed-precision policy or autocast made, which the placeholder and the cast feed
    alone (its copy is then gathered in the cast's bytes, the cast done by the bucket). A
    hybrid-sharded parameter (stored broadcast on other axes) comes through its ``grad_sync``,
    which then feeds the gather (or the cast) alone: its bucket all-reduces the reduce-scattered
    gradient over those axes too."""
    x = n.args[0]
    if _copy(x):
        inner = x.args[0]
        if _synced(inner):
            return inner.args[0], x.kwargs["dtype"], inner
        if inner.op == "placeholder" and len(inner.users) == 1:
            return inner, x.kwargs["dtype"], None
        return None
    if _synced(x):
        return x.args[0], None, x
    if x.op == "placeholder" and not x.meta.get("arrived") and sum(u.target is not runtime.regather
                                                                    for u in x.users) == 1:
        return x, None, None   # a user's rows (inputs="local") are gathered where they are used
    return None


def _synced(x) -> bool:
    """Whether ``x`` is a parameter's ``grad_sync``, the placeholder's one use, used once but for
    the regather recipe."""
    return (x.op == "call_function" and x.target is runtime.grad_sync and x.args[0].op == "placeholder"
            and len(x.args[0].users) == 1 and sum(u.target is not runtime.regather for u in x.users) == 1)


def _copy(x) -> bool:
    """Whether ``x`` is a cast a mixed-precision policy or autocast made, read by one node."""
    return x.op == "call_function" and x.target is CAST and set(x.kwargs) == {"dtype"} and len(x.users) == 1


def _master(x) -> bool:
    """Whether ``x`` is a parameter's share as fed: its placeholder, or the placeholder through
    the all-reduce of its gradient over the axes it is stored broadcast on (hybrid sharding:
    ``grad_sync``, or its gradient bucket once scheduled)."""
    if x.op == "call_function" and x.target is runtime.grad_sync:
        x = x.args[0]
    return _from_parameter(x)


def fuse_cast_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Every synchronous all-gather of a parameter's policy copy (``overlap=False``: a scheduled
    program has bucketed it or made it an asynchronous step) becomes ``runtime.cast_all_gather``:
    the same gather in the copy's bytes, its reduce-scatter in ``reduce_dtype`` as a bucket's is."""
    g, fused_any = gm.graph, False
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not runtime.all_gather or len(n.args) != 1:
            continue
        x = n.args[0]
        if not (_copy(x) and _master(x.args[0])):
            continue
        fused_any = True
        with g.inserting_before(n):
            fused = g.call_function(runtime.cast_all_gather, (x.args[0],), {**n.kwargs, "dtype": x.kwargs["dtype"]})
        fused.meta.update(n.meta)
        n.replace_all_uses_with(fused)
        g.erase_node(n)
        g.erase_node(x)
    if fused_any:
        gm.recompile()
    return gm


def batch_casts(gm: fx.GraphModule) -> fx.GraphModule:
    """Each run of a policy's casts of parameters to one dtype, with nothing between them but
    other such casts and the parameters' feeding (placeholders, gradient all-reduces and buckets,
    a share sliced off), becomes one ``runtime.cast_many``: one op and one autograd node for the
    run instead of one per parameter (a GPT of 52 parameters spent 2 ms of a 14 ms step on an
    H200 launching them). The run's casts move to its last one, after every parameter they read."""
    g, runs, run, fed = gm.graph, [], [], set()
    for n in g.nodes:
        if _feeding(n, fed):
            fed.add(n)
            continue
        if _param_cast(n, fed) and (not run or run[0].kwargs["dtype"] == n.kwargs["dtype"]):
            run.append(n)
            continue
        runs.append(run)
        run = [n] if _param_cast(n, fed) else []
    runs.append(run)
    runs = [r for r in runs if len(r) > 1]
    for run in runs:
        with g.inserting_after(run[-1]):
            fused = g.call_function(runtime.cast_many, (run[0].kwargs["dtype"], *(c.args[0] for c in run)))
        fused.meta.update({k: v for k, v in run[0].meta.items() if k != "val"})
        with g.inserting_after(fused):
            for i, c in reversed(list(enumerate(run))):
                part = g.call_function(operator.getitem, (fused, i))
                part.meta.update(c.meta)
                c.replace_all_uses_with(part)
        for c in run:
            g.erase_node(c)
    if runs:
        gm.recompile()
    return gm


# what hands a parameter's share to the program without computing on an activation
_FEEDS = (runtime.grad_sync, runtime.pending, runtime.grad_bucket, runtime.grad_wait, runtime.slice_shard,
          operator.getitem)


def _feeding(n, fed: set) -> bool:
    """Whether ``n`` is a placeholder, or feeds parameters (``_FEEDS``) from such nodes alone."""
    if n.op == "placeholder":
        return True
    return n.op == "call_function" and n.target in _FEEDS and all(a in fed for a in n.all_input_nodes)


def _param_cast(n, fed: set) -> bool:
    """Whether ``n`` is a cast of a parameter's share as fed."""
    return n.op == "call_function" and n.target is CAST and set(n.kwargs) == {"dtype"} and n.args[0] in fed


def _prefetch_gathers(g, gathers: list, start: _Cursor, limit: int, mesh_shape, cap: int) -> None:
    """``gathers``: [(all-gather node, its ``_gathered_share``)], in program order."""
    # neighbours in use order on one group, of one dtype, up to ``cap`` gathered bytes: one
    # collective, as FSDP gathers a module's parameters at once
    buckets = []
    for n, (ph, cast, sync) in gathers:
        axis, meta = n.kwargs["axis"], ph.meta["local"]
        dtype = cast or meta.dtype
        size = math.prod(meta.shape) * dtype.itemsize * math.prod(
            mesh_shape[a] for a in ((axis,) if isinstance(axis, int) else axis))
        key = (axis, meta.dtype, cast, tuple(sync.args[1]) if sync is not None else ())
        b = buckets[-1] if buckets else None
        if b is None or b["key"] != key or b["bytes"] + size > cap:
            b = {"key": key, "members": [], "bytes": 0}
            buckets.append(b)
        b["members"].append(n)
        b["bytes"] += size
    shared = dict(gathers)
    sizes, waits, after = [], [], {}
    for i, b in enumerate(buckets):
        members, axis = b["members"], b["key"][0]
        shares = [shared[n][0] for n in members]
        sizes.append(b["bytes"])
        h = start.call(runtime.pending, (f"gather_bucket_{i}",))
        waited = start.call(runtime.grad_wait, (h, *shares))
        waited = [start.call(operator.getitem, (waited, k)) for k in range(len(members))]
        # start after the wait of the latest earlier bucket that keeps the bytes in flight <= limit
        j = i - 1
        while j >= 0 and sum(sizes[j:i + 1]) <= limit:
            j -= 1
        cursor = start if j < 0 else after.setdefault(j, _Cursor(g, waits[j]))
        kw = {"dtype": b["key"][2]} if b["key"][2] else {}
        if b["key"][3]:
            kw["sync"] = b["key"][3]
        started = cursor.call(runtime.bucket_start, (h, axis, *waited), kw or None)
        layout = tuple((tuple(ph.meta["local"].shape), n.kwargs["dim"], n.kwargs.get("groups", 1))
                       for ph, n in zip(shares, members))
        with g.inserting_before(members[0]):
            wait = g.call_function(runtime.bucket_wait, (started, h, layout))
            whole = [g.call_function(operator.getitem, (wait, k)) for k in range(len(members))]
        for k, n in enumerate(members):
            for u in [u for u in n.users if u.target is runtime.regather]:   # made again from the bucket
                with g.inserting_before(u):
                    again = g.call_function(runtime.regather_member, (whole[k], h, k))
                u.replace_all_uses_with(again)
                g.erase_node(u)
            n.replace_all_uses_with(whole[k])
            cast = n.args[0] if shared[n][1] is not None else None
            g.erase_node(n)
            if cast is not None:   # the bucket casts
                g.erase_node(cast)
            if shared[n][2] is not None:   # the bucket all-reduces over the broadcast axes
                g.erase_node(shared[n][2])
        waits.append(wait)


_STEP_KINDS = {getattr(runtime, k): k for k in runtime.COLLECTIVE_KINDS}


def _start_steps_early(g, start: _Cursor) -> None:
    """Every collective step between ops (the rewriter's conversions of activations, and of
    parameters the gather buckets did not take) becomes a start right after its input is made and
    a wait right before its first use (``runtime.step_start`` / ``step_wait``). An all-gather that
    only linears take is decomposed: each computes the rows of this rank's own block before the
    wait, and the others' after it (``runtime.linear_local_part`` / ``linear_gathered``)."""
    order = {n: i for i, n in enumerate(g.nodes)}

    def at(node) -> int:
        """``node``'s position; the positions again when it was inserted since (a step's wait, or
        a decomposed linear, that a later step reads)."""
        if node not in order:
            order.clear()
            order.update((m, i) for i, m in enumerate(g.nodes))
        return order[node]
    anchor = start.anchor   # what is at or before it is ready at the program's start
    for n in list(g.nodes):
        kind = _STEP_KINDS.get(n.target) if n.op == "call_function" else None
        if kind is None or not n.users or any(u.target is runtime.regather for u in n.users):
            continue
        x, first = n.args[0], min(n.users, key=at)
        kw = n.kwargs
        args = (kind, kw["axis"], kw.get("dim"), kw.get("dim2"), kw.get("groups", 1), kw.get("sizes"), kw.get("sizes2"))
        cast = x if kind == "all_gather" and _copy(x) and _master(x.args[0]) else None
        if cast is not None:   # a policy copy no bucket took: the step casts
            x, kw = x.args[0], {"dtype": cast.kwargs["dtype"]}
        else:
            kw = {}
        if anchor is None or at(x) > at(anchor):
            with g.inserting_after(x):
                h = g.call_function(runtime.pending, ())
            with g.inserting_after(h):
                token = g.call_function(runtime.step_start, (x, h, *args), kw)
        else:   # the input is ready at the program's start: start after what the other passes put there
            h = start.call(runtime.pending, ())
            token = start.call(runtime.step_start, (x, h, *args), kw)
        even = args[4] == 1 and args[5] is None and cast is None   # linear_gathered cuts the gathered rows evenly
        linears = _gathered_linears(n, first, at) if kind == "all_gather" and even else []
        with g.inserting_before(first):
            # each linear's rows from this rank's own block, computed while the gather flies
            parts = [g.call_function(runtime.linear_local_part, (x, *_weights(u), args[2])) for u in linears]
            wait = g.call_function(runtime.step_wait, (token, h))
        order[wait] = order[first] - 0.5
        for u, part in zip(linears, parts):
            with g.inserting_before(u):
                rest = g.call_function(runtime.linear_gathered, (wait, part, *_weights(u), args[1], args[2]))
            order[rest] = order[u]
            u.replace_all_uses_with(rest)
            g.erase_node(u)
        n.replace_all_uses_with(wait)
        g.erase_node(n)
        if cast is not None:
            g.erase_node(cast)


def _weights(linear):
    args = linear.args
    return args[1], args[2] if len(args) > 2 else linear.kwargs.get("bias")


def _gathered_linears(n, first, at) -> list:
    """The linears that take the all-gather ``n`` as their input, when they are all it feeds
    and their weights are ready before the first of them: their rows from this rank's block can
    be computed before the gather completes (a collective matmul)."""
    users = list(n.users)
    if not all(u.target is torch.ops.aten.linear.default and u.args[0] is n and n not in u.args[1:] for u in users):
        return []
    ready = all(not isinstance(w, fx.Node) or at(w) < at(first) for u in users for w in _weights(u))
    return sorted(users, key=at) if ready else []


def _weight_grads_later(g) -> None:
    """Each linear after a started step makes its weight's gradient in a node placed between a
    step's start and wait: in backward, autograd runs it while the step's dual is in flight
    (``runtime.linear_dw_later`` / ``weight_later``). The linears after a run of waits (the waits
    since the linear before them) share the run's bare steps, those with nothing computed between
    start and wait, in turn and in order, so that each bare step's dual flies beside some weight
    gradient (a Megatron block's reduce-scatter into the residual and all-gather out of it alike);
    where the run has none, they all go to its last wait. Only weights made before that wait
    (parameters, as fed or after their gradient's bucket) are."""
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    runs, waits, linears = [], [], []
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target is runtime.step_wait:
            if linears:
                runs.append((waits, linears))
                waits, linears = [], []
            waits.append(n)
        elif n.target is torch.ops.aten.linear.default and waits:
            linears.append(n)
    if linears:
        runs.append((waits, linears))
    for waits, linears in runs:
        bare = [w for w in waits if _bare(nodes[order[w.args[0]] + 1:order[w]])]
        spans = bare[-len(linears):] or waits[-1:]
        for i, n in enumerate(linears):
            wait = spans[i * len(spans) // len(linears)]
            x, w = n.args[0], n.args[1]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            if not (isinstance(w, fx.Node) and order[w] < order[wait] and _from_parameter(w)):
                continue
            with g.inserting_before(wait):
                h = g.call_function(runtime.pending, ())
                late = g.call_function(runtime.weight_later, (w, h))
            with g.inserting_before(n):
                again = g.call_function(runtime.linear_dw_later, (x, late, b, h))
            n.replace_all_uses_with(again)
            g.erase_node(n)


# nodes that compute nothing of their own between a step's start and its wait
_BOOKKEEPING = (runtime.pending, runtime.step_start, runtime.step_wait, runtime.weight_later, operator.getitem)


def _bare(between) -> bool:
    """Whether nothing is computed among ``between``, the nodes between a start and its wait: its
    dual in backward has nothing beside it but what ``_weight_grads_later`` puts there."""
    return all(n.op != "call_function" or n.target in _BOOKKEEPING for n in between)


def _from_parameter(node) -> bool:
    """A parameter as fed to the program, or handed on by its gradient bucket."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
        if node.target in (runtime.grad_bucket, runtime.grad_wait):
            return True
    return node.op == "placeholder"
