"""Golden plans at world 256, planned on the meta device with no process group.

A GPT stack in three regimes, each planned once per module: autoshard's own plan (mesh search
over ``world=256``) against every hand-designed scheme of ``autoshard.schemes`` on its usual mesh,
each a pinned ``autoshard.plan`` costed by the same model within the same memory budget, and
against AxoNN's own ranking of its 4-D configurations (``autoshard.cost.axonn``).

    small model, large batch   the weights are cheap to replicate, the activations are not
    wide model, small batch    the weights dwarf the activations
    does not fit replicated    16 bytes per parameter (fp32 weight, gradient, two Adam moments)
                               exceed the device: only sharded plans are competitors

A hand plan whose pins do not divide the model's shapes is not legal on its mesh, and one that
cannot fit the budget (``MemoryBudgetError``) is no competitor; both are reported in the failure
messages beside the others. Hand plans on 3- and 4-axis meshes are completed by one-axis descent
(a local optimum), the others exactly.

AxoNN ranks its grids by its formulas for the linear layers' traffic; ``axonn.plan_traffic``
counts the same traffic in our plans (``linear``: conversions of what the matmuls multiply and
of their outputs, and their weights' gradient all-reduces), beside every collective (``total``).
"""
import math

import pytest
import torch

import autoshard
from autoshard import schemes
from autoshard.cost import axonn
from autoshard.cost import comm
from autoshard.cost.comm import all_reduce_time
from autoshard.passes.capture import capture
from autoshard.planner.solve import MemoryBudgetError
from models import GPT

pytestmark = pytest.mark.long("three GPT blocks planned for 256 devices by the mesh search, and each against every hand scheme: 36 s on 2 cores")

CLUSTER = "a100-80gb-nvlink-ib"     # 8 A100-80GB per node: world 256 is 32 nodes
WORLD = 256
BUDGET = 80e9
TOL = 1e-3                          # the solver stops within 0.1% of the optimum (planner.solve.GAP_LIMIT)

# one block each: planning time grows with the graph, and one block has every op a GPT repeats
REGIMES = {
    "small_model_large_batch": dict(layers=1, d=512, heads=8, seq=1024, batch=256, vocab=1024),
    "wide_model_small_batch": dict(layers=1, d=8192, heads=64, seq=32, batch=256, vocab=1024),
    "does_not_fit_replicated": dict(layers=1, d=24576, heads=192, seq=64, batch=256, vocab=1024),  # 7.3B
}

HAND = schemes.USUAL_256


def _label(scheme, mesh, roles):
    extra = ",".join(f"{k}={v}" for k, v in roles.items())
    return f"{scheme}{mesh}" + (f"[{extra}]" if extra else "")


class Regime:
    def __init__(self, name):
        cfg = REGIMES[name]
        with torch.device("meta"):
            self.model = GPT(vocab=cfg["vocab"], d=cfg["d"], heads=cfg["heads"], layers=cfg["layers"], seq=cfg["seq"])
        idx = torch.empty(cfg["batch"], cfg["seq"], dtype=torch.long, device="meta")
        self.cfg, self.inputs = cfg, (idx, idx)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.graph = capture(self.model, self.inputs)
        self.auto = autoshard.plan(self.model, self.inputs, world=WORLD, cluster=CLUSTER, memory_budget=BUDGET,
                                   time_limit=600)
        self.hand, self.illegal, self.too_big = {}, {}, {}
        for scheme, mesh, roles in HAND:
            label = _label(scheme, mesh, roles)
            try:
                pins = schemes.SCHEMES[scheme](self.model, self.inputs, mesh, graph=self.graph, **roles)
            except ValueError as e:
                self.illegal[label] = str(e)
                continue
            try:
                self.hand[label] = autoshard.plan(self.model, self.inputs, mesh=mesh, cluster=CLUSTER, pin=pins,
                                                  memory_budget=BUDGET, time_limit=600)
            except MemoryBudgetError as e:
                self.too_big[label] = str(e).split("\n")[0]

    def table(self) -> str:
        rows = [f"autoshard {self.auto.mesh_shape}: {self.auto.cost * 1e3:.3f} ms, {self.auto.memory['total'] / 1e9:.2f} GB"]
        rows += [f"{k}: {p.cost * 1e3:.3f} ms ({p.cost / self.auto.cost:.3f}x), {p.memory['total'] / 1e9:.2f} GB"
                 for k, p in self.hand.items()]
        rows += [f"{k}: does not fit: {v}" for k, v in self.too_big.items()]
        rows += [f"{k}: not legal: {v}" for k, v in self.illegal.items()]
        return "\n".join(rows)


