"""The hand-designed parallel schemes of DESIGN.md section 6, as pins for ``autoshard.plan``.

Each function takes a GPT-style model (blocks of ln1, qkv, proj, ln2, fc, fc2; an embedding tied
to the head), its example inputs and a mesh shape, names the role of each mesh axis, and returns
``{name: per-axis placements}`` to pass as ``pin=``. The solver plans whatever a scheme leaves
open, so every scheme is costed by the same model as autoshard's own plan:

    pins = autoshard.schemes.tensor_3d(model, (idx, targets), mesh=(4, 4, 4, 4), i=0, j=1, l=2)
    plan = autoshard.plan(model, (idx, targets), mesh=(4, 4, 4, 4), pin=pins)

Each captures the model to find its matmuls (by the parameter each multiplies, so no node names
are assumed); ``graph=`` reuses one ``autoshard.passes.capture.capture(model, inputs)`` for several.

A scheme pins the storage of the weights it lays out and, where it dictates how a matmul is
computed rather than only where weights live, that matmul's output (a graph node, found by the
weight it multiplies). Mesh axes given no role are data-parallel axes: they split the batch,
replicate the parameters and all-reduce their gradients.

Placements are per axis of the ``nn.Linear`` call ``y = x @ weight.T + bias``; ``weight`` is
(out, in), so the design's ``W (k x n)`` is ``weight.T``: a split of W's dim 0 (k) is a split of
weight's dim 1 and the other way round. Activations are (batch, seq, features): "S0" of the
design's token dim is a split of the batch (``S(0)``), its feature dim is ``S(2)``.

A split that does not divide evenly is a ``ValueError`` naming the tensor, the axis and the size.
The GPT here fuses q, k and v into one linear whose weight holds them side by side, so a
contiguous split of its output features would straddle q, k and v. Where a scheme splits those
features, it splits them in blocks (``S(0)/3`` of the weight and bias, ``S(2)/3`` of the output:
each rank holds its share of q, of k and of v, as Megatron-LM lays out its fused qkv weight), so
the split into q, k and v and the attention heads stay local; where two axes split them (3-D,
AxoNN 4-D), not yet (see ``_block_fused``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from autoshard import placement as pl
from autoshard.passes.annotate import blocked_splits
from autoshard.passes.capture import Graph, capture

aten = torch.ops.aten

# block linears by the name of their module: column-type ones widen the features (their output is
# split by features under tensor parallelism), row-type ones contract them back
COLUMN = ("qkv", "fc")
ROW = ("proj", "fc2")


@dataclass
class _Linear:
    node: str                 # graph node of the matmul
    weight: str               # the weight's parameter name
    bias: Optional[str]
    weight_shape: tuple       # (out, in)
    out_shape: tuple
    kind: str                 # "column", "row", or "other" (the head)


@dataclass
class _Layout:
    """What the schemes need from the captured graph."""
    mesh: tuple
    inputs: dict              # user input name -> shape
    params: dict              # parameter name the graph uses -> shape
    linears: list
    blocked: dict             # matmul node -> the number of blocks its output is split into downstream
    residual: dict = field(default_factory=dict)   # nodes feeding and leaving each layer norm -> shape


def _layout(model, example_inputs, mesh, graph: Optional[Graph] = None) -> _Layout:
    if isinstance(mesh, int):
        mesh = (mesh,)
    mesh = tuple(mesh)
    if not mesh or any(not isinstance(a, int) or a < 1 for a in mesh):
        raise ValueError(f"mesh is a tuple of axis sizes such as (4, 2), got {mesh!r}")
    graph = graph if graph is not None else capture(model, example_inputs)
    by = graph.by_name
    params = {n.fqn: n.outputs[0].shape for n in graph.nodes if n.kind == "param"}
    inputs = {n.name: n.outputs[0].shape for n in graph.nodes if n.kind == "input" and n.outputs}
    linears, residual = [], {}
    for n in graph.nodes:
        if n.kind != "op":
            continue
        if n.target == aten.linear.default and len(n.inputs) >= 2 and by[n.inputs[1][0]].kind == "param":
            w = by[n.inputs[1][0]]
            b = by[n.inputs[2][0]] if len(n.inputs) > 2 and by[n.inputs[2][0]].kind == "param" else None
            parts = w.fqn.split(".")
            owner = parts[-2] if len(parts) > 1 else ""
            # a weight tied to another module's (the head's, to the embedding) is no block's
            tied = [a for a, f in graph.param_aliases.items() if f == w.fqn and a != w.fqn]
            kind = "other" if tied else "column" if owner in COLUMN else "row" if owner in ROW else "other"
            linears.append(_Linear(n.name, w.fqn, b.fqn if b else None, w.outputs[0].shape,
                                   n.outputs[0].shape, kind))
        elif n.target in (aten.layer_norm.default, aten.rms_norm.default):
            src = graph.meta(n.inputs[0])
            if by[n.inputs[0][0]].kind == "op" and n.inputs[0][1] == 0:
                residual[n.inputs[0][0]] = src.shape
            residual[n.name] = n.outputs[0].shape
    if not any(l.kind == "column" for l in linears) or not any(l.kind == "row" for l in linears):
        raise ValueError(f"found no block linears named {COLUMN} (column-type) and {ROW} (row-type): "
                         "the schemes are for GPT-style models whose blocks have qkv, proj, fc and fc2")
    blocked = {name: g for name, (_, g) in blocked_splits(graph).items()}
    return _Layout(mesh, inputs, params, linears, blocked, residual)


def _axes(lay: _Layout, **roles) -> dict:
    """Role -> mesh axis (negative counts from the end; None: the role is absent)."""
    n = len(lay.mesh)
    out = {}
    for role, a in roles.items():
        if a is None:
            continue
        if not isinstance(a, int) or not -n <= a < n:
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


def _block_linears(lay: _Layout):
    return [l for l in lay.linears if l.kind != "other"]


def _s(d: int) -> str:
    return f"S({d})"


def _features(lin: _Linear) -> int:
    return len(lin.out_shape) - 1


def _out(lay: _Layout, lin: _Linear, per_axis: dict) -> tuple:
    return _nd(lay, f"the output of {lin.node} (the matmul by {lin.weight})", lin.out_shape, per_axis)


def _block_fused(lay: _Layout, pins: dict) -> dict:
    """A fused projection (qkv) split by its output features is split in its blocks instead:
    ``S(0)`` of its weight and bias and ``S(features)`` of its output become ``S(d)/g``. Not
    where the weight's features are split by two axes (3-D, AxoNN 4-D): a parameter may be
    stored in blocks on one axis only (``passes.annotate.storage_options``), and those schemes
    leave the solver to re-lay the fused output for attention."""
    for lin in lay.linears:
        g = lay.blocked.get(lin.node, 1)
        if g == 1 or sum(p == "S(0)" for p in pins.get(lin.weight, ())) > 1:
            continue
        for name, dim, shape in ((lin.weight, 0, lin.weight_shape), (lin.bias, 0, (lin.weight_shape[0],)),
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
    shard = list(range(n)) if shard is None else [a % n for a in ([shard] if isinstance(shard, int) else shard)]
    pins = _batch_pins(lay, range(n))
    ways = math.prod(lay.mesh[a] for a in shard)
    for name, shape in lay.params.items():
        dim = next((d for d, s in enumerate(shape) if s % ways == 0 and s >= ways), None)
        pins[name] = _nd(lay, name, shape, {} if dim is None else {a: _s(dim) for a in shard})
    for l in lay.linears:
        pins[l.node] = _out(lay, l, {a: "S(0)" for a in range(n)})
    return pins


def _megatron(lay: _Layout, tp: int, data: list) -> dict:
    pins = _batch_pins(lay, data)
    for l in _block_linears(lay):
        n, _ = l.weight_shape
        col = l.kind == "column"
        w = {tp: "S(0)" if col else "S(1)"}
        pins[l.weight] = _nd(lay, l.weight, l.weight_shape, w)
        if l.bias:
            pins[l.bias] = _nd(lay, l.bias, (n,), {tp: "S(0)"} if col else {})
        out = {a: "S(0)" for a in data}
        out[tp] = _s(_features(l)) if col else "P"
        pins[l.node] = _out(lay, l, out)
    return _block_fused(lay, pins)


def megatron(model, example_inputs, mesh, *, tp: int = -1, graph: Optional[Graph] = None) -> dict:
    """Megatron-LM 1-D tensor parallelism on axis ``tp`` (other axes: data parallel).

    Column-parallel qkv and fc: weight stored ``S(0)`` (W's n), bias ``S(0)``, output ``S(2)``:
    ``(B, S1) -> S1``. Row-parallel proj and fc2: weight ``S(1)`` (W's k), bias ``B``, output
    ``P``: ``(S1, S0) -> P``, all-reduced (or reduce-scattered) before the residual add. On data
    axes weights are ``B`` and the inputs and linear outputs ``S(0)``. Layer norms, embeddings
    and the head are the solver's choice."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, tp=tp)
    return _megatron(lay, roles["tp"], _data_axes(lay, roles))


def sequence_parallel(model, example_inputs, mesh, *, tp: int = -1, graph: Optional[Graph] = None) -> dict:
    """Megatron-LM sequence parallelism: ``megatron`` on axis ``tp``, and between the blocks'
    matmuls the residual stream and the layer norms ``S(1)`` (split by sequence) on ``tp``
    instead of ``B``, so a reduce-scatter after each row-parallel matmul and an all-gather before
    each column-parallel one replace the all-reduce.

    Pins, besides Megatron's, the output of every layer norm and of the node feeding it ``S(1)``
    on ``tp`` (``S(0)`` on data axes)."""
    lay = _layout(model, example_inputs, mesh, graph)
    roles = _axes(lay, tp=tp)
    tp, data = roles["tp"], _data_axes(lay, roles)
    pins = _megatron(lay, tp, data)
    for name, shape in lay.residual.items():
        per = {a: "S(0)" for a in data}
        per[tp] = "S(1)"
        pins[name] = _nd(lay, f"the output of {name} (the residual stream)", shape, per)
    return pins


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
    for l in _block_linears(lay):
        n, _ = l.weight_shape
        pins[l.weight] = _nd(lay, l.weight, l.weight_shape, {r: "S(1)", c: "S(0)"})
        if l.bias:
            pins[l.bias] = _nd(lay, l.bias, (n,), {c: "S(0)"})
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
    for lin in _block_linears(lay):
        a, b = (j, l_) if lin.kind == "column" else (l_, j)     # (output-feature axis, contracted axis)
        n, _ = lin.weight_shape
        pins[lin.weight] = _nd(lay, lin.weight, lin.weight_shape, {b: "S(1)", a: "S(0)", i: "S(0)"})
        if lin.bias:
            pins[lin.bias] = _nd(lay, lin.bias, (n,), {a: "S(0)"})
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
    for lin in _block_linears(lay):
        a, b = (roles.get("x"), roles.get("y")) if lin.kind == "column" else (roles.get("y"), roles.get("x"))
        n, _ = lin.weight_shape                                  # (contracted, output) axes; None: absent
        used = {ax: p for ax, p in ((a, "S(1)"), (b, "S(0)")) if ax is not None}
        if z is not None:
            # store the z split on a dim whose other cut (if any) is outer to z, so the gather is one all-gather
            zsize = lay.mesh[z]
            cuts = {0: lay.mesh[b] if b is not None else 1, 1: lay.mesh[a] if a is not None else 1}
            inner = {0: b is not None and b > z, 1: a is not None and a > z}
            options = [d for d in (0, 1) if (lin.weight_shape[d] // cuts[d]) % zsize == 0]
            if not options:
                raise ValueError(f"{lin.weight} of shape {list(lin.weight_shape)} cannot also be split by axis {z} "
                                 f"of size {zsize} (mesh {lay.mesh}): choose sizes that divide")
            used[z] = _s(min(options, key=lambda d: (inner[d], d)))
        pins[lin.weight] = _nd(lay, lin.weight, lin.weight_shape, used)
        if lin.bias:
            pins[lin.bias] = _nd(lay, lin.bias, (n,), {b: "S(0)"} if b is not None else {})
        out = {o: "S(0)" for o in others + ([z] if z is not None else [])}
        if a is not None:
            out[a] = "P"
        if b is not None:
            out[b] = _s(_features(lin))
        pins[lin.node] = _out(lay, lin, out)
    return _block_fused(lay, pins)


SCHEMES = {
    "data_parallel": data_parallel,
    "fsdp": fsdp,
    "megatron": megatron,
    "sequence_parallel": sequence_parallel,
    "tensor_2d": tensor_2d,
    "tensor_3d": tensor_3d,
    "axonn_4d": axonn_4d,
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
