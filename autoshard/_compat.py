"""The private torch APIs autoshard needs, in one place.

torch.utils._pytree flattens and rebuilds nested inputs and outputs exactly as torch.export saw
them (ExportedProgram.call_spec holds its TreeSpecs); torch has no public equivalent yet.
Ring attention's blocks need attention's log-sum-exp beside its output, which only torch's
private fused kernels return (``attention_block``). Whether a tensor is a view of another
(``is_view``) has no public test.
"""
import contextlib

import torch
import torch.utils._pytree as _pytree
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten  # noqa: F401


def register_block_mask() -> None:
    """Let a FlexAttention ``BlockMask`` be an input (torchtitan builds its masks outside the
    model and passes them in): its tensors, and the tensors its mask mod closes over (a document
    mask's ids), become leaves that torch.export takes as inputs and the program shares out; its
    sizes and mod are the tree's context. BlockMask carries the flatten and unflatten functions
    for this (``_flatten``, ``_unflatten``, ``_flatten_with_keys``), which this torch does not
    register; a torch that registers them itself is left as it is."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return
    if BlockMask in _pytree.SUPPORTED_NODES or not all(
            hasattr(BlockMask, f) for f in ("_flatten", "_unflatten", "_flatten_with_keys")):
        return
    _pytree.register_pytree_node(BlockMask, BlockMask._flatten, BlockMask._unflatten,
                                 flatten_with_keys_fn=BlockMask._flatten_with_keys,
                                 serialized_type_name="torch.nn.attention.flex_attention.BlockMask")


register_block_mask()


def is_view(t) -> bool:
    """Whether ``t`` is a view of another tensor (its storage another's, its autograd a view's)."""
    return t._is_view()


def block_masks_closing_over_tensors(inputs) -> list:
    """The BlockMasks among ``inputs`` whose mask mod closes over tensors (a document mask's
    ids): torch.export lifts those as constants of the program and then refuses them."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return []
    masks = [x for x in _pytree.tree_leaves(inputs, is_leaf=lambda x: isinstance(x, BlockMask))
             if isinstance(x, BlockMask)]
    return [m for m in masks if len(_pytree.tree_leaves(m)) > sum(
        getattr(m, a, None) is not None for a in getattr(BlockMask, "_TENSOR_ATTRS", ()))]


def thread_local_c10d():
    """(install, uninstall, isolate) for running every rank of a group as a thread of this process
    (autoshard.testing.simulate). c10d keeps its groups in one process-wide registry and the functional
    collectives resolve a group by name in a C++ registry: install swaps the former for one per
    thread (torch's own, which its threaded test backend uses, so it follows c10d's changes),
    isolate(True) makes the latter per thread. Imported on use, so that a torch without them fails
    only the simulation, saying so."""
    try:
        from torch._C._distributed_c10d import _set_thread_isolation_mode
        from torch.testing._internal.distributed.multi_threaded_pg import (
            _install_threaded_pg, _uninstall_threaded_pg)
    except ImportError as e:
        import torch
        raise RuntimeError(
            f"autoshard.testing.simulate needs torch's thread-local process-group world (torch.testing._internal."
            f"distributed.multi_threaded_pg) and c10d's thread isolation mode, which torch {torch.__version__} "
            f"lacks ({e}). Run the ranks as processes instead: autoshard.testing.launch.LocalWorld.") from e
    return _install_threaded_pg, _uninstall_threaded_pg, _set_thread_isolation_mode


def blocked_shard(dim: int, groups: int, name: str = "a tensor"):
    """The DTensor placement of a blocked split S(dim)/groups on one mesh axis: the dim cut into
    ``groups`` blocks first and each block across the axis, which DTensor writes as a strided
    shard with split factor ``groups`` (the same on every axis that cuts the dim). DTensor has no
    public name for it yet, so whether this torch lays it out so is checked (once per split
    factor) on a small tensor: where it does not, ``name`` (the parameter's) gets an error that
    says what to change, not DTensor views (``full_tensor``, checkpoints) that disagree with the
    program's own shares."""
    from torch.distributed.tensor.placement_types import _StridedShard
    if groups not in _BLOCKED_LAYOUT_CHECKED:
        _check_blocked_layout(_StridedShard, groups, name)
        _BLOCKED_LAYOUT_CHECKED.add(groups)
    return _StridedShard(dim, split_factor=groups)