@pytest.fixture(scope="module")
def planned():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Regime(name)
        return cache[name]
    return get


# ---- hand plans -----------------------------------------------------------------------------------

# autoshard's own estimated step per regime as planned at commit 1dc2334, before the planner
# reused its work between layers and meshes and searched with cutoffs and the tie rule
BEFORE = {"small_model_large_batch": 8.293759558761219e-04, "wide_model_small_batch": 8.117506831832972e-03,
          "does_not_fit_replicated": 5.069412490063334e-02}
# the 7.3B block's plan is on four axes, which a mesh search reaches by descent from a coarser
# mesh's plan: a local optimum, within the spread of local optima. Pricing a few small
# parameters' gathers 6e-8 s cheaper (their share of a bucket) moved it from (8, 8, 2, 2) at
# 50.694 ms to (8, 2, 2, 8) at 50.838 ms, and a fixed (8, 8, 2, 2) descends to 50.876 ms
SPREAD = {"does_not_fit_replicated": 5e-3}


@pytest.mark.parametrize("name", list(REGIMES))
def test_the_faster_planner_finds_no_costlier_plan(planned, name):
    assert planned(name).auto.cost <= BEFORE[name] * (1 + max(TOL, SPREAD.get(name, 0))), planned(name).table()


@pytest.mark.parametrize("name", list(REGIMES))
def test_autoshard_is_no_worse_than_any_hand_plan(planned, name):
    r = planned(name)
    assert r.auto.world == WORLD and r.auto.memory["total"] <= BUDGET
    assert r.hand, f"no hand plan is a competitor in {name}:\n{r.table()}"
    for label, hand in r.hand.items():
        assert hand.memory["total"] <= BUDGET
        assert r.auto.cost <= hand.cost * (1 + TOL), f"{label} beats autoshard in {name}:\n{r.table()}"


def _block_matmul_weights(r):
    """Per block matmul (the head, tied to the embedding, aside): the placement it takes its
    weight in, per axis."""
    out = {}
    for n in r.graph.nodes:
        if n.op_name == "linear.default" and (r.auto.nodes[n.inputs[1][0]].fqn or "").startswith("blocks."):
            out[n.name] = tuple(r.auto.nodes[n.name].inputs[1])
    return out


def test_small_model_large_batch_computes_with_whole_weights(planned):
    """Data parallel or FSDP: the batch split on every axis, every block matmul computing with its
    whole weight (stored split or not), so no activation moves."""
    r = planned("small_model_large_batch")
    # the input itself may come whole on an axis and be sliced there, which moves nothing
    tokens = next(n.name for n in r.graph.nodes if n.op_name == "embedding.default" and n.inputs[1][0] == "idx")
    assert all(p == "S(0)" for p in r.auto.placement(tokens)), r.auto.placement(tokens)
    used = _block_matmul_weights(r)
    assert len(used) == 4 * r.cfg["layers"]
    assert all(set(p) == {"B"} for p in used.values()), used


def test_wide_model_small_batch_computes_with_split_weights(planned):
    """Tensor parallel: every block matmul computes with a share of its weight, which never moves
    whole; the activations move instead."""
    r = planned("wide_model_small_batch")
    used = _block_matmul_weights(r)
    assert len(used) == 4 * r.cfg["layers"]
    assert all(any(p.startswith("S(") for p in place) for place in used.values()), used


