"""Rewrite: the captured graph and a plan -> the program one rank runs.

Every tensor is held in its planned placement; between producer and consumer the conversion
steps of ``convert.transition`` (as ``cost.comm.transition`` prices them) appear as explicit calls
(``all_gather``, ``reduce_scatter``, ...) whose backward is the dual step. Graph inputs arrive whole and are cut to the rank's share,
or arrive as the rank's own rows (``inputs="local"``, ``Plan.arrival``) and are converted from there;
outputs leave whole, or as DTensors in their planned layouts, or (a pipeline stage's) as each rank's
share in their crossing layouts (``autoshard.outputs``). Each op runs on local tensors; the few whose local form differs (sizes in
their arguments, means over a split dim, random draws, a mean loss over a split batch) are
lowered by a small function from ``LOWERINGS``.
"""
from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx

from autoshard import placement as pl
from autoshard.runtime import experts, scans
from autoshard import runtime
from autoshard.convert import rank_sizes
from autoshard.cost import attention, comm
from autoshard.outputs import SENT, WHOLE, kept_split
from autoshard.runtime.outputs import to_dtensor
from autoshard.passes.functionalize import SHARED_STORAGE, copied
from autoshard.ir import Graph, TensorMeta
from autoshard.plan import Plan
from autoshard.rules.nn import MEAN, count_axes, whole_targets
from autoshard.rules.conv import CONV_ARGS, batch_norm_axes, conv_groups
from autoshard.rules import flex
from autoshard.rules.indexing import scan_axes
from autoshard.rules.moe import SORTS, TRANSFORMERS_GROUPED_MM, is_split_sort, sort_args
from autoshard.rules.pointwise import NEW_SIZED
from autoshard.rules.registry import norm_dim, qualified_name

aten = torch.ops.aten


class Lowering:
    """What a lowering function sees: the op, its rewritten arguments, its global shapes and its
    chosen placements, and the captured graph."""

    def __init__(self, g, node, args, kwargs, in_pl, out_pl, in_shapes, out_shapes, mesh_shape, graph=None,
                 coords=None, balanced=frozenset()):
        self.g, self.node, self.args, self.kwargs, self.graph = g, node, args, kwargs, graph
        self.in_pl, self.out_pl, self.in_shapes, self.out_shapes = in_pl, out_pl, in_shapes, out_shapes
        self.mesh_shape, self.coords = mesh_shape, coords
        self.balanced = balanced   # attention nodes whose causal work the plan balances

    def local_out(self, i=0):
        return list(_rank_shape(self.out_shapes[i], self.out_pl[i], self.mesh_shape, self.coords))

    def local_in(self, i=0):
        return list(_rank_shape(self.in_shapes[i], self.in_pl[i], self.mesh_shape, self.coords))

    def call(self, target=None, args=None, kwargs=None):
        return self.g.call_function(target or self.node.target, tuple(self.args if args is None else args),
                                    dict(self.kwargs if kwargs is None else kwargs))

    def arg(self, index, name, default=None):
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)


def _with_arg(low: Lowering, index: int, name: str, value):
    args, kwargs = list(low.args), dict(low.kwargs)
    if len(args) > index:
        args[index] = value
    else:
        kwargs[name] = value
    return args, kwargs


def lower_sized(low: Lowering):
    """view / reshape / expand / new_zeros: the size argument becomes this rank's output shape."""
    args, kwargs = _with_arg(low, 1, "size" if low.node.target != aten.reshape.default else "shape", low.local_out())
    return low.call(args=args, kwargs=kwargs)


def lower_unflatten(low: Lowering):
    dim = norm_dim(low.arg(1, "dim"), len(low.in_shapes[0]))
    sizes = low.arg(2, "sizes")
    args, kwargs = _with_arg(low, 2, "sizes", low.local_out()[dim:dim + len(sizes)])
    return low.call(args=args, kwargs=kwargs)