_BLOCKED_LAYOUT_CHECKED: set = set()


def _check_blocked_layout(strided, groups: int, name: str) -> None:
    import torch
    ranks = 2
    whole = torch.arange(groups * ranks * 2)
    want = [torch.cat([block.chunk(ranks)[r] for block in whole.chunk(groups)]) for r in range(ranks)]
    try:
        got = strided(0, split_factor=groups)._split_tensor(whole, ranks, with_padding=False)[0]
        same = len(got) == ranks and all(torch.equal(a, b) for a, b in zip(got, want))
    except Exception:   # a torch whose strided shard has no such method: unknown, so not trusted
        same = False
    if not same:
        raise RuntimeError(
            f"{name} is stored split by its {groups} blocks (each block across a mesh axis, as a fused "
            f"qkv is), which autoshard writes as DTensor's strided shard; torch {torch.__version__}'s "
            "DTensor does not lay that out as autoshard's program holds it, so p.full_tensor() and "
            "checkpoints would disagree with the training. Use torch 2.13 or later, or pin it whole "
            "on that axis ('B' there in its pin).")


def dtensor_like(p, local):
    """A DTensor of ``p``'s mesh, placements, shape and strides holding ``local``, which has this
    rank's share's shape and strides (a gradient of ``p``). ``DTensor.from_local`` builds the same
    through an autograd function and a new spec, 40 us a call in Python, paid for every parameter
    at every step; DTensor's constructor with ``p``'s spec costs a tenth of that, and its
    ``__new__`` alone (its ``__init__`` only enters and leaves dynamo's disable) half of that
    again. Where torch has no such constructor, from_local."""
    from torch.distributed.tensor import DTensor
    spec = getattr(p, "_spec", None)
    if spec is not None:
        try:   # __new__ alone: DTensor's __init__ does nothing but enter and leave dynamo's disable
            out = DTensor.__new__(DTensor, local, spec, requires_grad=False)
            if out._local_tensor is local:
                return out
        except (TypeError, AttributeError):
            pass
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def local_tensor(p):
    """The tensor a DTensor holds on this rank, the same object from call to call until the
    DTensor's data is replaced. ``to_local()`` under no_grad hands a Parameter's back as a fresh
    view (torch 2.13), a view op at every step; where torch keeps no ``_local_tensor``, that."""
    local = getattr(p, "_local_tensor", None)
    if local is None:
        import torch
        with torch.no_grad():
            local = p.to_local()
    return local