def test_a_model_that_does_not_fit_replicated_is_planned_within_the_budget(planned):
    r = planned("does_not_fit_replicated")
    assert 16 * r.params > BUDGET                            # fp32 weights, gradients, Adam moments
    assert r.auto.memory["total"] <= BUDGET == r.auto.memory["budget"]
    assert "data_parallel(256,)" in r.too_big, r.table()       # replication is no competitor
    with pytest.raises(MemoryBudgetError):
        autoshard.plan(r.model, r.inputs, mesh=(256,), cluster=CLUSTER, memory_budget=BUDGET,
                       pin=schemes.data_parallel(r.model, r.inputs, (256,), graph=r.graph))
    for label, hand in r.hand.items():
        assert hand.memory["total"] <= BUDGET, label


# ---- AxoNN's own ranking ---------------------------------------------------------------------------

def _a100():
    return autoshard.Cluster.preset(CLUSTER)


def test_axonn_volumes_are_the_papers():
    k, n, t = 1024, 4096, 8192
    v = axonn.layer_volumes(axonn.Layer(k, n), t, 2, 4, 8, 16)
    assert v == {
        "all_gather_w": ("z", 2 * 7 / 8 * k * n / 8),             # forward and backward
        "all_reduce_y": ("x", 2 * 1 / 2 * t / 128 * n / 4),
        "all_reduce_dx": ("y", 2 * 3 / 4 * t / 128 * k / 2),
        "reduce_scatter_dw": ("z", 7 / 8 * k * n / 8),
        "all_reduce_dw": ("d", 2 * 15 / 16 * k * n / 64),
    }
    swapped = axonn.layer_volumes(axonn.Layer(k, n, transposed=True), t, 4, 2, 8, 16)
    assert swapped["all_reduce_y"] == ("y", v["all_reduce_y"][1])
    assert swapped["all_reduce_dx"] == ("x", v["all_reduce_dx"][1])


def test_axonn_prices_on_our_links():
    c = _a100()
    intra = (c.intra_latency, c.intra_bandwidth, c.collective_overhead)
    layer = [axonn.Layer(1024, 4096)]
    tokens = 8192
    kn_bytes = 1024 * 4096 * 4
    bucket = 25 * 2**20
    ranked = {(x.gx, x.gy, x.gz, x.gd): x for x in axonn.rank(layer, tokens, WORLD, c)}
    # pure data parallel: one bucketed all-reduce of dW over 256 GPUs, across nodes on each
    # node's whole network (stride 1: one group per node crosses)
    dp = ranked[1, 1, 1, 256]
    cross = (c.inter_latency, c.inter_bandwidth, c.collective_overhead)
    assert dp.seconds == pytest.approx(all_reduce_time(kn_bytes, 256, cross, kn_bytes / bucket), rel=1e-12)
    assert dp.parts["all_reduce_dw"] == dp.seconds
    # x = 8 within a node, data 32 across nodes: 8 groups share each node's network
    cfg = ranked[8, 1, 1, 32]
    assert cfg.parts["all_reduce_y"] == pytest.approx(all_reduce_time(tokens / 32 * 4096 * 4, 8, intra), rel=1e-12)
    assert cfg.parts["all_reduce_dx"] == 0 and cfg.parts["all_gather_w"] == 0
    shared = (c.inter_latency, c.inter_bandwidth / 8, c.collective_overhead)
    dw = kn_bytes / 8
    assert cfg.parts["all_reduce_dw"] == pytest.approx(all_reduce_time(dw, 32, shared, dw / bucket), rel=1e-12)
    # z = 4 (FSDP within a node): two all-gathers of W and one reduce-scatter of dW, rings
    z4 = ranked[1, 1, 4, 64]
    ring = 5e-6 + 3 * 5e-6 + 3 / 4 * kn_bytes / 150e9
    assert z4.parts["all_gather_w"] == pytest.approx(2 * ring, rel=1e-12)
    assert z4.parts["reduce_scatter_dw"] == pytest.approx(ring, rel=1e-12)


