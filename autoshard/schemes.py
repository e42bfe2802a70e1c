"""The hand-designed parallel schemes of DESIGN.md section 6, as pins for ``autoshard.plan``.

Each function takes a model made of transformer or MLP blocks, its example inputs and a mesh
shape, names the role of each mesh axis, and returns ``{name: per-axis placements}`` to pass as
``pin=``. The solver plans whatever a scheme leaves open, so every scheme is costed by the same
model as autoshard's own plan:

    pins = autoshard.schemes.tensor_3d(model, (idx, targets), mesh=(4, 4, 4, 4), i=0, j=1, l=2)
    plan = autoshard.plan(model, (idx, targets), mesh=(4, 4, 4, 4), pin=pins)

Each captures the model and finds the role of every linear layer (a matmul by a parameter) from
the graph, not from module names (``roles`` shows what it found); ``graph=`` reuses one
``autoshard.passes.capture.capture(model, inputs)`` for several.

- A **row** (closing) linear reads a block's attention or nonlinearity (scaled-dot-product or
  eager softmax attention, gelu, silu, tanh, ...) and its output goes, through views and dropout,
  into the residual add with the block's input.
- The **column** (widening) linears are those whose outputs feed that attention or nonlinearity:
  every linear a closing one's input is computed from, through the block's views, splits,
  rotary embedding and gating products (SwiGLU's ``silu(gate) * up``), up to the norms.
- Every other linear (an embedding's tied head, a classifier, an MLP's output layer) is
  **other**: the solver's choice. A model without blocks gets a ``ValueError`` from the schemes
  that need them; ``data_parallel`` and ``fsdp`` need none.

A scheme pins the storage of the weights it lays out and, where it dictates how a matmul is
computed rather than only where weights live, that matmul's output (a graph node). Mesh axes
given no role are data-parallel axes: they split the batch, replicate the parameters and
all-reduce their gradients.

Placements are written per axis of ``nn.Linear``'s ``y = x @ weight.T + bias``, whose ``weight``
is (out, in): the design's ``W (k x n)`` is ``weight.T``, so a split of W's dim 0 (k) is a split
of weight's dim 1 and the other way round. A weight multiplied as it is stored (HuggingFace
GPT-2's Conv1D: ``addmm`` by an (in, out) weight) is W itself: the schemes place each weight by
the dim that actually holds its output features. Activations are (batch, seq, features), or
(tokens, features) where the model flattens them: "S0" of the design's token dim is ``S(0)``,
its feature dim the last.

A split that does not divide evenly is a ``ValueError`` naming the tensor, the axis and the size.
A fused projection (one linear for q, k and v side by side, as the GPT here and GPT-2 have) must
not be split contiguously by its output features, which would straddle q, k and v. Where a
scheme splits those features, it splits them in blocks (``S(0)/3`` of an (out, in) weight and
its bias, ``S(2)/3`` of the output: each rank holds its share of q, of k and of v, as Megatron-LM
lays out its fused qkv weight), so the split into q, k and v and the attention heads stay local;
where two axes split them (3-D, AxoNN 4-D), not yet (see ``_block_fused``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from autoshard import placement as pl
from autoshard.arguments import MAX_AXES, check_mesh, check_module
from autoshard.passes.annotate import blocked_splits
from autoshard.ir import Graph
from autoshard.passes.capture import capture
from autoshard.rules.nn import mask_placement

aten = torch.ops.aten

# ---- finding the blocks in the graph -------------------------------------------------------------

# matmul by a weight -> (slot of x, slot of the weight, slot of the bias, the weight dim that holds
# the output features when the parameter is used as stored)
_MATMULS = {aten.linear.default: (0, 1, 2, 0), aten.addmm.default: (1, 2, 0, 1),
            aten.mm.default: (0, 1, None, 1), aten.matmul.default: (0, 1, None, 1)}
# a weight used transposed on the way (``x @ w.t()``)
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.numpy_T.default}

# op families, every overload: attention (the fused op, or an eager softmax between the q @ k^T
# and probs @ v products, which are matmuls of two activations) and the nonlinearities
_ATTENTION = {aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
              aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_cudnn_attention, aten.softmax, aten._softmax, aten._safe_softmax}
# the fused attention whose queries a context axis splits along the sequence (rules.nn.sdpa)
_SDPA = {aten.scaled_dot_product_attention.default}
_PRODUCTS = {aten.matmul, aten.bmm, aten.baddbmm, aten.mm, aten.einsum}
_NONLINEAR = {aten.gelu, aten.silu, aten.relu, aten.tanh, aten.sigmoid, aten.elu, aten.selu, aten.celu,
              aten.leaky_relu, aten.hardswish, aten.hardsigmoid, aten.hardtanh, aten.mish, aten.softplus,
              aten.glu, aten.prelu}
# a block's region ends at a norm, or a reduction (a decomposed RMSNorm's mean): what lies beyond
# is the residual stream, which every block reads
_NORMS = {aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm, aten.group_norm,
          aten.native_group_norm, aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
          aten._native_batch_norm_legit_no_training, aten.instance_norm}
_REDUCTIONS = {aten.mean, aten.sum, aten.var, aten.var_mean, aten.std, aten.amax, aten.amin, aten.max,
               aten.min, aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.prod}
_ADDS = {aten.add, aten.add_}
# ops that only re-lay a tensor (a flattening before an addmm): traced back through to the norm
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.alias, aten.contiguous, aten.clone}


def _family(node):
    return getattr(node.target, "overloadpacket", None)


@dataclass
class _Linear:
    node: str                 # graph node of the matmul
    weight: str               # the weight's parameter name
    bias: Optional[str]
    weight_shape: tuple       # as stored: (out, in) for nn.Linear, (in, out) for GPT-2's Conv1D
    out_dim: int              # the weight dim that holds the output features
    x: tuple                  # the activation it multiplies (a graph value)
    out_shape: tuple
    kind: str = "other"       # "column", "row" or "other"

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim

    @property
    def n_out(self) -> int:
        return self.weight_shape[self.out_dim]


def _weight_of(graph: Graph, value):
    """The parameter node a matmul multiplies by, and whether it is used transposed."""
    node = graph.by_name[value[0]]
    if node.kind == "param":
        return node, False
    if node.kind == "op" and node.target in _TRANSPOSES and len(node.outputs[0].shape) == 2:
        src = graph.by_name[node.inputs[0][0]]
        if src.kind == "param":
            return src, True
    return None, False


def _linears(graph: Graph) -> list:
    by = graph.by_name
    out = []
    for n in graph.nodes:
        if n.kind != "op" or n.target not in _MATMULS:
            continue
        xs, ws, bs, out_dim = _MATMULS[n.target]
        if len(n.inputs) <= max(xs, ws) or len(n.outputs) != 1:
            continue
        w, flipped = _weight_of(graph, n.inputs[ws])
        if w is None or len(w.outputs[0].shape) != 2 or by[n.inputs[xs][0]].kind == "param":
            continue
        b = by[n.inputs[bs][0]] if bs is not None and len(n.inputs) > bs else None
        out.append(_Linear(n.name, w.fqn, b.fqn if b is not None and b.kind == "param" else None,
                           w.outputs[0].shape, 1 - out_dim if flipped else out_dim, n.inputs[xs],
                           n.outputs[0].shape))
    return out


@dataclass
class _Blocks:
    """What the graph says of its blocks."""
    linears: list             # every _Linear, its kind set
    closes: dict              # row linear's node -> (its residual add's node, the add's other operand)
    attention: int            # how many attention ops (fused, softmax or a product of activations)
    nonlinear: int            # how many nonlinearities


def _is_core(graph: Graph, node) -> bool:
    """Attention or a nonlinearity: the work a block's linears open and close."""
    fam = _family(node)
    if fam in _ATTENTION or fam in _NONLINEAR:
        return True
    # an eager attention's products: two activations, no weight
    return fam in _PRODUCTS and all(graph.by_name[v[0]].kind in ("op", "input") and _weight_of(graph, v)[0] is None
                                    for v in node.inputs)