def set_collective_timeout(groups, seconds: float) -> None:
    """Bound every collective on ``groups`` to ``seconds``. A group's timeout is fixed when it is
    made (``new_group(timeout=)``; DeviceMesh's subgroups take torch's default, 30 minutes on
    gloo) and torch has no public way to change it after."""
    import datetime
    from torch.distributed.distributed_c10d import _set_pg_timeout
    for group in {id(g): g for g in groups}.values():
        _set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def blocked_pieces(dt):
    """The pieces of this rank's share of a DTensor stored with blocked splits (``blocked_shard``):
    ``[(offsets, sizes, view of the local tensor)]``, one per block (a fused qkv weight's share on
    one rank is a piece of q, one of k and one of v), or None for any other DTensor. The local
    tensor holds the pieces one after another along the split dim, block by block."""
    import itertools

    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
    places = dt.placements
    groups = {q.dim: q.split_factor for q in places if isinstance(q, _StridedShard)}
    if not groups:
        return None
    for q in places:   # only autoshard's pattern: every axis that cuts a blocked dim cuts it alike
        if q.is_shard() and q.dim in groups and (not isinstance(q, _StridedShard) or q.split_factor != groups[q.dim]):
            return None
    if any(dt.shape[d] % g for d, g in groups.items()):
        return None
    block = [s // groups.get(d, 1) for d, s in enumerate(dt.shape)]
    plain = [Shard(q.dim) if isinstance(q, _StridedShard) else q for q in places]
    sizes, offsets = compute_local_shape_and_global_offset(torch.Size(block), dt.device_mesh, plain)
    local, pieces = dt._local_tensor, []
    for index in itertools.product(*(range(groups.get(d, 1)) for d in range(dt.ndim))):
        view = local
        for d in groups:
            view = view.narrow(d, index[d] * sizes[d], sizes[d])
        at = torch.Size(o + i * b for o, i, b in zip(offsets, index, block))
        pieces.append((at, torch.Size(sizes), view))
    return pieces


def checkpoint_blocked_splits() -> None:
    """Teach DTensor's checkpoint protocol (the three methods torch.distributed.checkpoint asks a
    tensor for: its write items, its chunks, the tensor of one chunk) the blocked split. DTensor
    describes every rank's share as one chunk, which a blocked split's share is not (a piece of
    each block), so DCP refuses such a tensor ("overlapping chunks"). Here such a share is
    described piece by piece, each a view of the local tensor, so saving reads and loading writes
    the parameter (or its optimizer state) in place, and a checkpoint saved under one layout
    loads under any other. Any other DTensor goes through DTensor's own methods. Called once,
    when autoshard first makes such a parameter."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    import torch
    from torch.distributed.tensor import DTensor
    if getattr(DTensor, "_autoshard_blocked", False):
        return
    write_items, chunk_list, tensor_shard = (DTensor.__create_write_items__, DTensor.__create_chunk_list__,
                                             DTensor.__get_tensor_shard__)

    def create_write_items(self, fqn, obj):
        pieces = blocked_pieces(self)
        if pieces is None:
            return write_items(self, fqn, obj)
        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [WriteItem(index=MetadataIndex(fqn, at), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=at, sizes=sizes),
                                                      properties=props, size=self.size()))
                for at, sizes, _ in pieces]

    def create_chunk_list(self):
        pieces = blocked_pieces(self)
        if pieces is None:
            return chunk_list(self)
        return [ChunkStorageMetadata(offsets=at, sizes=sizes) for at, sizes, _ in pieces]

    def get_tensor_shard(self, index):
        pieces = blocked_pieces(self)
        if pieces is None:
            return tensor_shard(self, index)
        for at, _, view in pieces:
            if index.offset is None or torch.Size(index.offset) == at:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no piece at offset {list(index.offset)}")

    DTensor.__create_write_items__ = create_write_items
    DTensor.__create_chunk_list__ = create_chunk_list
    DTensor.__get_tensor_shard__ = get_tensor_shard
    DTensor._autoshard_blocked = True


def autocast_casts(target, args, kwargs, device_type: str, dtype) -> list:
    """The casts ``torch.autocast(device_type, dtype)`` makes of the tensor arguments of the op
    ``target`` called with ``args`` and ``kwargs`` (meta tensors): ``[(argument, dtype)]``.

    torch.export traces above autocast, so its program shows none of them, and autocast's op
    lists are not public: the op is run once on fake tensors of the same shapes under autocast,
    and the casts it makes are read off the dispatcher (FakeTensorMode and TorchDispatchMode are
    private). Meta tensors have no autocast key; a fake CPU tensor has, so a device type other
    than the CPU's is read off CPU autocast's lists with the same dtype (their matmuls,
    convolutions and attention agree)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map
    from torch.utils._python_dispatch import TorchDispatchMode

    made: dict = {}   # id(fake) -> the meta argument it stands for

    class _Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts = []

        def __torch_dispatch__(self, func, types, a=(), k=None):
            k = k or {}
            if func is torch.ops.aten._to_copy.default and a and id(a[0]) in made and "dtype" in k:
                self.casts.append((made[id(a[0])], k["dtype"]))
            return func(*a, **k)

    with FakeTensorMode(allow_non_fake_inputs=False):
        def fake(x):
            if isinstance(x, torch.Tensor):
                f = torch.empty(x.shape, dtype=x.dtype)
                made[id(f)] = x
                return f
            return x
        fargs, fkwargs = tree_map(fake, (args, kwargs))
        log = _Log()
        with torch.autocast("cpu", dtype=dtype), log:
            target(*fargs, **fkwargs)
    return log.casts


def tag_checkpoint_regions():
    """A context under which every ``torch.utils.checkpoint.checkpoint`` call marks the nodes
    torch.export traces inside it with ``meta["custom"]["autoshard_region"]``, a number per call
    (an inner call within an outer one keeps the outer's: recomputing the outer recomputes it).

    Non-strict export runs the checkpointed function as plain Python, so its program keeps no
    trace of the region; checkpoint's two implementations (``_checkpoint_without_reentrant_generator``
    and ``CheckpointFunction``) are module globals it looks up at each call, wrapped here for the
    capture's duration, and the nodes tagged through fx's node-meta annotation."""
    import contextlib

    import torch.fx.traceback as fxt
    import torch.utils.checkpoint as ckpt

    @contextlib.contextmanager
    def tagging():
        count = [0]
        depth = [0]

        @contextlib.contextmanager
        def region():
            if depth[0]:
                depth[0] += 1
                try:
                    yield
                finally:
                    depth[0] -= 1
                return
            count[0] += 1
            depth[0] += 1
            try:
                with fxt.preserve_node_meta(), fxt.annotate({"autoshard_region": count[0]}):
                    yield
            finally:
                depth[0] -= 1

        plain, reentrant = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction

        def without_reentrant(fn, *args, **kwargs):   # traced, not run: nothing to save or recompute
            with region():
                yield

        class Reentrant:
            @staticmethod
            def apply(function, preserve, *args):
                with region():
                    return function(*args)

        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = without_reentrant, Reentrant
        try:
            yield
        finally:
            ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = plain, reentrant

    return tagging()


def cpu_memory_peak(fn) -> int:
    """The most bytes the CPU allocator held at once while ``fn()`` ran, above what it held when
    it began: from the profiler's allocation and free events, in time order (the profiler's
    memory timeline is built for CUDA; its raw events are the only public-ish record on CPU)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def copy_all(dst: list, src: list) -> None:
    """``d.copy_(s)`` for each pair, in one call where torch has its foreach copy (one dispatch
    and, between tensors of one dtype on a GPU, one kernel launch for them all)."""
    import torch
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s)


def custom_op_overload(op):
    """The OpOverload that ``torch.library.custom_op`` made for the function it returns: the
    function holds it only as a private attribute (``rules.custom.register`` takes either)."""
    return op._opoverload


def attention_block(q, k, v, scale: float, mask):
    """(output, log-sum-exp over the keys) of attention of ``q`` (b, h, n, e) to one block of
    keys and values (b, h, m, e), ``mask`` additive (broadcast to (b, h, n, m)) or None: ring
    attention's block. torch's CPU flash kernel gives both (a private op: runtime.attention's only
    way to a fused block with its log-sum-exp); other devices compute it from matmuls. A row that
    sees no key here is the caller's to mend (the kernel's log-sum-exp of it is not -inf)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                            scale=scale)
        return out, lse
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - _finite(lse)[..., None]), v), lse