def test_a_gradient_bucket_over_several_axes_is_one_all_reduce_on_their_group():
    """The runtime all-reduces a bucket over several axes on one communicator spanning them: it
    costs what a one-axis mesh of the same ranks costs (so data parallel on (32, 8) moves what
    it moves on (256,)), on the group's own links."""
    c = _a100()
    assert c.group_link((32, 8), (0, 1)) == c.group_link((256,), (0,)) == c.axis_links((256,))[0]
    assert c.group_link((4, 2, 32), (1, 2)) == c.axis_links((4, 64))[1]      # 64 ranks: 8 per node, 1 group
    assert c.group_link((2, 16, 8), (0, 2)) == c.axis_links((16, 16))[1]     # 16 ranks, 8 in each of 2 nodes
    assert c.group_link((32, 2, 4), (1, 2)) == (c.intra_latency, c.intra_bandwidth, c.collective_overhead)
    nbytes = 64e6
    assert comm.group_all_reduce_time(nbytes, (0, 1), (32, 8), c) == comm.all_reduce_time(nbytes, 256, c.axis_links((256,))[0])


def test_axonn_transposed_layers_swap_x_and_y():
    c = _a100()
    sizes = {"x": 8, "y": 2, "z": 1, "d": 16}
    plain = axonn.step_seconds([axonn.Layer(2048, 8192)], 4096, sizes, axonn.AXONN_ORDER, c)
    swapped = axonn.step_seconds([axonn.Layer(2048, 8192, transposed=True)], 4096,
                                 {"x": 2, "y": 8, "z": 1, "d": 16}, ("y", "x", "z", "d"), c)
    assert plain == pytest.approx(swapped, rel=1e-12)


def test_axonn_ranks_every_configuration_once():
    c = _a100()
    layers = axonn.gpt_layers(1024, 2, vocab=1024)
    assert len(axonn.grids(WORLD)) == math.comb(8 + 3, 3)      # 2^8 into four ordered factors
    ranked = axonn.rank(layers, 256 * 1024, WORLD, c)
    assert len(ranked) == len(axonn.grids(WORLD))              # every grid divides these shapes
    assert [x.seconds for x in ranked] == sorted(x.seconds for x in ranked)
    every = axonn.rank(layers, 256 * 1024, WORLD, c, orders="all")
    assert every[0].seconds <= ranked[0].seconds
    placed = {(x.gx, x.gy, x.gz, x.gd, tuple(g for g in x.order if x.sizes[g] > 1)) for x in every}
    assert len(placed) == len(every)                           # orders that differ only in groups of one: once
    fits = axonn.rank(layers, 256 * 1024, WORLD, c, memory_budget=4e6)
    assert fits and all(x.state_bytes <= 4e6 for x in fits) and len(fits) < len(ranked)
    with pytest.raises(ValueError, match="names each of"):
        axonn.rank(layers, 1024, WORLD, c, orders=[("x", "y", "z", "z")])


def test_axonn_grids_as_hand_plans():
    def grid(*g):
        return axonn.Config(*g, order=axonn.AXONN_ORDER, seconds=0.0, parts={})
    assert axonn.as_scheme(grid(1, 1, 1, 256)) == ("data_parallel", (256,), {})
    assert axonn.as_scheme(grid(1, 1, 8, 32)) == ("fsdp", (32, 8), {"shard": 1})
    assert axonn.as_scheme(grid(1, 64, 1, 4)) == ("megatron", (4, 64), {"tp": 1})
    assert axonn.as_scheme(grid(4, 4, 4, 4)) == ("axonn_4d", (4, 4, 4, 4), {"x": 3, "y": 2, "z": 1})
    # x and y without z (AxoNN's best for a 7B layer at 256): the 4-D layout, z a group of one
    assert axonn.as_scheme(grid(16, 8, 1, 2)) == ("axonn_4d", (2, 8, 16), {"x": 2, "y": 1, "z": None})


def _traffic(r):
    return axonn.plan_traffic(r.auto, r.graph)


