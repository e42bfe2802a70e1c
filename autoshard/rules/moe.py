"""Mixture-of-experts: the router's ops (top-k, sort, histogram, scatter, gather, index_put) and
the grouped expert matmul.

A router picks each token's experts row by row, so its ops split any dim but the one they run
along. The dispatch then sorts the (token, expert) pairs of the whole batch by expert, counts
the rows of each expert (``histc``) and multiplies each expert's rows by its own weight: the
grouped matmul ``y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]`` (``torch._grouped_mm``,
transformers' ``grouped_mm_fallback``), with x (rows, k), w (experts, k, n) and offs the running
count of rows per expert. Its signatures on one axis:

    (B, S(2), B) -> S(1)     each rank its share of every expert's columns (tensor parallel)
    (S(1), S(1), B) -> P     each rank its share of every expert's inner dim (tensor parallel)
    (B, S(0), B) -> P        each rank its experts, computed on their rows; others' rows zero
    (S(0), B, B) -> S(0)     each rank its rows, whatever their experts
    (S(0), S(0), B) -> S(0)  expert parallel: each rank sends the rows it holds to the ranks
                             of their experts and gets their products back (all-to-all with
                             per-rank split sizes, both ways; ``autoshard.runtime.experts``)
    (P, B, B) -> P, (B, P, B) -> P   linear in each of x and w

offs is always whole: every rank knows where each expert's rows are, so the sizes each rank
sends and receives need no exchange. The last three run through ``autoshard.runtime.experts.grouped_mm``
(their local form is not the op on local tensors).
"""
from __future__ import annotations

import contextlib
import contextvars
import difflib
import itertools
import math
import operator

import torch

from autoshard.placement import B, P, Split, local_shape
from autoshard.rules.pointwise import numerator
from autoshard.rules.registry import OpCtx, Sig, norm_dim, qualified_name, register, register_by_name, rule

aten = torch.ops.aten

# transformers' grouped matmul (transformers.integrations.moe), a custom op that exists only once
# transformers is imported: found by its name
TRANSFORMERS_GROUPED_MM = "transformers::grouped_mm_fallback"
# torchtitan's scatter-add of the experts' rows back to their tokens (torchtitan.ops.scatter_add)
TORCHTITAN_SCATTER_ADD = "torchtitan::deterministic_scatter_add"


def _along(ctx: OpCtx, dim: int) -> list:
    """Split any dim but ``dim`` on every input and output that has it at the same size."""
    x = ctx.in_shapes[0]
    sigs = []
    for d in range(len(x)):
        if d == dim or x[d] <= 1:
            continue
        shapes = list(ctx.in_shapes) + list(ctx.out_shapes)
        if all(len(s) == len(x) and s[d] == x[d] for s in shapes):
            sigs.append(Sig((Split(d),) * ctx.n_in, (Split(d),) * ctx.n_out))
    return sigs


@rule(aten.topk.default)
def topk(ctx: OpCtx):
    return _along(ctx, norm_dim(ctx.arg(2, "dim", -1), len(ctx.in_shapes[0])))


SORTS = (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)


@rule(*SORTS)
def sort(ctx: OpCtx):
    """Any dim but the sorted one; and the 1-d sort of integer keys (the routing's order of the
    (token, expert) pairs) split on its only dim, ``(S(0)) -> S(0)``, each rank its chunk of the
    whole order (global indices, and the sorted keys), by a counting sort across the ranks
    (``runtime.scans.sort``: stable, which a sort asked for no stability allows; priced by
    ``sort_collectives``)."""
    sigs = _along(ctx, norm_dim(sort_args(ctx.target, ctx.args, ctx.kwargs)[0], len(ctx.in_shapes[0])))
    if is_split_sort(ctx.target, ctx.args, ctx.in_shapes) and ctx.in_shapes[0][0] > 1:
        sigs.append(Sig((Split(0),), (Split(0),) * ctx.n_out))
    return sigs


def sort_args(target, args, kwargs) -> tuple:
    """(dim, descending) of a sort or argsort: positional in ``.default``, keywords in ``.stable``."""
    if target in (aten.sort.stable, aten.argsort.stable):
        return kwargs.get("dim", -1), bool(kwargs.get("descending", False))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    return dim, bool(args[2] if len(args) > 2 else kwargs.get("descending", False))


def _dtype(t):
    val = t.meta.get("val") if isinstance(t, torch.fx.Node) else t
    return getattr(val, "dtype", None)


