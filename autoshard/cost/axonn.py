"""AxoNN's own ranking of its 4-D configurations (DESIGN.md section 6), priced on our cluster.

AxoNN (Singh et al., SC'24) runs every linear layer ``Y = X W`` (X: T x k, W: k x n) on a 3-D
tensor-parallel grid Gx x Gy x Gz, times Gd data-parallel groups, and chooses the grid with an
analytic model of each layer's communication. Per GPU and per layer, in elements:

    forward   all-gather of W over z        (Gz-1)/Gz  * kn/(Gx Gy)
              all-reduce of Y over x        2(Gx-1)/Gx * T/(Gz Gd) * n/Gy
    backward  all-gather of W over z        (Gz-1)/Gz  * kn/(Gx Gy)       (W is not kept gathered)
              all-reduce of dX over y       2(Gy-1)/Gy * T/(Gz Gd) * k/Gx
              reduce-scatter of dW over z   (Gz-1)/Gz  * kn/(Gx Gy)
    step      all-reduce of dW over data    2(Gd-1)/Gd * kn/(Gx Gy Gz)

A layer's output Y leaves split by features over y, which is how the next layer wants X if that
layer swaps x and y: layers alternate, and a ``transposed`` layer (proj after qkv, fc2 after fc)
prices the same formulas with the roles (and links) of x and y exchanged.

Volumes become seconds with the alpha-beta model of ``cost.comm``: an all-gather or
reduce-scatter over p GPUs costs its launch overhead, p-1 ring steps' latency and the bytes each
GPU sends over its group's bandwidth; an all-reduce costs what ``cost.comm.all_reduce_time`` says
(the faster of a ring, which sends the volume above, and a tree), so both sides of a comparison
with autoshard's plans price a collective alike. The data-parallel gradient all-reduce rides in
buckets of ``bucket_bytes`` and pays launch and latency in proportion to its size, as autoshard's
own gradient all-reduces do (``cost.price.Costs.grad_syncs``). A group of one GPU costs nothing.

Which links a group gets is decided by where it sits on the hardware: the four groups are laid
out as a mesh, innermost last, and ``Cluster.axis_links`` prices each axis (within a node:
NVLink; across nodes: the node's network shared by the groups that cross at once). AxoNN puts x
innermost, then y, z and data, so its default mesh is ``(Gd, Gz, Gy, Gx)``; ``orders="all"``
also evaluates the other 23 assignments.

A configuration is kept only if it divides the shapes: k and n by the tensor-parallel groups that
split them, the weight's share by Gz, and the tokens by Gz Gd. With ``memory_budget`` it is also
kept only if its share of the linears' parameters, gradients and Adam state fits (16 bytes per
fp32 parameter; activations are not counted).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from autoshard import placement as pl
from autoshard.convert import dual_steps
from autoshard.machine.cluster import Cluster
from autoshard.cost import comm
from autoshard.cost.compute import BACKWARD_FACTOR
from autoshard.cost.memory import ADAM_STATE_BYTES
from autoshard.cost.step import Cost
from autoshard.cost.buckets import BUCKET_BYTES

GROUPS = ("x", "y", "z", "d")
AXONN_ORDER = ("x", "y", "z", "d")   # innermost first: AxoNN's placement of its groups on the hardware
PARTS = ("all_gather_w", "all_reduce_y", "all_reduce_dx", "reduce_scatter_dw", "all_reduce_dw")


@dataclass(frozen=True)
class Layer:
    """One linear layer ``k -> n``; ``transposed`` swaps the roles of x and y (every other layer)."""
    k: int
    n: int
    transposed: bool = False


@dataclass(frozen=True)
class Config:
    gx: int
    gy: int
    gz: int
    gd: int
    order: tuple                 # the groups innermost first, e.g. ("x", "y", "z", "d")
    seconds: float               # communication of one training step, every layer
    parts: dict = field(hash=False, compare=False)   # seconds by collective (PARTS)
    state_bytes: float = 0.0     # per GPU: the linears' parameters, gradients and Adam state

    @property
    def sizes(self) -> dict:
        return {"x": self.gx, "y": self.gy, "z": self.gz, "d": self.gd}

    @property
    def blocking(self) -> float:
        """Seconds of the activation all-reduces (Y over x, dX over y): compute waits for them."""
        return self.parts["all_reduce_y"] + self.parts["all_reduce_dx"]

    def exposed(self, compute_fwd: float, compute_bwd: float) -> float:
        """Communication the step waits for beside ``compute_fwd`` and ``compute_bwd`` seconds of
        compute, with autoshard's overlap rule (``cost.step``): the weight all-gathers, the dW
        reduce-scatter and the data all-reduce are parameter collectives a schedule starts early
        (one gather per phase), the activation all-reduces block."""
        gather = self.parts["all_gather_w"] / 2
        hidden_bwd = gather + self.parts["reduce_scatter_dw"] + self.parts["all_reduce_dw"]
        return Cost(compute_fwd=compute_fwd, compute_bwd=compute_bwd, comm=self.blocking,
                    hidden_fwd=gather, hidden_bwd=hidden_bwd).exposed

    def __str__(self) -> str:
        return (f"Gx={self.gx} Gy={self.gy} Gz={self.gz} Gd={self.gd} "
                f"({','.join(self.order)} innermost first): {self.seconds * 1e3:.3f} ms")


def gpt_layers(d: int, layers: int, *, ffn: int = 4, vocab: Optional[int] = None) -> list:
    """The linears of a GPT stack: per block qkv (d -> 3d), proj (d -> d, transposed), fc
    (d -> ffn d) and fc2 (ffn d -> d, transposed); with ``vocab``, the head (d -> vocab) too."""
    if d < 1 or layers < 0 or ffn < 1:
        raise ValueError(f"a GPT stack needs d >= 1, layers >= 0 and ffn >= 1, got d={d}, layers={layers}, ffn={ffn}")
    block = [Layer(d, 3 * d), Layer(d, d, True), Layer(d, ffn * d), Layer(ffn * d, d, True)]
    out = block * layers
    if vocab:
        out.append(Layer(d, vocab))
    return out


def compute_seconds(layers: Sequence[Layer], tokens: int, world: int, cluster: Cluster, itemsize: int = 4) -> tuple:
    """(forward, backward) seconds of the stack's matmuls on one GPU when ``world`` GPUs share
    them without redundancy, as ``cost.compute`` prices a matmul."""
    flops = sum(2 * tokens * layer.k * layer.n for layer in layers) / world
    fwd = flops / (cluster.efficiency * cluster.matmul_flops(itemsize))
    return fwd, BACKWARD_FACTOR * fwd


def grids(world: int) -> list:
    """Every (Gx, Gy, Gz, Gd) of positive integers whose product is ``world``."""
    divisors = [f for f in range(1, world + 1) if world % f == 0]
    out = []
    for gx, gy, gz in itertools.product(divisors, repeat=3):
        if world % (gx * gy * gz) == 0:
            out.append((gx, gy, gz, world // (gx * gy * gz)))
    return out


def divides(layers: Sequence[Layer], tokens: int, gx: int, gy: int, gz: int, gd: int) -> bool:
    if tokens % (gz * gd):
        return False
    for layer in layers:
        ax, ay = (gy, gx) if layer.transposed else (gx, gy)
        if layer.k % ax or layer.n % ay or (layer.k // ax) * (layer.n // ay) % gz:
            return False
    return True


def layer_volumes(layer: Layer, tokens: int, gx: int, gy: int, gz: int, gd: int) -> dict:
    """Elements each GPU sends per collective of one layer, forward and backward, and the group
    each runs over: {part: (group, elements)}. The all-gather of W counts twice (forward and
    backward)."""
    k, n = layer.k, layer.n
    x, y = ("y", "x") if layer.transposed else ("x", "y")
    ax, ay = (gy, gx) if layer.transposed else (gx, gy)
    rows = tokens / (gz * gd)
    return {
        "all_gather_w": ("z", 2 * (gz - 1) / gz * k * n / (ax * ay)),
        "all_reduce_y": (x, 2 * (ax - 1) / ax * rows * n / ay),
        "all_reduce_dx": (y, 2 * (ay - 1) / ay * rows * k / ax),
        "reduce_scatter_dw": ("z", (gz - 1) / gz * k * n / (ax * ay)),
        "all_reduce_dw": ("d", 2 * (gd - 1) / gd * k * n / (ax * ay * gz)),
    }


def step_seconds(layers: Sequence[Layer], tokens: int, sizes: dict, order: Sequence[str], cluster: Cluster,
                 itemsize: int = 4, bucket_bytes: int = BUCKET_BYTES) -> dict:
    """Seconds of every collective of one training step, by part, for groups of ``sizes``
    laid out innermost first in ``order``."""
    mesh = [sizes[g] for g in reversed(order)]
    links = dict(zip(reversed(order), cluster.axis_links(mesh)))
    out = dict.fromkeys(PARTS, 0.0)
    seconds: dict = {}   # a layer's seconds by part, once per shape: a stack repeats a few
    for layer in layers:
        key = (layer.k, layer.n, layer.transposed)
        if key not in seconds:
            seconds[key] = _layer_seconds(layer, tokens, sizes, links, itemsize, bucket_bytes)
        for part, t in seconds[key]:
            out[part] += t
    return out


def _layer_seconds(layer: Layer, tokens: int, sizes: dict, links: dict, itemsize: int, bucket_bytes: int) -> list:
    """[(part, seconds)] of one layer's collectives (``step_seconds``)."""
    out = []
    vols = layer_volumes(layer, tokens, sizes["x"], sizes["y"], sizes["z"], sizes["d"])
    for part, (group, elements) in vols.items():
        p = sizes[group]
        if p == 1:
            continue
        alpha, beta, overhead = links[group]
        if part == "all_reduce_dw":   # bucketed: the gradient share pays its part of a launch
            nbytes = layer.k * layer.n / (sizes["x"] * sizes["y"] * sizes["z"]) * itemsize
            out.append((part, comm.all_reduce_time(nbytes, p, links[group], min(1.0, nbytes / bucket_bytes))))
        elif part.startswith("all_reduce"):
            nbytes = elements * itemsize * p / (2 * (p - 1))    # the tensor reduced
            out.append((part, comm.all_reduce_time(nbytes, p, links[group])))
        else:   # the all-gather of W runs twice (forward, backward), the reduce-scatter once
            launches = 2 if part == "all_gather_w" else 1
            out.append((part, launches * (overhead + (p - 1) * alpha) + elements * itemsize / beta))
    return out