def _residual_add(graph: Graph, users: dict, ancestors: dict, order: dict, lin: _Linear):
    """The add that takes ``lin``'s output (through ops of that one input: views, dropout, casts)
    to the residual stream, with an operand ``lin`` is computed from (the block's input); or None."""
    by = graph.by_name
    frontier, seen = [(lin.node, 0)], set()
    while frontier:
        value = frontier.pop()
        for consumer, slot in users.get(value, ()):
            c = by[consumer]
            if c.kind != "op" or consumer in seen:
                continue
            seen.add(consumer)
            fam = _family(c)
            if fam in _ADDS and len(c.inputs) == 2:
                other = c.inputs[1 - slot]
                if (ancestors[lin.node] >> order[other[0]]) & 1 and other != value \
                        and graph.meta(other).shape == c.outputs[0].shape:
                    return consumer, other
            elif len(c.inputs) == 1 and len(c.outputs) == 1 and fam not in _NORMS | _REDUCTIONS \
                    and not _is_core(graph, c):
                frontier.append((consumer, 0))
    return None


def _cone(graph: Graph, lin: _Linear, linear_nodes: set):
    """What ``lin``'s input is computed from, back to the norms: whether it holds attention or a
    nonlinearity, and the linears whose outputs feed it."""
    by = graph.by_name
    stack, seen, core, openers = [lin.x[0]], set(), False, []
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = by[name]
        if name in linear_nodes:
            openers.append(name)
            continue
        if node.kind != "op" or _family(node) in _NORMS | _REDUCTIONS:
            continue
        core = core or _is_core(graph, node)
        stack.extend(v[0] for v in node.inputs)
    return core, openers