def is_split_sort(target, args, in_shapes) -> bool:
    """Whether an op is a 1-d sort or argsort of integer keys: split on its dim, a counting sort."""
    dtype = _dtype(args[0]) if args else None
    return (target in SORTS and len(in_shapes) == 1 and len(in_shapes[0]) == 1
            and dtype is not None and not dtype.is_floating_point and not dtype.is_complex)


@rule(aten.histc.default)
def histc(ctx: OpCtx):
    """Counts add up: the histogram of a split tensor is the sum of its shares' (a partial sum,
    so only where the counts are floating)."""
    return [Sig((Split(d),), (P,)) for d, n in enumerate(ctx.in_shapes[0]) if n > 1]


@rule(aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
      aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_reduce.two)
def scatter_gather(ctx: OpCtx):
    """gather(x, dim, index) and scatter(x, dim, index, src): any dim but ``dim`` where every
    tensor has x's size. scatter_add is linear in x and src together; gather in x."""
    dim = norm_dim(ctx.arg(1, "dim"), len(ctx.in_shapes[0]))
    if ctx.target == aten.scatter_add.default:
        return scatter_add_sigs(ctx, dim)
    sigs = _along(ctx, dim)
    if ctx.target == aten.gather.default:
        sigs.append(Sig((P, B), (P,)))
    return sigs


def scatter_add_sigs(ctx: OpCtx, dim: int) -> list:
    """x.scatter_add(dim, index, src) adds src[i] at x's position index[i] along ``dim`` (i's own
    position on every other dim): besides the splits of ``_along``, linear in x and src together,
    and a sum over the positions of index along ``dim``. Each rank adding its chunk of those
    positions (index and src split there alike) into its piece of x leaves the whole sum split
    into partial sums: ``(P, S(dim), S(dim)) -> P``. Split on another dim, a chunk's positions
    would land at the chunk's own coordinates, not the whole's."""
    sigs = _along(ctx, dim) + [Sig((P, B, P), (P,))]
    index, src = ctx.in_shapes[1], ctx.in_shapes[2]
    if len(index) == len(src) > dim and index[dim] == src[dim] > 1:
        sigs.append(Sig((P, Split(dim), Split(dim)), (P,)))
    return sigs


@rule(aten.index_add.default)
def index_add(ctx: OpCtx):
    """x.index_add(dim, index, source, alpha): x's slice index[i] along ``dim`` plus alpha times
    source's slice i. Split any other dim on x and source alike (the 1-d index whole); linear in
    x and source together; a sum over source's slices, so each rank adding its chunk of them
    (index split with them) gives partial sums."""
    x, source = ctx.in_shapes[0], ctx.in_shapes[2]
    dim = norm_dim(ctx.arg(1, "dim"), len(x))
    sigs = [Sig((Split(d), B, Split(d)), (Split(d),))
            for d in range(len(x)) if d != dim and len(source) == len(x) and source[d] == x[d] > 1]
    sigs.append(Sig((P, B, P), (P,)))
    if len(source) > dim and source[dim] > 1 and ctx.in_shapes[1] == (source[dim],):
        sigs.append(Sig((P, Split(0), Split(dim)), (P,)))
    return sigs


def scatter_add_rows(ctx: OpCtx) -> list:
    """torchtitan's ``deterministic_scatter_add(out, index, src)``: ``out.scatter_add(0, index,
    src)`` in a custom op (run deterministically); the combine step of its mixtures of experts."""
    return scatter_add_sigs(ctx, 0) if ctx.n_in == 3 and ctx.in_shapes[0] else []


def _index_span(t, shape):
    """(dims of x an index covers, dims it gives x[indices]): a boolean mask of k dims covers k
    and gives one (its true entries); an integer index covers one and gives its own dims. None
    where its dtype is unknown."""
    val = t.meta.get("val") if isinstance(t, torch.fx.Node) else t
    dtype = getattr(val, "dtype", None)
    if dtype is None:
        return None
    return (len(shape), 1) if dtype in (torch.bool, torch.uint8) else (1, len(shape))


