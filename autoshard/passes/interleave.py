"""Interleave: the program's batch cut into k chunks that run the same ops one after the other,
segment by segment, so that one chunk's activation collectives fly while the next chunk
computes (overdecomposition of whole blocks, as Tensor3D splits a layer's batch; in the
schedule of a Megatron block, chunk 0's all-reduce after the attention runs beside chunk 1's
attention).

A segment is the run of ops between two collective steps. With k = 2 and a block whose ops
are A (up to an all-reduce r) then B:

    A_0, r_0 start, A_1, r_1 start, r_0 wait, B_0, r_1 wait, B_1, ...

``passes.schedule`` turns each chunk's collective into a start right after its input and a wait
right before its first use, so the order above is what it makes of the interleaved program; in
backward, autograd runs the ready node made last first, which interleaves the chunks' backward
the same way (chunk 1's segment, then chunk 0's while chunk 1's dual flies).

Only ops that act on each sample alone are cut (``_RULES``: each knows where its output keeps
the batch dim and that it neither mixes samples nor draws random numbers); the batch dim is
followed from the inputs' dim 0 through the ops that move it (views, transposes). Ops that
mix samples (the loss, a mean over the batch) or are not known stay whole, with the chunks
concatenated before them, and so does what follows them; a dropout that draws random numbers
runs whole too, so that it draws what it would without the chunks, and its output is cut again
after it. The chunked program computes what the whole one does, up to the rounding of matmuls
on fewer rows and of weight gradients summed over chunks. Parameters and whatever is made from them
alone (their gathers, casts) are shared by the chunks.
"""
from __future__ import annotations

import heapq
import math
import operator

import torch
import torch.fx as fx

from autoshard import runtime
from autoshard import convert

aten = torch.ops.aten

# ops whose output keeps the batch where broadcasting puts it, and that act on each element alone
_POINTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
              aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.gelu.default, aten.relu.default,
              aten.silu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.exp.default,
              aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.clone.default,
              aten._to_copy.default, aten.alias.default, aten.contiguous.default, aten.to.dtype,
              aten.to.dtype_layout, aten.reciprocal.default}
_STEPS = {getattr(runtime, k): k for k in runtime.COLLECTIVE_KINDS}   # the runtime's step -> its kind


class _Shapes:
    """Each node's local output shape (a tuple, or None where it is not one tensor or not
    known), worked out on the meta device: aten ops run on meta tensors, the runtime's steps by
    what they do to a shape."""

    def __init__(self, g: fx.Graph, mesh: tuple):
        self.mesh, self.of, self.dtype = mesh, {}, {}
        for n in g.nodes:
            try:
                self.of[n] = self._shape(n)
            except Exception:   # an op that meta tensors cannot run: not cut, not a broadcast operand
                self.of[n] = None

    def _meta(self, a):
        if isinstance(a, fx.Node):
            s = self.of.get(a)
            if s is None:
                raise ValueError("unknown shape")
            return torch.empty(s, dtype=self.dtype[a], device="meta")
        return a

    def _shape(self, n):
        if n.op == "placeholder":
            local = n.meta.get("local")
            if local is None:
                return None
            self.dtype[n] = local.dtype
            return tuple(local.shape)
        if n.op != "call_function":
            return None
        t = n.target
        if isinstance(t, torch._ops.OpOverload):
            # every device the op names the meta device (rotary embeddings move their
            # frequencies with aten.to.device)
            on_meta = lambda a: torch.device("meta") if isinstance(a, torch.device) else a   # noqa: E731
            args = tuple(on_meta(a) for a in torch.fx.node.map_arg(n.args, self._meta))
            kwargs = {k: on_meta(v) for k, v in torch.fx.node.map_arg(n.kwargs, self._meta).items()}
            if "device" in kwargs:
                kwargs["device"] = torch.device("meta")
            out = t(*args, **kwargs)
            if isinstance(out, (list, tuple)) and out and all(isinstance(o, torch.Tensor) for o in out):
                self.dtype[n] = out[0].dtype   # a split: a list of shapes, which getitem reads
                return [tuple(o.shape) for o in out]
            if not isinstance(out, torch.Tensor):
                return None
            self.dtype[n] = out.dtype
            return tuple(out.shape)
        if t is operator.getitem:
            parts = self.of.get(n.args[0])
            if not isinstance(parts, list):
                return None
            self.dtype[n] = self.dtype[n.args[0]]
            return parts[n.args[1]]
        if n.args and isinstance(n.args[0], fx.Node) and n.args[0] in self.dtype:
            self.dtype[n] = self.dtype[n.args[0]]
        if t in (runtime.to_local, runtime.grad_sync, runtime.keep_partial, runtime.dropout):
            return self.of[n.args[0]]
        if t in _STEPS or t is runtime.slice_shard:   # as the conversion planner shapes its steps
            kw = n.kwargs
            if kw.get("sizes") is not None or kw.get("sizes2") is not None:
                return None
            step = convert.Step(_STEPS.get(t, "slice"), kw["axis"], kw.get("dim"), kw.get("dim2"))
            return convert.apply_shape(self.of[n.args[0]], step, step.size(self.mesh))
        return None


