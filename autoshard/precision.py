"""Mixed precision written into the captured graph as casts, so the plan prices what runs.

torch.export traces every op at the dtypes of its inputs: neither a ``MixedPrecisionPolicy`` nor
the caller's ``torch.autocast`` shows in its program. ``make_explicit`` writes them in as
``aten._to_copy`` nodes, and every node's dtype follows:

    mp_policy   each floating parameter cast to ``param_dtype`` where the graph takes it (the
                parameter stays a full-precision master: the optimizer steps it, its gradient
                arrives in its own dtype through the cast's backward); floating user inputs cast
                to ``param_dtype`` (``cast_forward_inputs``); floating outputs to ``output_dtype``
    autocast    each op run under an enabled autocast (the caller's, around the call, or a
                region of the model's own) gets the casts autocast makes of its arguments, one
                copy per tensor and dtype shared by its users

Matmuls then run on 16-bit tensors (priced at the cluster's 16-bit peak, ``Cluster.matmul_flops``),
every collective moves its tensor's real bytes, and the memory model counts the masters at their
dtype and the low-precision copies as the activations they are. The program runs the casts as
ops, so it computes the same whether or not the caller's autocast is still on around it.

Gradient reduction (``reduce_dtype``): a parameter's gradient arrives reduced in the dtype of
what the plan converts: a parameter stored broadcast is all-reduced where its master is fed to
the program, so the runtime casts the gradient to ``reduce_dtype`` for that all-reduce
(``runtime.grad_sync``, ``grad_bucket``); a parameter gathered after its cast (FSDP's bf16
gather) gets the dual reduce-scatter of its copy's gradient, which runs in ``reduce_dtype`` too
(a scheduled gather bucket, ``runtime.bucket_start``; outside one, ``runtime.step_start``'s cast
or ``runtime.cast_all_gather``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from autoshard._compat import autocast_casts, tree_flatten, tree_unflatten

aten = torch.ops.aten
AUTOCAST = "autoshard_autocast"   # node meta: the autocast dtype of the region it was traced in, None when off
CAST = aten._to_copy.default


def check_policy(mp_policy):
    """``mp_policy`` as given, or a TypeError/ValueError saying what to pass."""
    if mp_policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy is a torch.distributed.fsdp.MixedPrecisionPolicy, e.g. "
                        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32); "
                        f"got {type(mp_policy).__name__}")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        v = getattr(mp_policy, name)
        if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
            raise ValueError(f"mp_policy.{name} is a floating dtype (torch.bfloat16, torch.float16, "
                             f"torch.float32) or None, got {v!r}")
    return mp_policy


def policy_record(mp_policy) -> Optional[dict]:
    """The policy as the plan keeps it (JSON): dtype names, None where unset."""
    if mp_policy is None:
        return None
    name = lambda d: None if d is None else str(d).replace("torch.", "")   # noqa: E731
    return {"param_dtype": name(mp_policy.param_dtype), "reduce_dtype": name(mp_policy.reduce_dtype),
            "output_dtype": name(mp_policy.output_dtype), "cast_forward_inputs": bool(mp_policy.cast_forward_inputs)}


def policy_from_record(record: Optional[dict]):
    if not record:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    dt = lambda n: None if n is None else getattr(torch, n)   # noqa: E731
    return MixedPrecisionPolicy(param_dtype=dt(record["param_dtype"]), reduce_dtype=dt(record["reduce_dtype"]),
                                output_dtype=dt(record["output_dtype"]),
                                cast_forward_inputs=record["cast_forward_inputs"])


def reduce_dtype(mp_policy) -> Optional[torch.dtype]:
    """The dtype parameter gradients are reduced in: torch's rule, ``reduce_dtype``, else
    ``param_dtype``; None where the policy leaves gradients alone."""
    if mp_policy is None:
        return None
    return mp_policy.reduce_dtype or mp_policy.param_dtype


def ambient_autocast(device_type: str) -> Optional[torch.dtype]:
    """The dtype of the caller's enabled ``torch.autocast`` for ``device_type`` (on the meta
    device: a GPU's, else the CPU's), or None."""
    for t in (("cuda", "cpu") if device_type == "meta" else (device_type,)):
        try:
            if torch.is_autocast_enabled(t):
                return torch.get_autocast_dtype(t)
        except RuntimeError:   # a device type this torch has no autocast for
            continue
    return None


def make_explicit(gm: fx.GraphModule, signature, mp_policy=None, autocast: Optional[torch.dtype] = None,
                  traced_as: Optional[dict] = None) -> bool:
    """Write the policy's and autocast's casts into ``gm`` (in place) and set every node's
    ``meta["val"]`` to its dtype after them. ``autocast``: the caller's autocast dtype, for
    the ops outside the model's own autocast regions (their nodes carry ``meta[AUTOCAST]``).
    ``traced_as``: placeholder name -> its tensor's own dtype, where the graph was traced with
    it in the policy's ``param_dtype`` (``passes.capture``): the placeholder gets its own dtype
    back and the policy's cast. Whether anything changed."""
    g = gm.graph
    if mp_policy is None and autocast is None and not any(AUTOCAST in n.meta for n in g.nodes):
        return False
    vals = {n: _meta(n.meta.get("val")) for n in g.nodes if n.op == "placeholder"}
    for n, v in vals.items():
        own = (traced_as or {}).get(n.name)
        if own is not None and isinstance(v, torch.Tensor) and v.dtype != own:
            vals[n] = torch.empty(v.shape, dtype=own, device="meta")
    if mp_policy is not None:
        _policy_casts(g, signature, mp_policy, vals)
    known: dict = {}   # (op, argument dtypes, device type) -> autocast's casts of its arguments
    casts: dict = {}   # (tensor node, dtype) -> its cast
    for node in list(g.nodes):
        if node in vals or node.op == "output":
            continue
        if node.op != "call_function":
            vals[node] = _meta(node.meta.get("val"))
            continue
        if node.target is aten._assert_tensor_metadata.default:   # export's check of a traced dtype
            v = vals.get(node.args[0])
            if isinstance(v, torch.Tensor) and node.kwargs.get("dtype") is not None:
                node.kwargs = {**node.kwargs, "dtype": v.dtype}
            continue
        dtype = node.meta.get(AUTOCAST, autocast)
        if dtype is not None and isinstance(node.target, torch._ops.OpOverload) and node.target is not CAST:
            leaves, _ = tree_flatten((node.args, node.kwargs))
            metas = [vals.get(a) if isinstance(a, fx.Node) else a for a in leaves]
            key = (node.target, dtype, tuple(m.dtype if isinstance(m, torch.Tensor) else None for m in metas))
            if key not in known:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), vals.get)
                known[key] = _positions(autocast_casts(node.target, args, kwargs, "cpu", dtype), metas)
            for i, to in known[key]:
                src = leaves[i]
                if (src, to) not in casts:
                    with g.inserting_before(node):
                        casts[(src, to)] = _cast(g, src, to, vals, like=node)
                node.replace_input_with(src, casts[(src, to)])
        vals[node] = _evaluate(node, vals)
    if mp_policy is not None and mp_policy.output_dtype is not None:
        _output_casts(g, signature, mp_policy.output_dtype, vals)
    for node in g.nodes:
        if node in vals and vals[node] is not None:
            node.meta["val"] = vals[node]
    gm.recompile()
    return True