def _find_blocks(graph: Graph) -> _Blocks:
    linears = _linears(graph)
    users = graph.users()
    ancestors: dict = {}     # node -> the set of its ancestors (itself included), as bits by graph order
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    for i, n in enumerate(graph.nodes):
        bits = 1 << i
        for v in n.inputs:
            bits |= ancestors[v[0]]
        ancestors[n.name] = bits
    linear_nodes = {l.node for l in linears}
    closes, opened = {}, set()
    for lin in linears:
        add = _residual_add(graph, users, ancestors, order, lin)
        if add is None:
            continue
        core, openers = _cone(graph, lin, linear_nodes)
        if core and openers:
            closes[lin.node] = add
            opened.update(openers)
    for lin in linears:
        # one that closes a block and opens the next (no norm between) is laid out as closing
        lin.kind = "row" if lin.node in closes else "column" if lin.node in opened else "other"
    cores = [n for n in graph.nodes if n.kind == "op" and _is_core(graph, n)]
    return _Blocks(linears, closes, sum(_family(n) not in _NONLINEAR for n in cores),
                   sum(_family(n) in _NONLINEAR for n in cores))


def _missing(blocks: _Blocks) -> Optional[str]:
    """What the model lacks for the schemes that lay out blocks, or None."""
    if blocks.closes:   # a closing linear comes with the linears that open its block
        return None
    found = (f"the model has {len(blocks.linears)} linear layers (matmuls by a parameter), "
             f"{blocks.attention} attention ops and {blocks.nonlinear} nonlinearities")
    return ("found no linear that closes a block (feeds the residual add from the attention or the "
            f"nonlinearity): {found}. Megatron-style schemes need blocks such as x + W2 act(W1 ln(x)) "
            "or x + Wo attention(Wq x, Wk x, Wv x); data_parallel and fsdp need none")


def roles(model, example_inputs, *, graph: Optional[Graph] = None) -> dict:
    """``{weight name: "column" | "row" | "other"}`` for every linear layer of ``model``, as the
    schemes find them in its graph (see the module's docstring)."""
    check_module("model", model)
    graph = graph if graph is not None else capture(model, example_inputs)
    return {l.weight: l.kind for l in _find_blocks(graph).linears}


def linear_layers(graph: Graph) -> list:
    """Every linear layer of the graph (a matmul by a parameter) with its role (``kind``:
    column, row or other), its weight's shape and the activation it multiplies (``x``)."""
    return _find_blocks(graph).linears


@dataclass
class _Layout:
    """What the schemes need from the captured graph."""
    mesh: tuple
    inputs: dict              # user input name -> shape
    params: dict              # parameter name the graph uses -> shape
    linears: list
    blocked: dict             # matmul node -> the number of blocks its output is split into downstream
    residual: dict = field(default_factory=dict)   # the residual stream and its norms: node -> shape
    missing: Optional[str] = None                  # why the model has no blocks to lay out
    attention: dict = field(default_factory=dict)  # fused attention nodes -> output shape
    masks: dict = field(default_factory=dict)      # fused attention nodes with a mask -> its shape
    dropped: tuple = ()                            # fused attention nodes that draw dropout


def _layout(model, example_inputs, mesh, graph: Optional[Graph] = None) -> _Layout:
    if graph is None:   # a scheme reads the model through its graph only (None with graph=: the planner's own)
        check_module("model", model)
    mesh = check_mesh(mesh, MAX_AXES)
    graph = graph if graph is not None else capture(model, example_inputs)
    params = {n.fqn: n.outputs[0].shape for n in graph.nodes if n.kind == "param"}
    inputs = {n.name: n.outputs[0].shape for n in graph.nodes if n.kind == "input" and n.outputs}
    blocks = _find_blocks(graph)
    blocked = {name: g for name, (_, g) in blocked_splits(graph).items()}
    fused = [n for n in graph.nodes if n.kind == "op" and n.target in _SDPA]
    attention = {n.name: n.outputs[0].shape for n in fused}
    masks = {n.name: graph.meta(n.inputs[3]).shape for n in fused if len(n.inputs) > 3}
    args = lambda n: n.fx_node.args[4] if len(n.fx_node.args) > 4 else n.fx_node.kwargs.get("dropout_p", 0.0)
    dropped = tuple(n.name for n in fused if args(n))
    return _Layout(mesh, inputs, params, blocks.linears, blocked, _residual_stream(graph, blocks),
                   _missing(blocks), attention, masks, dropped)