def _fed(n: fx.Node) -> bool:
    """Whether ``n`` holds a user input in its planned layout: the rank's share of a whole input
    (``runtime.to_local`` of a placeholder), or the rows a rank brought, converted
    (``inputs="local"``: the node the rewriter marks)."""
    if n.meta.get("user_input"):
        return True
    return n.op == "call_function" and n.target is runtime.to_local and n.args[0].op == "placeholder"


def _batch_dims(g: fx.Graph, shapes: _Shapes, k: int, enter=None) -> dict:
    """node -> the dim of its output that holds the batch, for the nodes that may be cut into k
    chunks on it (``_rule``). The batch: dim 0 of the inputs (``runtime.to_local`` of a
    placeholder) of two or more dims, all of one size that k divides; an input of one dim is
    batched where its size is the batch's. ``enter`` gets the operands not batched that the
    cut ops take split (``_rule``)."""
    bd: dict = {}
    sizes = set()
    for n in g.nodes:   # inputs of two or more dims (one-dim ones, positions say, may be anything)
        if _fed(n):
            s = shapes.of[n]
            if s and len(s) > 1:
                sizes.add(s[0])
    if len(sizes) != 1 or next(iter(sizes)) % k or next(iter(sizes)) < k:
        return {}
    batch = next(iter(sizes))
    for n in g.nodes:
        if _fed(n):
            s = shapes.of[n]
            if s and s[0] == batch:
                bd[n] = 0
            continue
        if n.op != "call_function":
            continue
        d = _rule(n, bd, shapes, k, batch, enter)
        if d is not None:
            bd[n] = d
    return bd


def _rule(n, bd, shapes, k, batch=None, enter=None):
    """The batch dim of ``n``'s output where ``n`` can run on each chunk of its batched inputs
    alone, given theirs (``bd``); None where it cannot or holds no batch. ``batch``: the local
    batch's size. An operand not known to hold the batch whose dim the op lines up with the
    batch dim has the batch's full size there (a mask built for every sample, LLaMA's): each
    chunk takes its own rows of it, which are what the whole op combines with those samples;
    ``enter`` records it (node -> that dim) where the op can then be cut."""
    taken = {}

    def lined_up(a, j) -> bool:   # operand a's dim j against the batch dim: broadcast, or split with it
        s = shapes.of.get(a)
        if s is None:
            return False
        if j < 0 or s[j] == 1:
            return True
        if batch is None or s[j] != batch or (enter or {}).get(a, j) != j or taken.get(a, j) != j:
            return False
        taken[a] = j
        return True

    def cut(d):
        if d is not None and enter is not None:
            enter.update(taken)
        return d
    return cut(_cut_dim(n, bd, shapes, k, batch, lined_up))