def _positions(found, metas) -> tuple:
    """autocast_casts' (meta argument, dtype) as (index among the flattened arguments, dtype)."""
    out = []
    for arg, to in found:
        i = next((i for i, m in enumerate(metas) if m is arg), None)
        if i is not None and metas[i].dtype != to:
            out.append((i, to))
    return tuple(out)


def _policy_casts(g: fx.Graph, signature, mp_policy, vals: dict) -> None:
    kinds = {s.arg.name: s.kind for s in signature.input_specs}
    first = next(n for n in g.nodes if n.op != "placeholder")
    for ph in [n for n in g.nodes if n.op == "placeholder"]:
        kind, v = kinds.get(ph.name), vals.get(ph)
        want = mp_policy.param_dtype
        if want is None or not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or v.dtype == want:
            continue
        if kind == InputKind.PARAMETER or (kind == InputKind.USER_INPUT and mp_policy.cast_forward_inputs):
            users = list(ph.users)
            if not users:
                continue
            with g.inserting_before(first):   # kept from forward to backward: in no recomputed region
                cast = _cast(g, ph, want, vals, like=min(users, key=_order(g)), keys=("nn_module_stack",))
            for u in users:
                u.replace_input_with(ph, cast)


def _output_casts(g: fx.Graph, signature, dtype, vals: dict) -> None:
    """The floating user outputs cast to the policy's ``output_dtype``."""
    out = next(n for n in g.nodes if n.op == "output")
    results = list(out.args[0])
    for i, (spec, r) in enumerate(zip(signature.output_specs, results)):
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(r, fx.Node):
            continue
        v = vals.get(r)
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype != dtype:
            with g.inserting_before(out):
                results[i] = _cast(g, r, dtype, vals, like=r, keys=("nn_module_stack", "stack_trace"))
    out.args = (type(out.args[0])(results),) + tuple(out.args[1:])


def _order(g):
    pos = {n: i for i, n in enumerate(g.nodes)}
    return pos.get


def _cast(g: fx.Graph, src: fx.Node, dtype, vals: dict, like: fx.Node,
          keys=("nn_module_stack", "stack_trace", "custom")) -> fx.Node:
    cast = g.call_function(CAST, (src,), {"dtype": dtype})
    # the cast belongs to its user's module (blocks tied like it) and region (recomputed with it)
    cast.meta = {k: like.meta[k] for k in keys if k in like.meta}
    v = vals[src]
    vals[cast] = torch.empty(v.shape, dtype=dtype, device="meta")
    return cast


def _meta(v):
    """``v`` with every tensor in it as a meta tensor of its shape and dtype."""
    leaves, spec = tree_flatten(v)
    return tree_unflatten([torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
                           for x in leaves], spec)


def _evaluate(node: fx.Node, vals: dict):
    """The node's result on meta tensors of its inputs' dtypes after the casts; the traced
    value where no input changed dtype."""
    old = _meta(node.meta.get("val"))
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: vals.get(a))
    ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    traced = [a.meta.get("val") for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
    traced = [t for t in traced if isinstance(t, torch.Tensor)]
    if len(ins) == len(traced) and all(a.dtype == t.dtype for a, t in zip(ins, traced)):
        return old
    with torch.device("meta"):
        return _meta(node.target(*args, **kwargs))


def grad_itemsize(graph, meta) -> int:
    """Bytes per element of a parameter's gradient where its all-reduce runs: the policy's
    reduce dtype (``runtime.grad_sync``), else the parameter's own."""
    policy = (graph.precision or {}).get("policy")
    name = policy and (policy["reduce_dtype"] or policy["param_dtype"])
    return getattr(torch, name).itemsize if name else meta.itemsize