def _finite(x):
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def attention_block_backward(grad, q, k, v, out, lse, scale: float, mask, scores_grad: bool = False):
    """(dq, dk, dv) of one block, given the output and log-sum-exp over every block (so each
    block's share of the gradients is exact; finite: a row that sees no key has 0 there). With
    ``scores_grad`` also the gradient of the block's scores (b, h, n, m): an additive mask's, from
    matmuls (the CPU kernel gives none)."""
    if q.device.type == "cpu" and not scores_grad:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), grad)
    ds = p * (torch.matmul(grad, v.transpose(-1, -2)) - (grad * out).sum(-1, keepdim=True))
    parts = (torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv)
    return parts + (ds,) if scores_grad else parts


# ---- functional collectives: what a traced program issues ------------------------------------------
#
# Under torch.compile (dynamo tracing a user's ``torch.compile(parallel_module)``, or the program
# compiled whole by ``compile=True``) the runtime issues its collectives as c10d's functional ops:
# each returns a new tensor and is waited on by ``wait_tensor``, the start and the wait two nodes of
# the traced graph where the program puts them, and each has its dual as its autograd (all-gather
# <-> reduce-scatter, all-reduce <-> all-reduce, all-to-all <-> the reverse all-to-all: torch 2.10+
# registers it on the ops). torch's public wrappers (``_functional_collectives.all_gather_tensor``
# ...) wait at once when traced, so the ops are called directly; they have no public name yet.

