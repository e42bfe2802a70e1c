"""Capture: a user's module and example inputs -> a graph of aten ops with shapes and dtypes.

torch.export (non-strict) does the tracing. This pass turns its program into the small graph the
planner works on: every tensor a value ``(node, output index)``, every node with the metas of its
tensor outputs, parameters named by their fully qualified names, tied parameters merged.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autoshard._compat import block_masks_closing_over_tensors, tag_checkpoint_regions, tree_map_only
from autoshard.ir import Graph, Node, TensorMeta
from autoshard.passes.functionalize import functionalize
from autoshard.planner.progress import phase
from autoshard.precision import AUTOCAST, make_explicit, policy_record


class CaptureError(RuntimeError):
    """torch.export could not capture the model."""


def normalize_inputs(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(sorted(example_inputs.items()))   # keyword order never decides which input is which
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError("example_inputs must be a tensor, a tuple of positional arguments or a dict of "
                    f"keyword arguments, got {type(example_inputs).__name__}")


def export(model: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram:
    try:
        with tag_checkpoint_regions():   # the user's checkpoint calls, which the program keeps no trace of
            return torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - any failure inside export is the user's model
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "does not support backward on CPU" in first:
            cause = ("FlexAttention runs on the CPU in forward only, and the model's parameters require "
                     "gradients. Plan it for inference with model.requires_grad_(False) (and "
                     "training=False), or on a CUDA device.")
        elif "not a known type" in first:  # torch's pytree cannot flatten something the model returns
            cause = ("the model returns an object that is neither a tensor nor a container torch's "
                     "pytree can flatten. Return tensors (or tuples, lists, dicts and dataclasses "
                     "registered with torch.utils._pytree), or switch that output off: a decoder's "
                     "key/value cache object, for one, goes with use_cache=False.")
        elif "device" in first.lower() and ("mismatch" in first.lower() or "Device" in type(e).__name__):
            raise CaptureError(
                f"autoshard could not capture {type(model).__name__}: {type(e).__name__}: {first}\n"
                "The forward mixes devices: it makes a tensor on one device (a tensor created without "
                "device=, such as torch.arange(n) or torch.tensor([...]), lands on the CPU) and meets "
                "inputs or weights on another. Create it on the input's device "
                "(torch.arange(n, device=x.device)), or register it as a buffer in __init__.") from e
        else:
            cause = ("Common causes: Python control flow that depends on tensor values (use torch.where "
                     "or torch.cond), calls into non-torch libraries, or example inputs of the wrong shape.")
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {first}\n"
            f"autoshard needs a model that torch.export can trace with the example inputs. {cause} "
            "Try torch.export.export(model, args, strict=False) directly to see the full report."
        ) from e


# torch.export keeps a region that switches gradients (torch.no_grad, torch.enable_grad) or runs
# under torch.autocast as one call of a submodule through these higher-order ops
_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST_REGION = torch.ops.higher_order.wrap_with_autocast


def inline_regions(gm: fx.GraphModule) -> None:
    """Inline, in place, the submodule calls by which torch.export keeps grad-mode and autocast
    regions, so that the planner sees their ops as any others (a decoder computes its rotary
    position table under torch.no_grad, for one).

    A region run with gradients off becomes its ops followed by a ``detach`` of each output it
    computed: the same values, and no gradient through them, as in the model. A region that switches gradients
    on inside one that switched them off would need more than a detach and is refused. An
    autocast region's ops were traced at their own dtypes: inlined, each is marked with the
    region's autocast dtype (None where it switches autocast off), and ``precision.make_explicit``
    writes in the casts autocast makes."""
    while True:
        node = next((n for n in gm.graph.nodes if n.op == "call_function"
                     and n.target in (_GRAD_REGION, _AUTOCAST_REGION)), None)
        if node is None:
            break
        if node.target is _GRAD_REGION:
            grad_enabled, body, operands = node.args[0], node.args[1], node.args[2:]
        else:
            device_type, dtype, enabled, _, body, *operands = node.args
            grad_enabled = True
        sub = getattr(gm, body.target)
        if node.target is _AUTOCAST_REGION:
            mark = (dtype or torch.get_autocast_dtype(device_type)) if enabled else None
            for n in sub.graph.nodes:
                n.meta[AUTOCAST] = mark
        elif AUTOCAST in node.meta:   # a grad region within an autocast region runs under it too
            for n in sub.graph.nodes:
                n.meta.setdefault(AUTOCAST, node.meta[AUTOCAST])
        if not grad_enabled and any(n.op == "call_function" and n.target is _GRAD_REGION and n.args[0]
                                    for n in sub.graph.nodes):
            raise CaptureError("the model switches gradients on (torch.enable_grad) inside a region that "
                               "switched them off (torch.no_grad): autoshard cannot plan that nesting")
        outs = _inline_body(gm, node, sub, operands)
        if not grad_enabled:  # what the region computed has no gradient; what it passed through keeps its own
            with gm.graph.inserting_before(node):
                outs = [o if o in operands else _detached(gm.graph, o) for o in outs]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                gm.graph.erase_node(user)
        if node.users:
            raise CaptureError(f"region {node.name} of the exported graph is used other than by indexing "
                               "its outputs; autoshard cannot inline it")
        gm.graph.erase_node(node)
        if not body.users:
            gm.graph.erase_node(body)
    gm.delete_all_unused_submodules()
    gm.recompile()


def _inline_body(gm: fx.GraphModule, call: fx.Node, sub: fx.GraphModule, operands) -> list:
    """Copy the ops of ``sub`` before ``call``, its placeholders bound to ``operands``; returns
    the nodes that hold its outputs. A nested region's submodule moves up to ``gm``."""
    env = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"), operands))
    outs = []
    with gm.graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
                outs = list(result) if isinstance(result, (tuple, list)) else [result]
            elif n.op == "get_attr":
                name = _free_attr(gm, n.target)
                setattr(gm, name, getattr(sub, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
            else:
                env[n] = gm.graph.node_copy(n, env.__getitem__)
    return outs


# torch.export (pre-dispatch) keeps a torch.vmap call as these calls around the per-example ops
# (FlexAttention's create_block_mask evaluates mask_mod so, over batch, head, query and key)
_VMAP = "torch._functorch.predispatch"


def _vmap_call(n: fx.Node, name: str) -> bool:
    return n.op == "call_function" and getattr(n.target, "__module__", None) == _VMAP and \
        getattr(n.target, "__name__", None) == name


def retrace_vmap_regions(gm: fx.GraphModule, mode: FakeTensorMode) -> None:
    """Replace, in place, each region of ``torch.vmap`` calls in the graph by the aten ops it
    comes to over whole tensors: the region traced again below autograd (``make_fx``, on the fake
    values export recorded), where vmap's batching rules turn each per-example op into one over
    the batched dims. The planner then sees broadcasting ops with shapes and rules, instead of
    calls that switch a vmap level on and off around scalars."""
    changed = False
    for region in _vmap_regions(gm.graph):
        inside = set(region)
        ext = list(dict.fromkeys(u for n in region for u in n.all_input_nodes if u not in inside))
        outs = [n for n in region if any(u not in inside for u in n.users)]
        sub = fx.Graph()
        # an attribute the region reads (a mask mod's index spec) but export placed before it
        env = {u: sub.get_attr(u.target) for u in ext if u.op == "get_attr"}
        ext = [u for u in ext if u.op != "get_attr"]
        env.update({u: sub.placeholder(f"in_{i}") for i, u in enumerate(ext)})
        for n in region:
            env[n] = sub.node_copy(n, env.__getitem__)
        sub.output(tuple(env[n] for n in outs))
        try:
            with mode:
                traced = make_fx(fx.GraphModule(gm, sub))(*[u.meta["val"] for u in ext])
        except Exception as e:  # noqa: BLE001 - what the region runs is the user's
            raise CaptureError(f"autoshard could not trace the torch.vmap call at {region[0].name} over whole "
                               f"tensors: {type(e).__name__}: {e}") from e
        traced.graph.eliminate_dead_code()
        before = region[0].prev
        new = _inline_body(gm, region[0], traced, ext)
        n = before.next
        while n is not region[0]:   # the module the region was traced in, for the block finder
            n.meta.update({k: region[0].meta[k] for k in ("nn_module_stack", "stack_trace", "custom")
                           if k in region[0].meta})
            n = n.next
        for old, made in zip(outs, new):
            old.replace_all_uses_with(made)
        for n in reversed(region):
            gm.graph.erase_node(n)
        changed = True
    if changed:
        for n in list(gm.graph.nodes):
            if _vmap_call(n, "lazy_load_decompositions") or (n.op == "get_attr" and not n.users):
                gm.graph.erase_node(n)
        gm.delete_all_unused_submodules()
        gm.recompile()


def _vmap_regions(graph: fx.Graph) -> list:
    """The runs of nodes from an outermost ``_vmap_increment_nesting`` to its matching decrement."""
    regions, depth, current = [], 0, None
    for n in graph.nodes:
        if _vmap_call(n, "_vmap_increment_nesting"):
            if depth == 0:
                current = []
            depth += 1
        if current is not None:
            current.append(n)
        if _vmap_call(n, "_vmap_decrement_nesting"):
            depth -= 1
            if depth == 0:
                regions.append(current)
                current = None
    return regions


def _free_attr(gm: fx.GraphModule, name: str) -> str:
    i, free = 0, name
    while hasattr(gm, free):
        i += 1
        free = f"{name}_{i}"
    return free


def _detached(graph: fx.Graph, node):
    if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return node
    out = graph.call_function(torch.ops.aten.detach.default, (node,))
    out.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
    return out


def _tensor_metas(val) -> list:
    if isinstance(val, torch.Tensor):
        return [TensorMeta(tuple(int(s) for s in val.shape), val.dtype)]
    if isinstance(val, (tuple, list)):
        return [TensorMeta(tuple(int(s) for s in v.shape), v.dtype) for v in val if isinstance(v, torch.Tensor)]
    return []


def tensor_args(fx_node: fx.Node) -> list:
    """The fx nodes among a node's arguments, in order (lists flattened)."""
    found = []
    fx.node.map_arg((fx_node.args, fx_node.kwargs), found.append)
    return found


def capture(model: torch.nn.Module, example_inputs, extra_kwargs=None, outputs: str = "whole",
            mp_policy=None, autocast=None) -> Graph:
    """Capture on fake tensors of the device type the model runs on (``run_device_type``): the
    weights are never touched and nothing is allocated, so this works for a model of any size and
    for one whose parameters are already DTensor shares, while ``x.device.type`` stays true to the
    run (a router under ``torch.autocast(device_type=x.device.type)``, a device branch, a tensor
    made without ``device=``). ``outputs``: how the caller takes the user outputs
    (``Graph.outputs``). ``mp_policy`` (a MixedPrecisionPolicy) and ``autocast`` (the caller's
    autocast dtype) are written in as casts (``autoshard.precision``); the caller's own autocast is
    off while tracing, so that those casts are made once."""
    args, kwargs = normalize_inputs(example_inputs)
    if block_masks_closing_over_tensors((args, kwargs)):
        raise CaptureError(
            "a FlexAttention BlockMask is passed in whose mask_mod closes over tensors (a document mask's "
            "ids, say), which torch.export cannot take: it makes them constants of the program. Pass "
            "those tensors in as inputs and build the mask inside forward, create_block_mask(mask_mod, "
            "B, H, Q_LEN, KV_LEN, device=x.device.type), or pass a mask whose mod reads only its indices "
            "(causal, sliding windows).")
    device = run_device_type(model, (args, kwargs))
    if extra_kwargs:
        kwargs = dict(sorted({**kwargs, **extra_kwargs}.items()))
    # under a policy the model is traced as FSDP2 runs it: on its parameters (and, with
    # cast_forward_inputs, its inputs) in param_dtype, so that the code's own casts (an RMSNorm's
    # x.float() ... .type_as(x)) are recorded as what they do then, not as the no-ops they are in
    # fp32; make_explicit gives the graph back its masters and casts them (``traced_as``)
    cast = mp_policy.param_dtype if mp_policy is not None else None
    cast_in = cast if mp_policy is not None and mp_policy.cast_forward_inputs else None
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with phase("capture"), fake_view(model, fake, device, cast) as params, _no_autocast(device):
        ep = export(model, _to_fake(args, fake, device, cast_in), _to_fake(kwargs, fake, device, cast_in))
        inline_regions(ep.graph_module)
        retrace_vmap_regions(ep.graph_module, fake)
        precise = make_explicit(ep.graph_module, ep.graph_signature, mp_policy, autocast,
                                traced_as=_traced_as(ep, params, (args, kwargs)) if cast is not None else None)
        functionalize(ep.graph_module, ep.graph_signature)   # in-place ops out of place, where nothing reads the old value
        graph = from_exported(ep, model)
    graph.outputs = outputs
    if precise:
        graph.precision = {"policy": policy_record(mp_policy), "autocast": autocast and str(autocast).replace("torch.", "")}
    return graph


def from_exported(ep: ExportedProgram, model: torch.nn.Module) -> Graph:
    sig = ep.graph_signature
    by_id: dict = {}
    all_params = dict(model.named_parameters(remove_duplicate=False))
    for fqn, p in all_params.items():
        by_id.setdefault(id(p), []).append(fqn)
    canonical = {}
    for names in by_id.values():
        for n in names:
            canonical[n] = names
    kinds = {}
    for spec in sig.input_specs:
        kinds[spec.arg.name] = spec
    gm = ep.graph_module
    # tied parameters: the graph may hold one placeholder per name; route all uses to one of them
    placeholder_of = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and kinds[node.name].kind == InputKind.PARAMETER:
            fqn = kinds[node.name].target
            placeholder_of[fqn] = node
    aliases: dict = {}
    replace: dict = {}
    for fqn, node in placeholder_of.items():
        group = canonical.get(fqn, [fqn])
        live = [f for f in group if f in placeholder_of and placeholder_of[f].users]
        keep = live[0] if live else group[0] if group[0] in placeholder_of else fqn
        for f in group:
            aliases[f] = keep
        if fqn != keep and placeholder_of[fqn].users:
            replace[node] = placeholder_of[keep]
    for fqn, names in ((f, canonical.get(f, [f])) for f in list(aliases)):
        for n in names:
            aliases.setdefault(n, aliases[fqn])

    nodes: list = []
    built: dict = {}
    values: dict = {}      # fx node -> Value, or list of Values for multi-output nodes
    user_inputs = []
    for fxn in gm.graph.nodes:
        if fxn.op == "placeholder":
            spec = kinds[fxn.name]
            if spec.kind == InputKind.PARAMETER:
                if fxn in replace or aliases.get(spec.target) != spec.target:
                    values[fxn] = (placeholder_of[aliases[spec.target]].name, 0)
                    continue
                kind, fqn = "param", spec.target
            elif spec.kind == InputKind.BUFFER:
                kind, fqn = "buffer", spec.target
            elif spec.kind in (InputKind.CONSTANT_TENSOR,):
                kind, fqn = "buffer", spec.target
            elif spec.kind == InputKind.USER_INPUT:
                kind, fqn = "input", None
                user_inputs.append(fxn.name)
            else:
                raise CaptureError(f"unsupported graph input {fxn.name} of kind {spec.kind}")
            metas = _tensor_metas(fxn.meta.get("val"))
            n = Node(fxn.name, kind, fxn, outputs=metas, fqn=fqn)
            if kind == "param":
                n.requires_grad = bool(all_params[fqn].requires_grad)
            nodes.append(n)
            built[n.name] = n
            values[fxn] = (fxn.name, 0) if metas else None
        elif fxn.op == "call_function" and fxn.target is operator.getitem:
            src, idx = fxn.args
            multi = values.get(src)
            values[fxn] = multi[idx] if isinstance(multi, list) else None
        elif fxn.op == "call_function":
            ins = []
            for a in tensor_args(fxn):
                v = values.get(a)
                if v is not None and not isinstance(v, list):
                    ins.append(v)
            metas = _tensor_metas(fxn.meta.get("val"))
            n = Node(fxn.name, "op", fxn, inputs=ins, outputs=metas,
                     region=(fxn.meta.get("custom") or {}).get("autoshard_region"))
            n.requires_grad = any(built[v[0]].requires_grad for v in ins) and any(m.floating for m in metas)
            nodes.append(n)
            built[n.name] = n
            val = fxn.meta.get("val")
            if isinstance(val, (tuple, list)):
                values[fxn] = [(fxn.name, i) for i in range(len(metas))]
            else:
                values[fxn] = (fxn.name, 0) if metas else None
        elif fxn.op == "get_attr" and isinstance(getattr(gm, fxn.target, None), fx.GraphModule):
            values[fxn] = None   # a higher-order op's subgraph (FlexAttention's mods): its rule reads it
        elif fxn.op == "output":
            outs = []
            for a in tensor_args(fxn):
                v = values.get(a)
                if v is not None and not isinstance(v, list):
                    outs.append(v)
            nodes.append(Node("output", "output", fxn, inputs=outs))
        else:
            raise CaptureError(f"unsupported node {fxn.format_node()} in the exported graph")
    graph = Graph(nodes, ep, aliases, user_inputs)
    graph.value_of = values
    readers: dict = {}
    for n in nodes:
        for v in n.inputs:
            readers.setdefault(v[0], []).append(n.region)
    for n in nodes:
        n.recomputed = n.region is not None and bool(readers.get(n.name)) and set(readers[n.name]) == {n.region}
    return graph


def run_device_type(model: nn.Module, inputs) -> str:
    """The device type the model runs on: its parameters' and buffers', else its inputs', where
    they hold data; for a model built on the meta device, CUDA where this machine has it, else CPU."""
    tensors = [*model.parameters(), *model.buffers(),
               *(x for x in torch.utils._pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor))]
    return next((t.device.type for t in tensors if t.device.type != "meta"),
                "cuda" if torch.cuda.is_available() else "cpu")


def _fake(mode: FakeTensorMode, shape, dtype, device: str) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype, device=device)