@rule(aten.index_put.default, aten.index_put_.default)
def index_put(ctx: OpCtx):
    """x[i0, i1, ...] = values: split a dim of x that no index touches, the indices whole and
    values split on the dim that lines up with it (values are broadcast to x[indices]'s shape:
    the indexed dims' broadcast shape where they were, x's other dims as they were). With
    ``accumulate`` linear in x and values together."""
    x = ctx.in_shapes[0]
    indices = list(ctx.arg(1, "indices"))
    at = [i for i, t in enumerate(indices) if t is not None]
    idx_shapes = ctx.in_shapes[1:1 + len(at)]
    values = ctx.in_shapes[-1]
    if not at or len(idx_shapes) != len(at):
        return []
    spans = [_index_span(indices[i], s) for i, s in zip(at, idx_shapes)]
    if None in spans:
        return []   # an index of unknown dtype: which dims of x it covers is unknown
    covered, d = [], 0
    for i, t in enumerate(indices):
        k = 1 if t is None else spans[at.index(i)][0]
        if t is not None:
            covered.extend(range(d, d + k))
        d += k
    nb = max(s[1] for s in spans)
    rest = [d for d in range(len(x)) if d not in covered]
    first = covered[0] if at == list(range(at[0], at[-1] + 1)) else 0
    before, after = rest[:first], rest[first:]
    at_out = {d: i for i, d in enumerate(before)}
    at_out.update({d: first + nb + i for i, d in enumerate(after)})
    n_out = len(before) + nb + len(after)
    sigs = []
    for d in rest:
        if x[d] <= 1:
            continue
        vd = at_out[d] - (n_out - len(values))    # values broadcast from the right
        vp = Split(vd) if vd >= 0 and values[vd] == x[d] else B
        if vp == B and vd >= 0 and values[vd] != 1:
            continue
        sigs.append(Sig((Split(d),) + (B,) * len(at) + (vp,), (Split(d),)))
    if ctx.arg(3, "accumulate", False):
        sigs.append(Sig((P,) + (B,) * len(at) + (P,), (P,)))
    return sigs


# the router's top-k weights normalized in place (``w /= w.sum(-1, keepdim=True)``): as div
register([aten.div_.Tensor], numerator)


def grouped_mm_sigs(ctx: OpCtx) -> list:
    """x (rows, k) by w (experts, k, n) at offsets offs (experts,): the signatures of the module
    docstring. Other forms (3-d by 3-d, a bias) run replicated."""
    if ctx.n_in != 3 or len(ctx.in_shapes[0]) != 2 or len(ctx.in_shapes[1]) != 3:
        return []
    (m, k), (g, _, n) = ctx.in_shapes[0], ctx.in_shapes[1]
    sigs = []
    if n > 1:
        sigs.append(Sig((B, Split(2), B), (Split(1),)))
    if k > 1:
        sigs.append(Sig((Split(1), Split(1), B), (P,)))
    if g > 1:
        sigs.append(Sig((B, Split(0), B), (P,)))
    if m > 1:
        sigs.append(Sig((Split(0), B, B), (Split(0),)))
    if m > 1 and g > 1:
        sigs.append(Sig((Split(0), Split(0), B), (Split(0),)))
    sigs += [Sig((P, B, B), (P,)), Sig((B, P, B), (P,))]
    return sigs


@rule(aten._grouped_mm.default)
def grouped_mm(ctx: OpCtx):
    if ctx.arg(3, "bias") is not None:
        return []
    return grouped_mm_sigs(ctx)


register_by_name([TRANSFORMERS_GROUPED_MM], grouped_mm_sigs)
register_by_name([TORCHTITAN_SCATTER_ADD], scatter_add_rows)


# ---- pricing -----------------------------------------------------------------------------------
#
# Where each expert's rows lie depends on the routing, which planning cannot see: it assumes each
# expert gets an equal share of the rows (uniform routing), or the shares a user measured
# (``with autoshard.expert_loads(model, {weight name: shares})``). From the shares, the rows
# sorted by expert lie in contiguous ranges, and every rank's work and traffic follow exactly:
#
#     rows computed   its experts' rows among the rows it holds (or, where an axis splits both,
#                     among the rows every member of its group holds: they are sent to it)
#     rows sent       the rows it holds of the other members' experts; their products come back
#
# both taken at the busiest rank, as the step waits for it. The rows of a split tensor taken at a
# whole index (``experts.gather_rows``) come from every rank alike: (p-1)/p of them travel.

_MEASURED: contextvars.ContextVar = contextvars.ContextVar("expert_loads", default={})