def functional_collective(kind: str, x, group, p: int, out_splits=None, in_splits=None):
    """Start the dim-0 collective ``kind`` on ``x`` over ``group`` (of ``p`` ranks), summing where it
    reduces; the result is read through ``wait_collective``. ``all_to_all``: ``out_splits`` and
    ``in_splits`` the rows received from and sent to each rank (None: equal)."""
    import torch
    ops, name = torch.ops._c10d_functional, group.group_name
    if kind == "all_gather":
        return ops.all_gather_into_tensor(x, p, name)
    if kind == "reduce_scatter":
        return ops.reduce_scatter_tensor(x, "sum", p, name)
    if kind == "all_reduce":
        return ops.all_reduce(x, "sum", name)
    if kind == "all_to_all":
        if out_splits is None:
            out_splits = in_splits = [x.shape[0] // p] * p
        return ops.all_to_all_single(x, list(out_splits), list(in_splits), name)
    raise ValueError(kind)


def wait_collective(t):
    """The result of a collective ``functional_collective`` started, once it is done."""
    import torch
    return torch.ops._c10d_functional.wait_tensor(t)


def comm_overlap_options() -> dict:
    """Inductor's options (``torch.compile(options=)``) that reorder a compiled program's
    collectives against its compute: each wait sunk to the first use of its result and each start
    raised as early as its data and the peak memory allow, never two collectives swapped (every
    rank issues them in one order). Unset, inductor runs the graph's nodes nearly in the order
    traced, and a backward's gradient all-reduce waits before the weight gradient that does not
    need it. The option names are inductor's configuration, not a public API."""
    import torch._inductor.config as inductor
    if not hasattr(inductor, "reorder_for_compute_comm_overlap_passes"):
        return {}
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": ["reorder_communication_preserving_peak_memory",
                                                        "sink_waits_iterative",
                                                        "reorder_communication_preserving_peak_memory"]}


def compiled_within(fn):
    """``fn``, whose own frame ``torch.compile`` runs as Python while compiling the frames it calls
    (``torch.compiler.disable(recursive=False)``'s meaning). That decorator's wrapper hands
    ``fn``'s frame to dynamo at every call, which looks it over again each time (0.26 ms here);
    marking the code itself skipped costs nothing. Dynamo's ``skip_code``; no public one (where it
    is missing, the public decorator)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return torch.compiler.disable(fn, recursive=False)
    skip_code(fn.__code__)
    return fn


def generated_code(fn) -> tuple:
    """(``fn()``, the source of every program inductor generated while it ran: a compiled
    forward's, and its backward's where ``fn`` runs backward), to read the order a compiled
    program issues its kernels and collectives in. Inductor's own test helper; no public one."""
    from torch._inductor.utils import run_and_get_code
    return run_and_get_code(fn)


def graphs_compiled() -> int:
    """How many graphs ``torch.compile`` has compiled in this process so far (dynamo's count, each
    a graph handed to its backend), to show what a call compiles. Dynamo's counters; no public
    one."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def guards_built(into: list):
    """Append to ``into``, for each frame dynamo compiles inside, its guard tree and the frame's
    locals it was built against, to read the tree's size (``str``) and time its check
    (``guards.check(locals)``) after. Dynamo's testing hook; no public one."""
    import torch._dynamo.guards as guards
    before = guards.guard_manager_testing_hook_fn
    guards.guard_manager_testing_hook_fn = lambda manager, scope, builder: into.append((manager, scope))
    try:
        yield into
    finally:
        guards.guard_manager_testing_hook_fn = before