def _axonn(r, **kw):
    cfg = r.cfg
    layers = axonn.gpt_layers(cfg["d"], cfg["layers"], vocab=cfg["vocab"])   # the head is a linear too
    return axonn.rank(layers, cfg["batch"] * cfg["seq"], WORLD, _a100(), memory_budget=BUDGET, **kw)


@pytest.mark.parametrize("name", ["small_model_large_batch", "wide_model_small_batch"])
def test_plan_traffic_reprices_the_plan(planned, name):
    r = planned(name)
    t = _traffic(r)
    assert t["total"] == pytest.approx(sum(c.seconds for c in r.auto.collectives), rel=1e-12)
    b = r.auto.breakdown
    assert t["total"] == pytest.approx(b["comm"] + b["hidden_fwd"] + b["hidden_bwd"], rel=1e-9)
    recorded = {}
    for c in r.auto.collectives:
        recorded[c.node] = recorded.get(c.node, 0.0) + c.seconds
    for node, seconds in t["converted"].items():
        if r.auto.nodes[node].op in axonn.MATMULS or r.graph.by_name[node].kind == "output":
            assert seconds == pytest.approx(recorded.get(node, 0.0), rel=1e-9, abs=1e-15), node
        else:   # an op may add reductions of its own (the loss's count of targets)
            assert seconds <= recorded.get(node, 0.0) * (1 + 1e-9) + 1e-15, node
    assert 0 < t["linear"] <= t["total"]


def test_hand_plans_carry_the_traffic_axonns_formulas_count(planned):
    """Our cost model and AxoNN's formulas price the same layout's linear traffic alike: data
    parallel exactly; FSDP less one all-gather of W, which AxoNN repeats in backward and our plans
    keep from forward; Megatron no more: the fused qkv is split in its blocks, so it adds no
    re-layout, and between the blocks the solver may reduce-scatter and all-gather where the
    formulas all-reduce."""
    r = planned("small_model_large_batch")
    grids = {(x.gx, x.gy, x.gz, x.gd): x for x in _axonn(r)}
    linear = {label: axonn.plan_traffic(p, r.graph)["linear"] for label, p in r.hand.items()}
    assert linear["data_parallel(256,)"] == pytest.approx(grids[1, 1, 1, 256].seconds, rel=1e-9)
    for label, grid in (("fsdp(256,)", grids[1, 1, 256, 1]), ("fsdp(32, 8)[shard=1]", grids[1, 1, 8, 32])):
        assert linear[label] == pytest.approx(grid.seconds - grid.parts["all_gather_w"] / 2, rel=1e-9), label
    assert linear["megatron(32, 8)[tp=1]"] <= grids[1, 8, 1, 32].seconds


@pytest.mark.parametrize("name", ["small_model_large_batch"])
def test_linear_traffic_no_more_than_axonns_best(planned, name):
    """AxoNN's 165 grids ranked by its own formulas on our links, with its placement of the groups
    (x innermost) and within the memory budget: autoshard's plan moves no more for the linear
    layers than the best of them (``linear`` counts like with like, and can only overstate ours).
    Not in the other two regimes: there the fastest plan moves more than AxoNN's best grid, and
    hides it behind compute (the model that does not fit replicated) or computes less (the wide
    model: its four-axis plan splits attention and the norms over two more axes, 1.7% more
    traffic for the linears); either way it waits for less than any AxoNN grid (the test below)."""
    r = planned(name)
    ranked = _axonn(r)
    assert len(ranked) > 100, len(ranked)
    best, linear = ranked[0], _traffic(r)["linear"]
    assert linear <= best.seconds * (1 + TOL), (
        f"autoshard {r.auto.mesh_shape}: {linear * 1e3:.3f} ms for the linears; AxoNN's best {best}")