def _residual_stream(graph: Graph, blocks: _Blocks) -> dict:
    """The values between the blocks' matmuls, where sequence parallelism splits by sequence:
    each residual add, the stream it adds to and the branch it adds (the output of a dropout or
    a cast after the closing linear), what each column-type linear reads (back through views to
    the norm that made it), and every norm of the stream."""
    by = graph.by_name
    stream = set()
    linear_nodes = {l.node for l in blocks.linears}
    for add, other in blocks.closes.values():
        stream.add(add)
        if by[other[0]].kind == "op" and other[1] == 0:
            stream.add(other[0])
        # the branch it adds, where ops (a dropout, a cast) stand between the closing linear and the add
        for branch in by[add].inputs:
            if (branch != other and branch[1] == 0 and by[branch[0]].kind == "op"
                    and branch[0] not in linear_nodes):
                stream.add(branch[0])
    for lin in blocks.linears:
        if lin.kind != "column":
            continue
        value = lin.x
        while by[value[0]].kind == "op" and _family(by[value[0]]) in _VIEWS and value[1] == 0:
            value = by[value[0]].inputs[0]
        if by[value[0]].kind == "op" and value[1] == 0:
            stream.add(value[0])
    values = {(s, 0) for s in stream}
    for n in graph.nodes:
        if n.kind == "op" and _family(n) in _NORMS and n.inputs and n.inputs[0] in values:
            stream.add(n.name)
    return {n.name: n.outputs[0].shape for n in graph.nodes if n.name in stream}


def _axes(lay: _Layout, **roles) -> dict:
    """Role -> mesh axis (negative counts from the end; None: the role is absent)."""
    n = len(lay.mesh)
    out = {}
    for role, a in roles.items():
        if a is None:
            continue
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"{role} is the index of a mesh axis of {lay.mesh} (0..{n - 1}), or None; got {a!r}")
        if not -n <= a < n:
            raise ValueError(f"{role}={a!r} is not an axis of mesh {lay.mesh}: give 0..{n - 1}")
        out[role] = a % n
    seen = {}
    for role, a in out.items():
        if a in seen:
            raise ValueError(f"{seen[a]} and {role} are both axis {a}: give each role its own axis")
        seen[a] = role
    return out


def _data_axes(lay: _Layout, roles: dict) -> list:
    return [a for a in range(len(lay.mesh)) if a not in roles.values()]


def _nd(lay: _Layout, what: str, shape, per_axis: dict) -> tuple:
    """Per-axis placement strings from {axis: "S(d)" / "P"} (B elsewhere), checked to divide."""
    out = []
    cut = list(shape)
    for a, size in enumerate(lay.mesh):
        p = per_axis.get(a, "B")
        if p.startswith("S("):
            d = int(p[2:-1])
            if d >= len(cut) or cut[d] % size:
                raise ValueError(f"{what} of shape {list(shape)} cannot be split on dim {d} by mesh axis {a} "
                                 f"of size {size} (mesh {lay.mesh}): choose sizes that divide")
            cut[d] //= size
        out.append(p)
    return tuple(out)


def _batch_pins(lay: _Layout, axes: Sequence[int]) -> dict:
    """User inputs split on the batch (dim 0) over ``axes``, whole elsewhere."""
    return {name: _nd(lay, f"input {name!r}", shape, {a: "S(0)" for a in axes})
            for name, shape in lay.inputs.items() if len(shape) >= 1}


def _block_linears(lay: _Layout, scheme: str) -> list:
    if lay.missing:
        raise ValueError(f"{scheme}: {lay.missing}")
    return [l for l in lay.linears if l.kind != "other"]


def _s(d: int) -> str:
    return f"S({d})"


def _features(lin: _Linear) -> int:
    return len(lin.out_shape) - 1


def _out(lay: _Layout, lin: _Linear, per_axis: dict) -> tuple:
    return _nd(lay, f"the output of {lin.node} (the matmul by {lin.weight})", lin.out_shape, per_axis)


def _block_fused(lay: _Layout, pins: dict) -> dict:
    """A fused projection (qkv) split by its output features is split in its blocks instead:
    ``S(out)`` of its weight (``S(0)`` of an (out, in) weight), ``S(0)`` of its bias and
    ``S(features)`` of its output become ``S(d)/g``. Not where the weight's features are split
    by two axes (3-D, AxoNN 4-D): a parameter may be stored in blocks on one axis only
    (``passes.annotate.storage_options``), and those schemes leave the solver to re-lay the
    fused output for attention."""
    for lin in lay.linears:
        g = lay.blocked.get(lin.node, 1)
        if g == 1 or sum(p == _s(lin.out_dim) for p in pins.get(lin.weight, ())) > 1:
            continue
        for name, dim, shape in ((lin.weight, lin.out_dim, lin.weight_shape), (lin.bias, 0, (lin.n_out,)),
                                 (lin.node, _features(lin), lin.out_shape)):
            if name not in pins:
                continue
            block = tuple(f"S({dim})/{g}" if p == _s(dim) else p for p in pins[name])
            if pl.local_shape(shape, tuple(map(pl.parse, block)), lay.mesh) is None:
                raise ValueError(f"{name} of shape {list(shape)} holds {g} fused blocks, which mesh {lay.mesh} "
                                 f"cannot split as {pl.format_nd(tuple(map(pl.parse, block)))}: choose sizes that "
                                 f"divide each block ({shape[dim] // g})")
            pins[name] = block
    return pins