@contextlib.contextmanager
def expert_loads(model, loads: dict):
    """Plan for measured expert loads: within the block, ``autoshard.plan`` and ``parallelize``
    price the expert layers whose weight is named in ``loads`` by the share of rows each expert
    gets, ``{"layers.0.mlp.experts.gate_up_proj": [0.4, 0.3, 0.2, 0.1], ...}`` (any positive
    numbers, one per expert, in expert order; they are normalized), instead of equal shares."""
    if not isinstance(loads, dict):
        raise TypeError("loads is a dict {expert weight name: [share of rows per expert, ...]}")
    params = dict(model.named_parameters(remove_duplicate=False))
    checked = {}
    for name, shares in loads.items():
        if name not in params:
            close = difflib.get_close_matches(str(name), list(params), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"expert_loads: {name!r} is not a parameter of the model.{hint}")
        shares = tuple(float(v) for v in shares)
        n = params[name].shape[0] if params[name].dim() else 0
        if len(shares) != n or any(not v >= 0 for v in shares) or not sum(shares) > 0:
            raise ValueError(f"expert_loads: {name!r} holds {n} experts on its dim 0; give {n} non-negative "
                             f"shares of the rows, not all zero, got {list(shares)}")
        checked[name] = shares
    token = _MEASURED.set({**_MEASURED.get(), **checked})
    try:
        yield
    finally:
        _MEASURED.reset(token)


# what an argsort's keys may come through from top-k's indices and keep their values
_KEEPS_VALUES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                 aten.clone.default, aten.contiguous.default}


def key_range(keys) -> "int | None":
    """How many values the keys (an fx node) can take where the graph shows it: top-k's indices
    (through views) lie in [0, the size of top-k's input on its dim). None elsewhere."""
    while isinstance(keys, torch.fx.Node) and keys.target in _KEEPS_VALUES:
        keys = keys.args[0]
    if not (isinstance(keys, torch.fx.Node) and keys.target is operator.getitem and keys.args[1] == 1):
        return None
    topk = keys.args[0]
    if not isinstance(topk, torch.fx.Node) or topk.target != aten.topk.default:
        return None
    x = topk.args[0].meta.get("val")
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    return None if x is None else int(x.shape[norm_dim(dim, x.dim())])


def sort_collectives(node, strat, mesh_shape) -> list:
    """(kind, axis, bytes, phase) of a split sort's counting sort (``runtime.scans.sort``):
    each rank's (min, max, count), its histogram over the keys' range (the range top-k shows, else
    as many bins as keys: beyond that the keys are gathered instead, as many bytes) and its
    (position, index) pairs sent to their ranks; forward only. A group over several axes is
    priced as one collective per axis."""
    if node.kind != "op" or node.target not in SORTS or \
            not is_split_sort(node.target, node.fx_node.args, [node.outputs[0].shape]):
        return []
    axes = [a for a, q in enumerate(strat.inputs[0]) if isinstance(q, Split) and mesh_shape[a] > 1]
    if not axes:
        return []
    n = node.outputs[0].shape[0]
    bins = min(key_range(node.fx_node.args[0]) or n, n)
    held = local_shape((n,), strat.inputs[0], mesh_shape)[0]
    return [c for a in axes for c in (("all_gather", a, 24, "forward"), ("all_gather", a, 8 * bins, "forward"),
                                      ("all_to_all", a, 16 * held, "forward"))]


def is_grouped_mm(target) -> bool:
    return target == aten._grouped_mm.default or qualified_name(target) == TRANSFORMERS_GROUPED_MM


def _split_axes(placements, mesh_shape) -> tuple:
    return tuple(a for a, q in enumerate(placements)
                 if isinstance(q, Split) and q.dim == 0 and mesh_shape[a] > 1)


def chunk_of(coords, mesh_shape, axes) -> int:
    """The chunk a rank holds of a dim split over ``axes``: its coordinates flattened in axis order."""
    c = 0
    for a in axes:
        c = c * mesh_shape[a] + coords[a]
    return c


def group_members(coords, mesh_shape, axes) -> list:
    """The coordinates of every rank of the group over ``axes`` that holds ``coords``, in the
    group's order (flattened in axis order, as ``runtime.RankMesh.group`` enumerates them)."""
    members = []
    for picked in itertools.product(*(range(mesh_shape[a]) for a in axes)):
        c = list(coords)
        for a, v in zip(axes, picked):
            c[a] = v
        members.append(c)
    return members