def rank(layers: Sequence[Layer], tokens: int, world: int, cluster: Cluster, *, itemsize: int = 4,
         orders: "str | Iterable[Sequence[str]]" = "axonn", bucket_bytes: int = BUCKET_BYTES,
         memory_budget: Optional[float] = None) -> list:
    """Every AxoNN configuration of ``world`` GPUs for the stack ``layers`` (``tokens`` per step),
    cheapest communication first.

    ``orders``: ``"axonn"`` (x innermost, then y, z, data), ``"all"`` (all 24 assignments of the
    groups to the hardware), or a list of orders, each the four groups innermost first. A
    configuration whose groups of one GPU make two orders the same is listed once."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world is a positive number of GPUs, got {world!r}")
    if not layers:
        raise ValueError("give the stack's linear layers, e.g. autoshard.cost.axonn.gpt_layers(d, layers)")
    if orders == "axonn":
        orders = [AXONN_ORDER]
    elif orders == "all":
        orders = list(itertools.permutations(GROUPS))
    orders = [tuple(o) for o in orders]
    for o in orders:
        if sorted(o) != sorted(GROUPS):
            raise ValueError(f"an order names each of {GROUPS} once, innermost first; got {o}")
    weights = sum(layer.k * layer.n for layer in layers)
    out, seen = [], set()
    for gx, gy, gz, gd in grids(world):
        if not divides(layers, tokens, gx, gy, gz, gd):
            continue
        state = weights / (gx * gy * gz) * (2 * itemsize + ADAM_STATE_BYTES)
        if memory_budget is not None and state > memory_budget:
            continue
        sizes = {"x": gx, "y": gy, "z": gz, "d": gd}
        for order in orders:
            placed = tuple(g for g in order if sizes[g] > 1)   # where the groups that talk sit
            if (gx, gy, gz, gd, placed) in seen:
                continue
            seen.add((gx, gy, gz, gd, placed))
            parts = step_seconds(layers, tokens, sizes, order, cluster, itemsize, bucket_bytes)
            out.append(Config(gx, gy, gz, gd, order, sum(parts.values()), parts, state))
    out.sort(key=lambda c: (c.seconds, c.gx, c.gy, c.gz, c.order))
    return out


def as_scheme(config: Config):
    """The configuration as a hand plan of ``autoshard.schemes``: (scheme name, mesh, roles). The groups of more than one GPU become the mesh axes in
    the configuration's order (innermost last): data alone is ``data_parallel``, z alone (beside
    data) ``fsdp`` sharded over z, y alone ``megatron`` (W split by its n: column-parallel first,
    as AxoNN's layer 1), any other mix ``axonn_4d`` with the groups of one GPU left out."""
    groups = [g for g in reversed(config.order) if config.sizes[g] > 1]
    mesh = tuple(config.sizes[g] for g in groups)
    axis = {g: i for i, g in enumerate(groups)}
    tp = [g for g in ("x", "y", "z") if g in axis]
    if not tp:
        return "data_parallel", mesh, {}
    if tp == ["z"]:
        return "fsdp", mesh, {"shard": axis["z"]}
    if tp == ["y"]:
        return "megatron", mesh, {"tp": axis["y"]}
    return "axonn_4d", mesh, {g: axis.get(g) for g in ("x", "y", "z")}


# ---- a plan's communication, counted as AxoNN counts its own ---------------------------------------

MATMULS = {"linear.default": 1, "mm.default": 1, "matmul.default": 1, "addmm.default": 2}   # -> the weight's slot
BIAS = {"linear.default": 2, "addmm.default": 0}   # -> the bias's slot


def plan_traffic(plan, graph) -> dict:
    """Seconds per step of a plan's collectives (``autoshard.Plan``, made from ``graph``):

    ``total``   every collective, overlapped or not: the sum over ``plan.collectives``, which is
                ``breakdown`` comm + hidden_fwd + hidden_bwd;
    ``linear``  the part that serves the linear layers, the traffic AxoNN's formulas count: the
                conversions (forward and their backward duals) of every tensor a matmul multiplies, and
                of every value derived from a matmul's output alone (through views, splits,
                dropout, attention on its own q, k, v) until it meets another tensor, and the
                gradient all-reduces of the matmuls' weights. Any re-layout of a matmul's output
                for attention and the residual add of a matmul's output count here too, so
                ``linear`` can only overstate the plan against AxoNN's figure;
    ``other``   the rest: layer-norm statistics, the loss's all-reduces, the biases' gathers and
                gradients (AxoNN's formulas count W alone), the gradients of parameters no matmul
                takes (embeddings, norms), conversions on the residual stream;
    ``converted``  per consumer node, the seconds of the conversions of its inputs.

    The edges are re-priced with ``cost.comm`` from the plan's placements, as ``make_plan``
    prices them: ``converted`` of a node is what ``plan.collectives`` records there, less the
    op's own reductions (the tests check it)."""
    mesh = tuple(plan.mesh_shape)
    links = plan.cluster.axis_links(mesh)
    by = graph.by_name
    derived, matmul_params = set(), set()
    for n in graph.nodes:
        if n.kind != "op":
            continue
        producers = {v[0] for v in n.inputs if by[v[0]].kind == "op"}
        if n.op_name in MATMULS:
            derived.add(n.name)
            slot = MATMULS[n.op_name]
            if len(n.inputs) > slot and by[n.inputs[slot][0]].kind == "param":   # the weight, not the bias
                matmul_params.add(n.inputs[slot][0])
        elif producers and producers <= derived:
            derived.add(n.name)
    linear, converted = 0.0, {}
    for n in graph.nodes:
        choice = plan.nodes[n.name]
        for slot, value in enumerate(n.inputs):
            producer = by[value[0]]
            meta = graph.meta(value)
            src = plan.nodes[producer.name].out_placements()[value[1]]
            dst = choice.in_placements()[slot]
            steps = comm.transition(pl.local_shape(meta.shape, src, mesh), src, dst, mesh, links, meta.itemsize)
            if plan.training and meta.floating and n.kind != "output" and producer.requires_grad:
                steps = steps + dual_steps(steps, mesh)
            t = sum(comm.step_time(st, meta.itemsize, mesh, links) for st in steps)
            converted[n.name] = converted.get(n.name, 0.0) + t
            if producer.name in derived or n.op_name in MATMULS and slot != BIAS.get(n.op_name):
                linear += t
    linear += sum(c.seconds for c in plan.collectives if c.node in matmul_params)
    total = sum(c.seconds for c in plan.collectives)
    return {"total": total, "linear": linear, "other": total - linear, "converted": converted}