# ---- the schemes ---------------------------------------------------------------------------------

def data_parallel(model, example_inputs, mesh, *, graph: Optional[Graph] = None) -> dict:
    """Data parallelism on every axis: inputs and activations ``S(0)`` (batch), every parameter
    ``B``; the gradients are all-reduced.

    Pins every parameter ``B``, the inputs ``S(0)`` and every linear's output ``S(0)``."""
    lay = _layout(model, example_inputs, mesh, graph)
    every = range(len(lay.mesh))
    pins = _batch_pins(lay, every)
    pins.update({name: ("B",) * len(lay.mesh) for name in lay.params})
    for l in lay.linears:
        pins[l.node] = _out(lay, l, {a: "S(0)" for a in every})
    return pins


def fsdp(model, example_inputs, mesh, *, shard=None, graph: Optional[Graph] = None) -> dict:
    """ZeRO-3 / FSDP: every axis splits the batch; the ``shard`` axes (default: all) also store
    each parameter split, ``S(d)`` on the first dim their sizes divide (``B`` when none does), so
    it is all-gathered before use and its gradient reduce-scattered. Other axes store it ``B``
    (hybrid sharding).

    Pins every parameter's storage, the inputs ``S(0)`` and every linear's output ``S(0)``, which
    makes each weight used whole."""
    lay = _layout(model, example_inputs, mesh, graph)
    n = len(lay.mesh)
    if shard is not None and not isinstance(shard, (int, tuple, list)):
        raise TypeError(f"shard is a mesh axis or a list of them, or None for every axis; got {shard!r}")
    shard = list(range(n)) if shard is None else list(_axes(lay, **{f"shard[{i}]": a for i, a in enumerate(
        [shard] if isinstance(shard, int) else shard)}).values())
    pins = _batch_pins(lay, range(n))
    pins.update(_sharded_params(lay, shard))
    for l in lay.linears:
        pins[l.node] = _out(lay, l, {a: "S(0)" for a in range(n)})
    return pins


def _sharded_params(lay: _Layout, shard: Sequence[int]) -> dict:
    """Every parameter stored split over the ``shard`` axes on the first dim their sizes divide
    (``B`` where none does), as FSDP stores it."""
    ways = math.prod(lay.mesh[a] for a in shard)
    pins = {}
    for name, shape in lay.params.items():
        dim = next((d for d, s in enumerate(shape) if s % ways == 0 and s >= ways), None)
        pins[name] = _nd(lay, name, shape, {} if dim is None else {a: _s(dim) for a in shard})
    return pins


def _megatron(lay: _Layout, tp: int, data: list, scheme: str) -> dict:
    pins = _batch_pins(lay, data)
    for l in _block_linears(lay, scheme):
        col = l.kind == "column"
        pins[l.weight] = _nd(lay, l.weight, l.weight_shape, {tp: _s(l.out_dim if col else l.in_dim)})
        if l.bias:
            pins[l.bias] = _nd(lay, l.bias, (l.n_out,), {tp: "S(0)"} if col else {})
        out = {a: "S(0)" for a in data}
        out[tp] = _s(_features(l)) if col else "P"
        pins[l.node] = _out(lay, l, out)
    return _block_fused(lay, pins)