def _overlap(a, b) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def expert_work(rows: int, loads: tuple, mesh_shape, row_axes: tuple, expert_axes: tuple) -> tuple:
    """(rows the busiest rank multiplies, rows the busiest rank sends away) of a grouped matmul
    of ``rows`` rows over experts with row shares ``loads``, rows split over ``row_axes`` and
    experts over ``expert_axes``."""
    import itertools
    bounds = [0.0]
    total = sum(loads)
    for share in loads:
        bounds.append(bounds[-1] + rows * share / total)
    pr = math.prod(mesh_shape[a] for a in row_axes)
    pe = math.prod(mesh_shape[a] for a in expert_axes)
    per = len(loads) // pe
    both = [a for a in row_axes if a in expert_axes]
    axes = sorted(set(row_axes) | set(expert_axes))
    computed = sent = 0.0
    for picked in itertools.product(*(range(mesh_shape[a]) for a in axes)):
        coords = [0] * len(mesh_shape)
        for a, c in zip(axes, picked):
            coords[a] = c

        def held(c):
            r = chunk_of(c, mesh_shape, row_axes)
            return rows * r / pr, rows * (r + 1) / pr

        def owned(c):
            e = chunk_of(c, mesh_shape, expert_axes)
            return bounds[e * per], bounds[(e + 1) * per]

        members = group_members(coords, mesh_shape, both)
        computed = max(computed, sum(_overlap(held(c), owned(coords)) for c in members))
        sent = max(sent, sum(_overlap(held(coords), owned(c)) for c in members if c != coords))
    return computed, sent


def _loads(graph, node, n_experts: int) -> tuple:
    """The measured shares of the expert weight's parameter (found through views: a transpose),
    or equal shares."""
    measured = _MEASURED.get()
    if measured:
        producer = graph.by_name[node.inputs[1][0]]
        while producer.kind == "op" and producer.inputs and getattr(producer.target, "is_view", False):
            producer = graph.by_name[producer.inputs[0][0]]
        names = [f for f, used in graph.param_aliases.items() if used == producer.fqn] + [producer.fqn]
        for name in names:
            if name in measured:
                return measured[name]
    return (1.0,) * n_experts


def computed_shapes(node, strat, graph, mesh_shape, ins, outs):
    """The local shapes an op's compute is priced at: a grouped matmul's x and output hold the
    rows the busiest rank multiplies (``expert_work``), as many as it was handed or fewer."""
    if node.kind != "op" or not is_grouped_mm(node.target) or len(ins) < 3 or len(ins[0]) != 2:
        return ins, outs
    rows, n_experts = graph.meta(node.inputs[0]).shape[0], graph.meta(node.inputs[1]).shape[0]
    busiest, _ = expert_work(rows, _loads(graph, node, n_experts), mesh_shape,
                             _split_axes(strat.inputs[0], mesh_shape), _split_axes(strat.inputs[1], mesh_shape))
    n = max(1, math.ceil(busiest))
    return [(n, ins[0][1])] + list(ins[1:]), [(n, outs[0][1])] + list(outs[1:])


def expert_collectives(node, strat, graph, mesh_shape) -> list:
    """(kind, axis, bytes as the collective's input, phase) of the all-to-alls an expert layer's
    lowering issues: a grouped matmul's exchange of rows and of their products, and the rows of
    a split tensor taken at a whole index; each again reversed in backward where gradients flow.
    An exchange over several axes is priced as one all-to-all per axis."""
    if node.kind != "op":
        return []
    phases = ("forward", "backward") if node.requires_grad else ("forward",)
    if is_grouped_mm(node.target) and len(node.inputs) >= 3:
        x, w = graph.meta(node.inputs[0]), graph.meta(node.inputs[1])
        rows_axes, expert_axes = _split_axes(strat.inputs[0], mesh_shape), _split_axes(strat.inputs[1], mesh_shape)
        both = [a for a in rows_axes if a in expert_axes]
        if not both or len(x.shape) != 2:
            return []
        _, sent = expert_work(x.shape[0], _loads(graph, node, w.shape[0]), mesh_shape, rows_axes, expert_axes)
        k = local_shape(x.shape, strat.inputs[0], mesh_shape)[1]
        n = local_shape(node.outputs[0].shape, strat.outputs[0], mesh_shape)[1]
        p = math.prod(mesh_shape[a] for a in both)
        nbytes = int(math.ceil(sent * (k + n) * x.itemsize * p / (p - 1)))   # (p-1)/p of it travels
        return [("all_to_all", a, nbytes, ph) for a in both for ph in phases]
    if node.target == aten.index.Tensor and node.fx_node.args[1][0] is not None:
        axes = _split_axes(strat.inputs[0], mesh_shape)
        if axes:
            meta = node.outputs[0]
            nbytes = math.prod(local_shape(meta.shape, strat.outputs[0], mesh_shape)) * meta.itemsize
            return [("all_to_all", a, nbytes, ph) for a in axes for ph in phases]
    return []