def lower_split(low: Lowering):
    """split / split_with_sizes: a dim cut in blocks (S(d)/g) is split locally into its blocks'
    local parts, so the sizes become this rank's."""
    dim = norm_dim(low.arg(2, "dim", 0), len(low.in_shapes[0]))
    sizes = [low.local_out(i)[dim] for i in range(len(low.out_shapes))]
    if low.node.target == aten.split.Tensor:
        args, kwargs = _with_arg(low, 1, "split_size", sizes[0])
    else:
        args, kwargs = _with_arg(low, 1, "split_sizes", sizes)
    return low.call(args=args, kwargs=kwargs)


def lower_as(low: Lowering):
    """view_as / expand_as: the other tensor's whole shape is not this rank's; use the local one."""
    target = aten.view.default if low.node.target == aten.view_as.default else aten.expand.default
    return low.call(target, (low.args[0], low.local_out()), {})


def lower_squeeze(low: Lowering):
    """Squeeze only the dims that are 1 in the whole tensor: a split dim may be 1 locally."""
    shape = low.in_shapes[0]
    if low.node.target == aten.squeeze.default:
        dims = list(range(len(shape)))
    else:
        d = low.arg(1, "dim")
        dims = [d] if isinstance(d, int) else list(d)
    dims = [norm_dim(d, len(shape)) for d in dims]
    return low.call(aten.squeeze.dims, (low.args[0], [d for d in dims if d < len(shape) and shape[d] == 1]), {})  # 0-d: no dims


def _mean_scale(low: Lowering, reduced_dims) -> float:
    """A mean over a dim split by an axis, left partial there: each rank's mean counts only its
    share of the elements, so scale it by that share (this rank's own where the split is uneven:
    its chunk over the whole dim, so the partial means sum to the mean over the whole size)."""
    scale = 1.0
    local = low.local_in(0)
    for d in {p.dim for p in low.in_pl[0] if isinstance(p, pl.Split) and p.dim in reduced_dims}:
        if all(isinstance(low.out_pl[0][a], pl.Partial) for a, p in enumerate(low.in_pl[0])
               if isinstance(p, pl.Split) and p.dim == d):
            scale *= local[d] / low.in_shapes[0][d]
    return scale


def _scaled(low: Lowering, out, scale):
    return out if scale == 1.0 else low.g.call_function(aten.mul.Tensor, (out, scale))


def lower_mean(low: Lowering):
    nd = len(low.in_shapes[0])
    dims = low.arg(1, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        reduced = set(range(nd))
    else:
        reduced = {norm_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims)}
    return _scaled(low, low.call(), _mean_scale(low, reduced))


def lower_pointwise_loss(low: Lowering):
    scale = _mean_scale(low, set(range(len(low.in_shapes[0])))) if low.arg(2, "reduction", MEAN) == MEAN else 1.0
    return _scaled(low, low.call(), scale)


def lower_dropout(low: Lowering):
    """A dropout that draws (p > 0, training) becomes ``runtime.dropout``; one that draws nothing
    becomes its input itself, as aten's returns it (no copy, the gradient passed through): a
    runtime call would cut the compiled regions around it (passes.compile) for nothing."""
    p, train = low.arg(1, "p"), low.arg(2, "train")
    if train is False or (isinstance(p, (int, float)) and p == 0):
        return low.args[0]
    return low.g.call_function(runtime.dropout, (low.args[0], low.arg(1, "p"), low.arg(2, "train"),
                                                 pl.to_strings(low.in_pl[0])))