def _to_fake(x, mode: FakeTensorMode, device: str, floating=None):
    """Fake tensors of ``x``'s shapes on ``device``, wherever torch's pytree finds them (a
    BlockMask's, and those its mask mod closes over: ``_compat.register_block_mask``); its
    floating tensors in ``floating`` when given."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        dtype = floating if floating is not None and t.dtype.is_floating_point else t.dtype
        return _fake(mode, t.shape, dtype, device)
    return tree_map_only(torch.Tensor, fake, x)


@contextlib.contextmanager
def _no_autocast(device: str):
    """The caller's autocast off while tracing (``capture`` writes its casts in once, itself)."""
    try:
        region = torch.autocast(device_type=device, enabled=False)
    except RuntimeError:   # a device type this torch has no autocast for: nothing to switch off
        region = contextlib.nullcontext()
    with region:
        yield


def _traced_as(ep: ExportedProgram, params: dict, inputs) -> dict:
    """placeholder name -> the dtype its tensor really has, for the parameters and user inputs
    traced in another (``capture`` under a policy)."""
    leaves = [x for x in torch.utils._pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    users = iter(leaves)
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER and spec.target in params:
            out[spec.arg.name] = params[spec.target]
        elif spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name") and type(spec.arg).__name__ == "TensorArgument":
            x = next(users, None)
            if x is not None:
                out[spec.arg.name] = x.dtype
    return out


@contextlib.contextmanager
def fake_view(model: nn.Module, mode: FakeTensorMode, device: str, floating=None):
    """Swap the model's parameters and buffers for fake tensors (``mode``) of their global shapes
    on ``device`` while it is captured: no memory for weights, and DTensor shares trace as the
    whole tensors they stand for.
    ``floating``: the dtype the floating parameters take meanwhile (a policy's ``param_dtype``).
    Yields each parameter's name (every alias) -> its own dtype."""
    saved = []
    fakes: dict = {}
    dtypes: dict = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            dtypes[f"{mod_name}.{name}" if mod_name else name] = p.dtype
            if id(p) not in fakes:
                dtype = floating if floating is not None and p.dtype.is_floating_point else p.dtype
                fakes[id(p)] = nn.Parameter(_fake(mode, p.shape, dtype, device), requires_grad=p.requires_grad)
            saved.append((mod._parameters, name, p))
            mod._parameters[name] = fakes[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            saved.append((mod._buffers, name, b))
            mod._buffers[name] = _fake(mode, b.shape, b.dtype, device)
    try:
        yield dtypes
    finally:
        for registry, name, value in reversed(saved):
            registry[name] = value