def test_fused_qkv_is_split_by_its_blocks(planned):
    """Tensor parallel over the fused qkv: its weight is split in its q, k, v blocks, so the
    split into q, k and v moves nothing on the axes that split them and the attention runs on
    each rank's own heads (on other axes the split may reduce-scatter the partial sums of a
    weight split by its inputs)."""
    r = planned("wide_model_small_batch")
    qkv = next(n for n in r.graph.nodes if n.op_name == "linear.default" and "qkv" in r.auto.nodes[n.inputs[1][0]].fqn)
    blocked = {a for a, p in enumerate(r.auto.placement(qkv.name)) if p.endswith("/3")}
    assert blocked, r.auto.placement(qkv.name)
    assert any(p.endswith("/3") for p in r.auto.params["blocks.0.qkv.weight"]), r.auto.params
    split = next(n for n in r.graph.nodes if n.op_name == "split.Tensor")
    assert not [c for c in r.auto.collectives if c.node == split.name and blocked & set(c.axes)], r.table()


def _axonn_choice(r):
    """AxoNN's best-ranked grid, laid out as a hand plan and planned by our cost model."""
    grid = _axonn(r)[0]
    scheme, mesh, roles = axonn.as_scheme(grid)
    pins = schemes.SCHEMES[scheme](r.model, r.inputs, mesh, graph=r.graph, **roles)
    hand = autoshard.plan(r.model, r.inputs, mesh=mesh, cluster=CLUSTER, pin=pins, memory_budget=BUDGET)
    return grid, _label(scheme, mesh, roles), hand


@pytest.mark.parametrize("name", list(REGIMES))
def test_autoshard_is_no_worse_than_axonns_own_choice(planned, name):
    """AxoNN's best-ranked grid (its formulas, its order on the hardware) laid out as a hand plan and
    priced by our cost model: autoshard's plan is no slower a step, and waits no longer for
    communication (``exposed``: what compute does not hide, with the drag of what it does) unless
    it computes less by more than it waits longer (the wide model's four-axis plan: 0.95 ms less
    compute, 0.54 ms more exposed)."""
    r = planned(name)
    grid, label, hand = _axonn_choice(r)
    assert r.auto.cost <= hand.cost * (1 + TOL), (
        f"AxoNN's {grid}, as {label}: {hand.cost * 1e3:.3f} ms; "
        f"autoshard {r.auto.mesh_shape}: {r.auto.cost * 1e3:.3f} ms")
    ours, theirs = r.auto.breakdown, hand.breakdown
    waits_longer = ours["exposed"] - theirs["exposed"]
    assert waits_longer <= theirs["exposed"] * TOL or ours["compute"] + waits_longer < theirs["compute"], (
        f"exposed: autoshard {ours['exposed'] * 1e3:.3f} ms, AxoNN's {label} {theirs['exposed'] * 1e3:.3f} ms; "
        f"compute {ours['compute'] * 1e3:.3f} and {theirs['compute'] * 1e3:.3f} ms")


@pytest.mark.parametrize("name", ["wide_model_small_batch", "does_not_fit_replicated"])
def test_autoshard_waits_for_less_communication_than_any_axonn_grid(planned, name):
    """Where the linear layers' collectives decide the step: the communication autoshard's step
    waits for is no more than that of any of AxoNN's grids, each priced by its formulas with our
    overlap rule (weight gathers, dW reduce-scatters and the data all-reduce beside compute, the
    activation all-reduces blocking), in any order on the hardware. In the model that does not
    fit replicated, autoshard's plan sends more than AxoNN's best grid for the linears, all of
    the difference in collectives that run beside compute. (Not the small model: its step waits
    mostly for the loss's scalar all-reduces, which AxoNN's formulas leave out.)"""
    r = planned(name)
    cfg = r.cfg
    layers = axonn.gpt_layers(cfg["d"], cfg["layers"], vocab=cfg["vocab"])
    fwd, bwd = axonn.compute_seconds(layers, cfg["batch"] * cfg["seq"], WORLD, _a100())
    every = _axonn(r, orders="all")
    waits = min(every, key=lambda g: g.exposed(fwd, bwd))
    ours = r.auto.breakdown["exposed"]
    assert ours <= waits.exposed(fwd, bwd), f"autoshard {ours * 1e3:.3f} ms exposed; AxoNN's least: {waits}"