def lower_cross_entropy(low: Lowering):
    axes = count_axes(low.node.target, low.node.fx_node.args, low.node.fx_node.kwargs, low.in_pl)
    axes = [a for a in axes if low.mesh_shape[a] > 1]
    if not axes:
        return low.call()
    whole = whole_targets(low.graph, low.node) if low.graph is not None else None
    if whole is not None:   # the input fed whole to every rank: count there, no all-reduce
        whole = next(n for n in low.g.nodes if n.op == "placeholder" and n.target == whole)
        whole = None if whole.meta.get("arrived") else whole   # a rank's rows only (inputs="local")
    return low.g.call_function(runtime.cross_entropy_mean, (
        low.args[0], low.args[1], low.arg(2, "weight"), low.arg(4, "ignore_index", -100),
        low.arg(5, "label_smoothing", 0.0), tuple(axes), whole))


def lower_conv(low: Lowering):
    """A grouped convolution split on its channels holds whole groups on each rank: groups / q
    of them, for the q ranks that share the channels."""
    groups, _ = conv_groups(low.node.target, low.args, low.kwargs)
    channel = 1 if len(low.in_shapes[0]) == len(low.in_shapes[1]) else 0
    q = pl.split_factor(low.in_pl[0], low.mesh_shape, channel)
    if groups == 1 or q == 1:
        return low.call()
    args, kwargs = _with_arg(low, CONV_ARGS[low.node.target][0], "groups", groups // q)
    return low.call(args=args, kwargs=kwargs)


_LAYOUT_STEPS = (runtime.to_local, *runtime.STEP_FUNCTIONS.values())
USER_INPUT = "user_input"   # meta of the node holding an input that arrived as a rank's rows, once converted


def _fed_whole(arg):
    """The placeholder of the buffer ``arg`` comes from: buffers are fed whole to every rank, so
    an in-place update through it reaches the module's buffer whatever layout the plan keeps."""
    node = arg
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _LAYOUT_STEPS:
        node = node.args[0]
    fed = isinstance(node, fx.Node) and node.op == "placeholder"
    if fed and any(u.target is runtime.to_local for u in node.users):
        return node
    return arg


def lower_batch_norm(low: Lowering):
    """Training mode: over a split batch (or other non-channel dim), the statistics of the whole
    batch (``runtime.batch_norm_train``); running statistics updated in the module's buffers."""
    if not low.arg(5, "training"):
        return low.call()
    args, kwargs = list(low.args), dict(low.kwargs)
    for i, name in ((3, "running_mean"), (4, "running_var")):
        if len(args) > i:
            args[i] = _fed_whole(args[i])
        elif kwargs.get(name) is not None:
            kwargs[name] = _fed_whole(kwargs[name])
    stat, channel = batch_norm_axes(low.node.target, args, kwargs, low.in_pl[0])
    if not any(low.mesh_shape[a] > 1 for a in stat + channel):
        return low.call(args=args, kwargs=kwargs)
    tensors = [args[i] if len(args) > i else kwargs.get(n) for i, n in
               enumerate(("input", "weight", "bias", "running_mean", "running_var"))]
    return low.g.call_function(runtime.batch_norm_train, (
        *tensors, low.arg(6, "momentum"), low.arg(7, "eps"), pl.to_strings(low.in_pl[0])))


def lower_grouped_mm(low: Lowering):
    """An expert matmul with its rows or its experts split (rules.moe): ``experts.grouped_mm``
    takes this rank's rows and experts, and exchanges rows where one axis splits both."""
    def axes(i):
        return tuple(a for a, q in enumerate(low.in_pl[i])
                     if isinstance(q, pl.Split) and q.dim == 0 and low.mesh_shape[a] > 1)
    rows, owned = axes(0), axes(1)
    if not rows and not owned:
        return low.call()
    both = tuple(a for a in rows if a in owned)   # named axis=: a group over several is made ahead
    return low.g.call_function(experts.grouped_mm, (low.args[0], low.args[1], low.arg(2, "offs"), rows, owned),
                               {"axis": both, "out_dtype": low.kwargs.get("out_dtype")})


def lower_index(low: Lowering):
    """Rows of x split on dim 0 taken by one whole index (rules.indexing): ``experts.gather_rows``."""
    axes = tuple(a for a, q in enumerate(low.in_pl[0])
                 if isinstance(q, pl.Split) and q.dim == 0 and low.mesh_shape[a] > 1)
    if not axes or low.args[1][0] is None:   # dim 0 not indexed: the op on local tensors
        return low.call()
    # this rank's chunk of the positions it holds is its chunk of the output only where the axes
    # that split the index come before those that split x (rules.indexing.index): a plan made
    # otherwise (one saved by an older version) would put rows in the wrong places
    positions = [a for a, q in enumerate(low.in_pl[1])
                 if isinstance(q, pl.Split) and low.mesh_shape[a] > 1]
    if positions and max(positions) > min(axes):
        raise ValueError(f"node {low.node.name!r} takes rows of x split over mesh axes {list(axes)} at an index "
                         f"split over axes {positions}; the index may be split only by axes before x's "
                         "(its rows would come out in the wrong order): plan again")
    return low.g.call_function(experts.gather_rows, (low.args[0], low.args[1][0]), {"axis": axes})


def lower_cumsum(low: Lowering):
    """A cumsum along a split dim (rules.indexing.cumsum): ``scans.cumsum`` adds the earlier
    ranks' totals."""
    if not low.in_shapes[0]:
        return low.call()
    dim = norm_dim(low.arg(1, "dim"), len(low.in_shapes[0]))
    axes = scan_axes(low.in_pl[0], dim, low.mesh_shape)
    if not axes:
        return low.call()
    return low.g.call_function(scans.cumsum, (low.args[0], dim, low.arg(2, "dtype")), {"axis": axes})


def lower_sort(low: Lowering):
    """A 1-d sort or argsort of integer keys split on its dim (rules.moe.sort): the counting sort
    of ``scans.sort``."""
    axes = scan_axes(low.in_pl[0], 0, low.mesh_shape)
    if not axes or not is_split_sort(low.node.target, low.node.fx_node.args, low.in_shapes):
        return low.call()
    _, descending = sort_args(low.node.target, low.args, low.kwargs)
    values = low.node.target in (aten.sort.default, aten.sort.stable)
    return low.g.call_function(scans.sort, (low.args[0], descending), {"axis": axes, "values": values})


def lower_histc(low: Lowering):
    return low.call(experts.histc)


def lower_copy(low: Lowering):
    return low.g.call_function(copied, (low.args[0], low.args[1]))


def lower_flex(low: Lowering):
    """FlexAttention on the rank's rows or heads (rules.flex): the op itself, its score and mask
    mods (subgraphs of the captured program, which the rank's program cannot name) bound in."""
    q, k, v, score_mod, block, scale, options, score_bufs, mask_bufs = flex.parts(low.args)
    captured = flex.parts(low.node.fx_node.args)
    mods = flex.module_of(captured[3]), flex.module_of(tuple(captured[4])[-1])
    return low.g.call_function(flex.bound(*mods), (q, k, v, tuple(block)[:-1], scale, options, score_bufs, mask_bufs))


def lower_sdpa(low: Lowering):
    """Attention with the queries split along the sequence (rules.nn.sdpa, context parallelism).
    Keys and values whole (Llama 3's form): causal attention offsets its mask by this rank's first
    query (``runtime.causal_attention``). Keys and values split along the sequence too: they go
    round the ring of the axes that split them (``runtime.ring_attention``), each block's first
    key's position known from its coordinates."""
    seq = len(low.in_shapes[0]) - 2
    kseq = len(low.in_shapes[1]) - 2
    if low.arg(4, "dropout_p", 0.0):
        return _lower_dropped(low, seq)
    ring = tuple(a for a, q in enumerate(low.in_pl[1])
                 if isinstance(q, pl.Split) and q.dim == kseq and low.mesh_shape[a] > 1)
    if ring:
        return _lower_ring(low, seq, kseq, ring)
    balance = _balance(low, seq)
    if balance is not None:
        return low.g.call_function(runtime.balanced_attention, (
            *low.args[:3], low.arg(6, "scale"), low.arg(7, "enable_gqa", False),
            pl.rank_start(low.in_shapes[0], low.in_pl[0], low.mesh_shape, low.coords, seq), *balance,
            low.arg(3, "attn_mask")))
    if not low.arg(5, "is_causal", False) or pl.split_factor(low.in_pl[0], low.mesh_shape, seq) == 1:
        return low.call()
    if low.coords is None:
        raise ValueError(f"node {low.node.name!r} is causal attention on a part of the sequence: "
                         "rewrite(..., coords=) needs this rank's mesh coordinate")
    start = pl.rank_start(low.in_shapes[0], low.in_pl[0], low.mesh_shape, low.coords, seq)
    return low.g.call_function(runtime.causal_attention, (
        *low.args[:3], low.arg(3, "attn_mask"), low.arg(4, "dropout_p", 0.0), low.arg(6, "scale"),
        low.arg(7, "enable_gqa", False), start))


def _lower_dropped(low: Lowering, seq: int):
    """Attention that drops probabilities, in any layout (rules.nn.sdpa: keys whole along the
    sequence): its dropout drawn whole from the generator all ranks share, this rank's part kept
    (``runtime.attention_dropout``), so it draws what one device draws; causal queries offset to
    this rank's first."""
    causal = bool(low.arg(5, "is_causal", False))
    start = 0
    if causal and pl.split_factor(low.in_pl[0], low.mesh_shape, seq) > 1:
        if low.coords is None:
            raise ValueError(f"node {low.node.name!r} is causal attention on a part of the sequence: "
                             "rewrite(..., coords=) needs this rank's mesh coordinate")
        start = pl.rank_start(low.in_shapes[0], low.in_pl[0], low.mesh_shape, low.coords, seq)
    return low.g.call_function(runtime.attention_dropout, (
        *low.args[:3], low.arg(3, "attn_mask"), low.arg(4, "dropout_p"), causal, low.arg(6, "scale"),
        low.arg(7, "enable_gqa", False), start, pl.to_strings(low.out_pl[0])))


def _balance(low: Lowering, seq: int):
    """(the partner's first query's position, the axis) where the plan balances causal
    attention's work (``plan.schedule["balanced_attention"]``, runtime.attention): causal, no
    dropout, the queries' sequence split by one axis into even halves; None elsewhere."""
    if not low.balanced or low.node.name not in low.balanced:
        return None
    a = attention.balance_axis(low.in_shapes[0], low.in_pl[0], low.mesh_shape, low.arg(5, "is_causal", False),
                               low.arg(4, "dropout_p", 0.0))
    if a is None or low.coords is None:
        return None
    partner = list(low.coords)
    partner[a] = low.mesh_shape[a] - 1 - partner[a]
    return pl.rank_start(low.in_shapes[0], low.in_pl[0], low.mesh_shape, partner, seq), a


def _lower_ring(low: Lowering, seq: int, kseq: int, ring: tuple):
    if low.coords is None:
        raise ValueError(f"node {low.node.name!r} is ring attention: rewrite(..., coords=) needs this rank's "
                         "mesh coordinate")
    starts = []
    for at in itertools.product(*(range(low.mesh_shape[a]) for a in ring)):
        coords = list(low.coords)
        for a, c in zip(ring, at):
            coords[a] = c
        starts.append((tuple(coords), pl.rank_start(low.in_shapes[1], low.in_pl[1], low.mesh_shape, coords, kseq)))
    causal = bool(low.arg(5, "is_causal", False))
    q_start = pl.rank_start(low.in_shapes[0], low.in_pl[0], low.mesh_shape, low.coords, seq)
    return low.g.call_function(runtime.ring_attention, (
        *low.args[:3], low.arg(6, "scale"), causal, q_start, tuple(starts), ring, _balance(low, seq),
        low.arg(3, "attn_mask")))


def default(low: Lowering):
    return low.call()


LOWERINGS = {
    aten.view.default: lower_sized,
    aten.reshape.default: lower_sized,
    aten._unsafe_view.default: lower_sized,
    aten.expand.default: lower_sized,
    **{op: lower_sized for op in NEW_SIZED},   # new_zeros(x, size), ...: a split output's share
    aten.unflatten.int: lower_unflatten,
    aten.split.Tensor: lower_split,
    aten.split_with_sizes.default: lower_split,
    aten.view_as.default: lower_as,
    aten.expand_as.default: lower_as,
    aten.squeeze.default: lower_squeeze,
    aten.squeeze.dim: lower_squeeze,
    aten.squeeze.dims: lower_squeeze,
    aten.mean.default: lower_mean,
    aten.mean.dim: lower_mean,
    aten.mse_loss.default: lower_pointwise_loss,
    aten.l1_loss.default: lower_pointwise_loss,
    aten.smooth_l1_loss.default: lower_pointwise_loss,
    aten.huber_loss.default: lower_pointwise_loss,
    aten.dropout.default: lower_dropout,
    aten.cross_entropy_loss.default: lower_cross_entropy,
    aten.batch_norm.default: lower_batch_norm,
    aten.copy.default: lower_copy,   # a copy_ functionalized
    **{op: lower_conv for op in CONV_ARGS},
    aten._grouped_mm.default: lower_grouped_mm,
    aten.histc.default: lower_histc,
    aten.cumsum.default: lower_cumsum,
    **{op: lower_sort for op in SORTS},
    aten.index.Tensor: lower_index,
    flex.FLEX: lower_flex,
    aten.scaled_dot_product_attention.default: lower_sdpa,
}
# ops registered by a library once imported, by qualified name (rules.registry.RULES_BY_NAME)
LOWERINGS_BY_NAME = {TRANSFORMERS_GROUPED_MM: lower_grouped_mm}


def lowering_for(target):
    found = LOWERINGS.get(target)
    if found is None:
        found = LOWERINGS_BY_NAME.get(qualified_name(target), default)
    return found


def _rank_shape(shape, placement, mesh, coords):
    """The shape this rank holds: every rank's where the splits are even, else the chunk its mesh
    coordinate ``coords`` holds (DTensor's layout)."""
    if pl.is_even(shape, placement, mesh):
        return pl.local_shape(shape, placement, mesh)
    if coords is None:
        raise ValueError(f"a tensor of shape {list(shape)} is split unevenly as {pl.format_nd(placement)}: "
                         "rewrite(..., coords=) needs this rank's mesh coordinate")
    return pl.rank_shape(shape, placement, mesh, coords)


def _converted(g, x, meta, src, dst, mesh, links, coords) -> tuple:
    """(x converted from ``src`` to ``dst``, the steps, whether both are even): the steps the cost
    model priced, each rank told its chunks' sizes where a split is uneven."""
    steps = comm.transition(pl.local_shape(meta.shape, src, mesh), src, dst, mesh, links, meta.itemsize,
                            whole=meta.shape)
    even = all(pl.is_even(meta.shape, q, mesh) for q in (src, dst))
    return _emit_conversion(g, x, steps, None if even else rank_sizes(meta.shape, src, steps, mesh, coords)), steps, even


def _emit_conversion(g, x, steps, sizes=None):
    for st, kw in zip(steps, sizes or [{}] * len(steps)):
        fn = runtime.STEP_FUNCTIONS[st.kind]
        kwargs = {"axis": st.axis, **kw}
        if st.dim is not None:
            kwargs["dim"] = st.dim
        if st.dim2 is not None:
            kwargs["dim2"] = st.dim2
        if st.groups != 1:
            kwargs["groups"] = st.groups
        x = g.call_function(fn, (x,), kwargs)
    return x


def _on_device(obj, device):
    """Every device an op's arguments name (``to(x, device)``, ``arange(..., device=)``) is the
    meta device the model was captured on: the rank's own device instead."""
    if isinstance(obj, torch.device):
        return torch.device(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_on_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _on_device(v, device) for k, v in obj.items()}
    return obj


def rewrite(graph: Graph, plan: Plan, device=None, coords=None) -> fx.GraphModule:
    """The per-rank program. Placeholders: parameters (local shards), buffers and the user inputs
    that hold a tensor (whole, or the rank's rows where the plan says they arrive so:
    ``Plan.arrival``), in ``graph.nodes`` order. ``coords``: the rank's mesh coordinate,
    which a plan with uneven splits needs (each rank's program holds its own chunks' sizes)."""
    mesh = tuple(plan.mesh_shape)
    links = plan.cluster.axis_links(mesh)   # conversions take the steps the cost model priced
    regather = plan.training and plan.schedule.get("reshard_after_forward", False)
    kept = kept_split(graph, plan.schedule.get("outputs", WHOLE))
    sent = plan.schedule.get("outputs", WHOLE) == SENT
    balanced = frozenset(plan.schedule.get("balanced_attention", ()))
    g = fx.Graph()
    local: dict = {}        # Value -> fx node holding it in its producer's placement
    converted: dict = {}    # (Value, placement) -> fx node
    out_pl = {}             # Value -> placement
    arriving: list = []     # user inputs that arrive as the rank's rows (Plan.arrival), to convert
    for node in graph.nodes:
        choice = plan.nodes.get(node.name)
        if choice is None or [tuple(s) for s in choice.shapes] != [m.shape for m in node.outputs]:
            raise ValueError(f"the plan does not fit node {node.name!r} of this model: it was made for "
                             "another model or other input shapes; plan again with these")
        outs = choice.out_placements()
        for i, p in enumerate(outs):
            out_pl[(node.name, i)] = p
        if node.kind in ("param", "buffer", "input"):
            if not node.outputs:  # a constant argument (a flag, None): the graph holds its value
                continue
            ph = g.placeholder(node.name)
            arrived = plan.arrival.get(node.name) if node.kind == "input" else None
            held = outs[0] if arrived is None else pl.parse_nd(arrived, len(mesh))
            ph.meta["local"] = TensorMeta(_rank_shape(node.outputs[0].shape, held, mesh, coords), node.outputs[0].dtype)
            if arrived is not None:   # the rank's own rows, converted once every placeholder is made
                ph.meta["arrived"] = True   # a user's rows, not a parameter's share (passes.schedule)
                arriving.append((node, ph, held, outs[0]))
                continue
            elif node.kind == "param":
                axes = tuple(a for a, p in enumerate(outs[0]) if isinstance(p, pl.Broadcast) and mesh[a] > 1)
                x = (g.call_function(runtime.grad_sync, (ph, axes), {"key": node.name})
                     if (plan.training and node.requires_grad and axes) else ph)
            else:
                x = g.call_function(runtime.to_local, (ph, pl.to_strings(outs[0])))
            local[(node.name, 0)] = x
            continue
        for n, ph, held, dst in arriving:   # as the plan priced them (Costs.arrival_times): the program's
            # first steps, after its placeholders, where the schedule starts what is ready at once
            x = _converted(g, ph, n.outputs[0], held, dst, mesh, links, coords)[0]
            x.meta[USER_INPUT] = n.name   # the input in its planned layout (passes.interleave)
            local[(n.name, 0)] = x
        arriving.clear()
        ins = choice.in_placements()
        mark = next(iter(reversed(g.nodes)), None)   # what this node's lowering adds comes after it

        def fetch(value, dst):
            key = (value, dst)
            if key not in converted or graph.by_name[value[0]].fx_node.meta.get(SHARED_STORAGE):   # written in place: afresh
                out, steps, even = _converted(g, local[value], graph.meta(value), out_pl[value], dst, mesh, links, coords)
                if steps and regather and even and graph.by_name[value[0]].kind == "param":
                    spec = tuple((st.kind, st.axis, st.dim, st.dim2, st.groups) for st in steps)
                    out = g.call_function(runtime.regather, (out, local[value], spec))
                converted[key] = out
            return converted[key]

        slot = [0]

        def map_one(a):
            v = graph.value_of.get(a)
            if v is None or isinstance(v, list):
                return None
            i = slot[0]
            slot[0] += 1
            if node.kind == "output" and sent:   # a pipeline stage's: handed on in the crossing layout
                return fetch(v, ins[i])
            if node.kind == "output" and v in kept:   # outputs="dtensor": handed back as planned
                return g.call_function(to_dtensor, (local[v], pl.to_strings(out_pl[v]), graph.meta(v).shape))
            if node.kind == "output" and not pl.is_even(graph.meta(v).shape, out_pl[v], mesh):
                return g.call_function(runtime.to_whole, (local[v], pl.to_strings(out_pl[v]), graph.meta(v).shape))
            if node.kind == "output":
                return g.call_function(runtime.to_whole, (local[v], pl.to_strings(out_pl[v])))
            return fetch(v, ins[i])

        args = fx.node.map_arg(node.fx_node.args, map_one)
        kwargs = fx.node.map_arg(node.fx_node.kwargs, map_one)
        if device is not None:  # captured on meta, runs here
            args, kwargs = _on_device(args, device), _on_device(kwargs, device)
        if node.kind == "output":
            g.output(args[0])
            continue
        low = Lowering(g, node, args, kwargs, ins, outs, [graph.meta(v).shape for v in node.inputs],
                       [m.shape for m in node.outputs], mesh, graph, coords, balanced)
        out = lowering_for(node.target)(low)
        if len(node.outputs) > 1 or isinstance(node.fx_node.meta.get("val"), (tuple, list)):
            for i in range(len(node.outputs)):
                local[(node.name, i)] = g.call_function(operator.getitem, (out, i))
        elif node.outputs:
            local[(node.name, 0)] = out
        for made in reversed(g.nodes):   # the captured node each program node serves (passes.checkpoint)
            if made is mark:
                break
            made.meta["source"] = node.name
    _views_that_may_copy(g)
    g.lint()
    gm = fx.GraphModule(torch.nn.Module(), g, class_name="RankProgram")
    gm.meta["passes"] = ["rewrite"]
    gm.meta["mesh_shape"] = mesh
    gm.meta["joint_axes"] = _joint_axes(g)
    return gm


def _views_that_may_copy(g: fx.Graph) -> None:
    """Each ``view`` that nothing writes through becomes a ``reshape``: the same view wherever the
    strides allow one, a copy where they do not. The capture saw the strides of the kernels a
    fake tensor of the device type picks (the CPU's attention returns its heads' rows interleaved,
    so ``.transpose(1, 2).contiguous()`` traced as no copy), and the run, on its local shapes and
    with gradients, may pick another kernel with other strides."""
    for n in g.nodes:
        if n.op == "call_function" and n.target is aten.view.default and not _written_through(n):
            n.target = aten.reshape.default


def _written_through(n: fx.Node) -> bool:
    """Whether an in-place op writes into ``n`` or into a view of it."""
    for u in n.users:
        target = getattr(u, "target", None)
        schema = getattr(target, "_schema", None)
        if schema is not None and (schema.is_mutable or u.target is aten.view.default and _written_through(u)):
            return True
    return False


def _joint_axes(g: fx.Graph) -> list:
    """The sets of several mesh axes the program runs a collective over at once (a gradient
    all-reduce over several axes, a conversion step over several): the runtime creates their groups."""
    joint = set()
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if n.target is runtime.grad_sync and len(n.args[1]) > 1:
            joint.add(tuple(n.args[1]))
        elif isinstance(n.kwargs.get("axis"), tuple):
            joint.add(n.kwargs["axis"])
    return sorted(joint)