def _cut_dim(n, bd, shapes, k, batch, lined_up):
    """``_rule``'s dim; ``lined_up(operand, dim)``: whether an operand not batched may meet the
    batch dim with that dim of it."""
    t, out = n.target, shapes.of.get(n)
    ins = list(n.all_input_nodes)
    batched = [a for a in ins if a in bd]
    x = n.args[0] if n.args else None
    if t is aten.expand.default and not batched and out and out[0] == batch and shapes.of.get(x) is not None:
        # a tensor without the batch broadcast to it (LLaMA's causal mask): every row alike, so
        # each chunk expands it to its own rows
        s = shapes.of[x]
        return 0 if len(out) > len(s) or s[0] == 1 else None
    if not batched or out is None:
        return None
    if t is aten.cat.default:   # every piece batched on the same dim, joined on another
        pieces = list(x)
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(out)
        dims = {bd.get(a) for a in pieces}
        return dims.pop() if len(dims) == 1 and None not in dims and dim not in (bd.get(pieces[0]),) else None
    if t in _POINTWISE:
        aligned = {bd[a] + len(out) - len(shapes.of[a]) for a in batched}
        if len(aligned) != 1:
            return None
        d = aligned.pop()
        for a in ins:   # a shared operand broadcasts over the batch dim, or is split with it
            if a in bd:
                continue
            s = shapes.of.get(a)
            if s is None or not lined_up(a, d - (len(out) - len(s))):
                return None
        return d
    if x not in bd or any(a in bd for a in ins if a is not x):
        if t is aten.scaled_dot_product_attention.default:
            qkv = n.args[:3]
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            drop = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
            if all(bd.get(a) == 0 for a in qkv) and not drop and (
                    mask is None or bd.get(mask) == 0 or mask not in bd and shapes.of.get(mask) is not None
                    and lined_up(mask, len(shapes.of[mask]) - len(out))):
                return 0
        if t in (aten.matmul.default, aten.bmm.default) and len(out) >= 3:
            # a batched matmul, both operands batched on dim 0 with every leading dim theirs
            a, b = n.args[:2]
            if bd.get(a) == 0 and bd.get(b) == 0 and len(shapes.of[a]) == len(shapes.of[b]) == len(out):
                return 0
        if t is aten.embedding.default and n.args[1] in bd and n.args[0] not in bd:
            return bd[n.args[1]]
        if t is aten.addmm.default and bd.get(n.args[1]) == 0 and n.args[0] not in bd and n.args[2] not in bd:
            return 0   # addmm(bias, x, w), GPT-2's Conv1D: x's rows are the batch
        return None
    d, s = bd[x], shapes.of[x]
    if t is aten.dropout.default or t is runtime.dropout:   # whole where it draws random numbers (_random)
        return d
    if t in (aten.split.Tensor, aten.split_with_sizes.default):   # a list of chunks, each batched alike
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        return d if dim % len(s) != d else None
    if t is operator.getitem:
        return d
    if t is aten.linear.default or t is runtime.keep_partial:
        return d if d < len(s) - 1 else None
    if t is aten.layer_norm.default:
        return d if d < len(s) - len(n.args[1]) else None
    if t in (aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int):
        return d if n.args[1] % len(s) != d else None
    if t is aten.transpose.int:
        a, b = (n.args[1] % len(s), n.args[2] % len(s))
        return b if d == a else a if d == b else d
    if t is aten.permute.default:
        return [p % len(s) for p in n.args[1]].index(d)
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        # the dims before the batch kept as they are; the batch dim whole, merged with the dims
        # after it, or (a merged batch taken apart) its leading factor, which k divides
        if tuple(out[:d]) == tuple(s[:d]) and len(out) > d and (
                out[d] % s[d] == 0 or (s[d] % out[d] == 0 and out[d] % k == 0)):
            return d
        return None
    if t is aten.expand.default:   # the batch dim kept (its size, in the sizes, cut like a view's)
        lead = len(out) - len(s)
        return d + lead if n.args[1][d + lead] in (s[d], -1) and s[d] == out[d + lead] else None
    if t is aten.unsqueeze.default:
        return d + (n.args[1] % len(out) <= d)
    if t is aten.slice.Tensor:
        return d if (n.args[1] if len(n.args) > 1 else 0) % len(s) != d else None
    if t in (aten.mean.dim, aten.sum.dim_IntList):
        dims = [a % len(s) for a in (n.args[1] or ())]
        if not dims or d in dims:
            return None
        keep = len(n.args) > 2 and n.args[2] or n.kwargs.get("keepdim", False)
        return d if keep else d - sum(a < d for a in dims)
    if t in _STEPS or t is runtime.slice_shard:
        if t is runtime.all_reduce:
            return d
        kw = n.kwargs
        if kw.get("groups", 1) != 1 or kw.get("sizes") is not None or d in (kw.get("dim"), kw.get("dim2")):
            return None
        return d
    return None