def megatron(model, example_inputs, mesh, *, tp: int = -1, graph: Optional[Graph] = None) -> dict:
    """Megatron-LM 1-D tensor parallelism on axis ``tp`` (other axes: data parallel).

    Column-parallel linears (qkv, fc; q, k, v, gate, up): weight stored ``S(0)`` (W's n), bias
    ``S(0)``, output ``S(features)``: ``(B, S1) -> S1``. Row-parallel ones (proj, fc2; o, down):
    weight ``S(1)`` (W's k), bias ``B``, output ``P``: ``(S1, S0) -> P``,
    all-reduced before the residual add. Between the blocks' matmuls the residual stream and its
    norms are ``B`` on ``tp`` (``S(0)`` on data axes), as in Megatron-LM without sequence
    parallelism: pinned, so that the scheme is the same program on every cluster rather than a
    sequence-parallel variant where the cluster's prices happen to favour one. On data axes
    weights are ``B`` and the inputs and linear outputs ``S(0)``. Embeddings and the head are the
    solver's choice."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, tp=tp)
    tp, data = roles["tp"], _data_axes(lay, roles)
    return _stream(lay, _megatron(lay, tp, data, "megatron"), data, tp, "B")


def _stream(lay: _Layout, pins: dict, data: list, tp: int, how: str) -> dict:
    """``pins`` with the residual stream (``lay.residual``) ``how`` on ``tp``, ``S(0)`` on ``data``."""
    for name, shape in lay.residual.items():
        per = {a: "S(0)" for a in data}
        per[tp] = how
        pins[name] = _nd(lay, f"the output of {name} (the residual stream)", shape, per)
    return pins


def sequence_parallel(model, example_inputs, mesh, *, tp: int = -1, graph: Optional[Graph] = None) -> dict:
    """Megatron-LM sequence parallelism: ``megatron`` on axis ``tp``, and between the blocks'
    matmuls the residual stream and the layer norms ``S(1)`` (split by sequence) on ``tp``
    instead of ``B``, so a reduce-scatter after each row-parallel matmul and an all-gather before
    each column-parallel one replace the all-reduce.

    Pins, besides Megatron's, the residual stream ``S(1)`` on ``tp`` (``S(0)`` on data axes):
    each residual add and the stream it adds to, what each column-parallel linear reads (its
    norm's output) and every norm of the stream."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, tp=tp)
    tp, data = roles["tp"], _data_axes(lay, roles)
    for name, shape in lay.residual.items():
        if len(shape) < 3:
            raise ValueError(f"sequence_parallel splits the residual stream by sequence (dim 1 of (batch, seq, "
                             f"features)), but {name} of the stream has shape {list(shape)}: use megatron for a "
                             "model without a sequence dim")
    return _stream(lay, _megatron(lay, tp, data, "sequence_parallel"), data, tp, "S(1)")


def tensor_2d(model, example_inputs, mesh, *, row: int = 0, col: int = 1, graph: Optional[Graph] = None) -> dict:
    """2-D tensor parallelism (SUMMA, Optimus; Tesseract's 2.5-D adds a data-like depth axis) on
    axes ``row`` and ``col``, other axes data parallel.

    Every block matmul ``Y = X W`` keeps X, W and Y ``(row: S0, col: S1)``: X's tokens split on
    ``row`` and features on ``col``; W (k x n) stored with k on ``row`` and n on ``col``, so
    ``weight`` (n, k) is stored ``(row: S(1), col: S(0))``, its bias ``(col: S(0))``. Each use
    gathers X over ``col`` and W over ``row`` (SUMMA's broadcasts) and computes
    ``(S0, B) x (B, S1) -> (S0, S1)``: the output is pinned ``(row: S(0), col: S(2))``. The
    inputs are split on the batch over ``row`` and the data axes."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, row=row, col=col)
    r, c, data = roles["row"], roles["col"], _data_axes(lay, roles)
    pins = _batch_pins(lay, data + [r])
    for l in _block_linears(lay, "tensor_2d"):
        pins[l.weight] = _nd(lay, l.weight, l.weight_shape, {r: _s(l.in_dim), c: _s(l.out_dim)})
        if l.bias:
            pins[l.bias] = _nd(lay, l.bias, (l.n_out,), {c: "S(0)"})
        out = {a: "S(0)" for a in data + [r]}
        out[c] = _s(_features(l))
        pins[l.node] = _out(lay, l, out)
    return _block_fused(lay, pins)


def tensor_3d(model, example_inputs, mesh, *, i: int = 0, j: int = 1, l: int = 2,
              graph: Optional[Graph] = None) -> dict:
    """3-D tensor parallelism (Bian et al.) on axes ``i``, ``j``, ``l``, other axes data parallel.

    A matmul ``Y = X W`` takes X ``(i: S0, j: S0, l: S1)`` and W (k x n) stored
    ``(l: S0, j: S1, i: S1)``: ``weight`` (n, k) ``(l: S(1), j: S(0), i: S(0))``, bias
    ``(j: S(0))``. It gathers X over ``j`` and W over ``i`` and computes
    ``(i: S0, j: S1, l: P)``: the output is pinned so; the reduce-scatter over ``l`` that follows
    leaves Y ``(i: S0, l: S0, j: S1)``, the next matmul's X with ``j`` and ``l`` swapped. So the
    roles of ``j`` and ``l`` alternate: column-type matmuls (qkv, fc) take them as given,
    row-type ones (proj, fc2) swapped. The inputs are split on the batch over ``i``, ``j`` and
    the data axes."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, i=i, j=j, l=l)
    i, j, l_, data = roles["i"], roles["j"], roles["l"], _data_axes(lay, roles)
    pins = _batch_pins(lay, data + [i, j])
    for lin in _block_linears(lay, "tensor_3d"):
        a, b = (j, l_) if lin.kind == "column" else (l_, j)     # (output-feature axis, contracted axis)
        out_, in_ = _s(lin.out_dim), _s(lin.in_dim)
        pins[lin.weight] = _nd(lay, lin.weight, lin.weight_shape, {b: in_, a: out_, i: out_})
        if lin.bias:
            pins[lin.bias] = _nd(lay, lin.bias, (lin.n_out,), {a: "S(0)"})
        out = {x: "S(0)" for x in data + [i]}
        out[a] = _s(_features(lin))
        out[b] = "P"
        pins[lin.node] = _out(lay, lin, out)
    return _block_fused(lay, pins)


def axonn_4d(model, example_inputs, mesh, *, x: Optional[int] = 0, y: Optional[int] = 1, z: Optional[int] = 2,
             graph: Optional[Graph] = None) -> dict:
    """AxoNN's 4-D layout: 3-D tensor parallelism on ``x``, ``y``, ``z`` times data parallelism on
    the other axes (AxoNN's ``d``; a mesh of three axes has none). A role given ``None`` is a
    group of one GPU (AxoNN's Gx, Gy or Gz = 1): its collectives vanish.

    A matmul ``Y = X W`` takes X ``(x: S1, y: B, z: S0, d: S0)`` and uses W (k x n) as
    ``(x: S0, y: S1, z: B)``: ``weight`` (n, k) ``(x: S(1), y: S(0))``, also stored split over
    ``z`` (on the dim whose other splitting axis is outer to ``z``, so the gather is one
    all-gather) and all-gathered over ``z`` before use, its gradient reduce-scattered there;
    ``B`` over ``data``, so all-reduced there. The output is ``(x: P, y: S(2), z: S(0),
    d: S(0))``, all-reduced over ``x``: the next matmul's X with ``x`` and ``y`` swapped, so
    column-type matmuls (qkv, fc) take the roles as given and row-type ones (proj, fc2) swapped.
    Biases are stored ``(y: S(0))`` like the output's features. The inputs are split on the batch
    over ``z`` and the data axes."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, x=x, y=y, z=z)
    if not roles:
        raise ValueError("axonn_4d needs at least one of x, y and z as a mesh axis: with none it is data_parallel")
    z, others = roles.get("z"), _data_axes(lay, roles)
    pins = _batch_pins(lay, others + ([z] if z is not None else []))
    for lin in _block_linears(lay, "axonn_4d"):
        a, b = (roles.get("x"), roles.get("y")) if lin.kind == "column" else (roles.get("y"), roles.get("x"))
        # (contracted, output) axes, None where absent; the weight's dims that each cuts
        cut_by = {lin.in_dim: a, lin.out_dim: b}
        used = {ax: _s(d) for d, ax in cut_by.items() if ax is not None}
        if z is not None:
            # store the z split on a dim whose other cut (if any) is outer to z, so the gather is one
            # all-gather; the output features' dim where both are
            zsize = lay.mesh[z]
            options = [d for d, ax in cut_by.items()
                       if (lin.weight_shape[d] // (lay.mesh[ax] if ax is not None else 1)) % zsize == 0]
            if not options:
                raise ValueError(f"{lin.weight} of shape {list(lin.weight_shape)} cannot also be split by axis {z} "
                                 f"of size {zsize} (mesh {lay.mesh}): choose sizes that divide")
            inner = {d: ax is not None and ax > z for d, ax in cut_by.items()}
            used[z] = _s(min(options, key=lambda d: (inner[d], d != lin.out_dim)))
        pins[lin.weight] = _nd(lay, lin.weight, lin.weight_shape, used)
        if lin.bias:
            pins[lin.bias] = _nd(lay, lin.bias, (lin.n_out,), {b: "S(0)"} if b is not None else {})
        out = {o: "S(0)" for o in others + ([z] if z is not None else [])}
        if a is not None:
            out[a] = "P"
        if b is not None:
            out[b] = _s(_features(lin))
        pins[lin.node] = _out(lay, lin, out)
    return _block_fused(lay, pins)


FORMS = ("allgather", "ring")


def _attention_pin(mesh: tuple, per: dict, form: Optional[str], cp: int, shape: tuple, mask: Optional[tuple]):
    """An attention node's pin: its output alone, or with ``form`` its whole strategy
    (``"inputs -> output"``), the keys and values gathered whole on ``cp`` (all-gather) or kept
    split there (ring); a mask (of shape ``mask``) split with the output where it has the
    output's dim, its columns whole."""
    out = tuple(per.get(a, "B") for a in range(len(mesh)))
    if form is None:
        return out
    kv = tuple("B" if a == cp and form == "allgather" else p for a, p in enumerate(out))
    ins = [out, kv, kv]
    if mask is not None:
        ins.append(tuple(p if p == "B" else pl.to_strings((mask_placement(mask, shape, pl.parse(p).dim),))[0]
                         for p in out))
    return " -> ".join([", ".join(_paren(t) for t in ins), _paren(out)])


def _paren(placements: tuple) -> str:
    return "(" + ", ".join(placements) + ")"


def context_parallel(model, example_inputs, mesh, *, axis: int = -1, fsdp: bool = False,
                     form: Optional[str] = None, graph: Optional[Graph] = None) -> dict:
    """Context parallelism on mesh axis ``axis``, the other axes data parallel: every activation
    split along the sequence on ``axis``, attention's queries too, each rank's keys and values
    gathered whole (Llama 3's all-gather form) or passed round the ring (``form``: "allgather",
    "ring", or None for the solver's choice). Parameters are ``B`` (gradients all-reduced over
    every axis), or with ``fsdp=True`` stored split over every axis as ``fsdp`` stores them
    (torchtitan shards over data and context axes together).

    Pins the inputs ``S(0)`` (batch) on data axes and ``S(1)`` (sequence) on ``axis``; every
    linear's output ``S(1)`` on ``axis`` (``S(0)`` where the model flattens tokens); each fused
    attention's output (batch, heads, seq, head_dim) ``S(2)`` on ``axis``; the parameters."""
    if form is not None and form not in FORMS:
        raise ValueError(f"form is one of {', '.join(map(repr, FORMS))}, or None for the solver's choice; got {form!r}")
    if not isinstance(fsdp, bool):
        raise TypeError(f"fsdp is True or False; got {fsdp!r}")
    lay = _layout(model, example_inputs, mesh, graph)
    cp = _axes(lay, axis=axis)["axis"]
    data = [a for a in range(len(lay.mesh)) if a != cp]
    pins = {}
    for name, shape in lay.inputs.items():
        if len(shape) < 2:
            raise ValueError(f"context_parallel splits the inputs by sequence (dim 1 of (batch, seq, ...)), but input "
                             f"{name!r} has shape {list(shape)}: give each input a batch and a sequence dim")
        pins[name] = _nd(lay, f"input {name!r}", shape, {**{a: "S(0)" for a in data}, cp: "S(1)"})
    pins.update(_sharded_params(lay, range(len(lay.mesh))) if fsdp else
                {name: ("B",) * len(lay.mesh) for name in lay.params})
    for l in lay.linears:
        seq = {cp: "S(1)"} if len(l.out_shape) >= 3 else {cp: "S(0)"}
        pins[l.node] = _out(lay, l, {**{a: "S(0)" for a in data}, **seq})
    if not lay.attention:
        raise ValueError("context_parallel splits attention along the sequence, but the model has no "
                         "scaled_dot_product_attention: use data_parallel or sequence_parallel")
    if form == "ring" and lay.dropped:
        raise ValueError(f"the ring form takes no attention dropout, and {lay.dropped[0]} has dropout_p > 0: "
                         "use form='allgather' (or None), or dropout_p=0")
    for name, shape in lay.attention.items():
        per = {**{a: "S(0)" for a in data}, cp: _s(len(shape) - 2)}
        _nd(lay, f"the output of {name} (attention)", shape, per)
        pins[name] = _attention_pin(lay.mesh, per, form, cp, shape, lay.masks.get(name))
    return pins


SCHEMES = {
    "data_parallel": data_parallel,
    "fsdp": fsdp,
    "megatron": megatron,
    "sequence_parallel": sequence_parallel,
    "tensor_2d": tensor_2d,
    "tensor_3d": tensor_3d,
    "axonn_4d": axonn_4d,
    "context_parallel": context_parallel,
}

# (scheme, mesh, roles): each scheme on the mesh it is usually run on at 256 GPUs in nodes of 8,
# tensor parallel within a node (the last axis is innermost), data parallel across nodes
USUAL_256 = [
    ("data_parallel", (256,), {}),
    ("fsdp", (256,), {}),
    ("fsdp", (32, 8), {"shard": 1}),          # hybrid: sharded within a node, replicated across
    ("megatron", (32, 8), {"tp": 1}),
    ("sequence_parallel", (32, 8), {"tp": 1}),
    ("tensor_2d", (16, 16), {"row": 0, "col": 1}),
    ("tensor_3d", (4, 8, 8), {"i": 0, "j": 1, "l": 2}),
    ("axonn_4d", (4, 4, 4, 4), {"x": 3, "y": 2, "z": 1}),   # AxoNN's order: x innermost, data outermost
]