def _random(n) -> bool:
    """A dropout that draws random numbers (p > 0, training): it runs on the whole batch, as
    without the chunks, so that it draws the same numbers; its output is cut again after it."""
    return n.target in (aten.dropout.default, runtime.dropout) and n.args[1] != 0 and bool(n.args[2])


_SIZED = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)


def _shape_arg(n, d: int, k: int):
    """The args of a view, reshape or expand cut to one chunk: the output's batch dim's size
    over k (-1, which expand keeps, stays)."""
    shape = list(n.args[1])
    shape[d] = shape[d] // k
    return (n.args[0], shape) + tuple(n.args[2:])


def interleave(g: fx.Graph, k: int, mesh: tuple) -> tuple:
    """(graph, how many ops it cut): ``g`` with every op that acts on each sample alone cut into
    ``k`` chunks of the batch, in the order of the module docstring, as a new graph; ``g`` itself,
    and 0, where no collective step would fly beside another chunk's compute."""
    if k <= 1:
        return g, 0
    shapes = _Shapes(g, mesh)
    enter: dict = {}
    bd = _batch_dims(g, shapes, k, enter)
    cut = {n for n in bd if not (_fed(n) or _random(n))}
    if not any(n.target in _STEPS for n in cut):
        return g, 0
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # a segment: how many collective steps lie on the longest chain of cut ops before the op
    seg = {}
    for n in nodes:
        if n in cut:
            seg[n] = max((seg[a] + (a.target in _STEPS) for a in n.all_input_nodes if a in cut), default=0)
    follows = {}   # a node not cut: the segment of the first cut op after it (where it is emitted)
    nxt = math.inf
    for n in reversed(nodes):
        if n in cut:
            nxt = seg[n]
        else:
            follows[n] = nxt

    new = fx.Graph()
    env: dict = {}       # node not cut -> its copy
    chunks: dict = {}    # node cut -> [its copy per chunk]
    parts: dict = {}     # batched node not cut -> [its chunks] (tensor_split, made once)
    wholes: dict = {}    # cut node read by a node not cut -> cat of its chunks

    def arg(a, c):
        if a in cut:
            return chunks[a][c]
        if a in bd or a in enter:   # a batched value (or one lined up with the batch) entering the cut ops: split once
            if a not in parts:
                whole = env[a]
                split = new.call_function(torch.tensor_split, (whole, k, bd[a] if a in bd else enter[a]))
                parts[a] = [new.call_function(operator.getitem, (split, i)) for i in range(k)]
            return parts[a][c]
        return env[a]

    def whole(a):
        if a in cut:
            if a not in wholes:
                wholes[a] = new.call_function(torch.cat, (chunks[a], bd[a]))
            return wholes[a]
        return env[a]

    # emit in (segment, chunk, original order), every node once its inputs are out; the keys
    # are distinct, so the heap never compares the items themselves
    def key(item):
        n, c = item
        if n.op == "placeholder":
            return (-1, -1, index[n])
        if n.op == "output":
            return (math.inf, math.inf, index[n])
        return (seg[n], c, index[n]) if n in cut else (follows[n], -1, index[n])

    items = [(n, c) for n in nodes for c in (range(k) if n in cut else (None,))]
    waiting = {}
    users: dict = {}
    for n, c in items:
        deps = set()
        for a in n.all_input_nodes:
            if a not in cut:
                deps.add((a, None))
            elif n in cut:
                deps.add((a, c))
            else:   # a node not cut reads every chunk, concatenated
                deps.update((a, i) for i in range(k))
        waiting[(n, c)] = len(deps)
        for dep in deps:
            users.setdefault(dep, []).append((n, c))
    ready = [(key(it), it) for it in items if waiting[it] == 0]
    heapq.heapify(ready)
    while ready:
        _, (n, c) = heapq.heappop(ready)
        if n in cut:
            args = _shape_arg(n, bd[n], k) if n.target in _SIZED else n.args
            copy = new.call_function(n.target, torch.fx.node.map_arg(args, lambda a: arg(a, c)),
                                     dict(torch.fx.node.map_arg(n.kwargs, lambda a: arg(a, c))))
            copy.meta.update(n.meta)
            chunks.setdefault(n, [None] * k)[c] = copy
        else:
            env[n] = new.node_copy(n, whole)
        for u in users.get((n, c), ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key(u), u))
    assert all(v == 0 for v in waiting.values()), "interleave: a node was never ready"
    return new, len(cut)
