"""Every rank in one process (``autoshard.testing.simulate.SimWorld``): the unchanged parallel module,
emitted program, runtime and torch.distributed, on threads, so numerics can be checked at worlds
too large for real processes on this machine.

- Agreement: a small GPT with Megatron tensor parallelism on (4,), and FSDP times Megatron on
  (2, 2), gives the same loss, gradients and Adam step in ``SimWorld(4)`` as in a real gloo group
  of 4 processes, and both equal the single-device model's (float64: to 1e-12).
- World 16 on (16,), (4, 4), (2, 2, 4) and world 64 on (8, 8), (4, 4, 4): loss, every parameter
  gradient and one Adam step equal the single-device model's, with schemes that split the
  weights over every axis.
- The simulator: a mismatched collective, a deadlock, a failing rank and a run past its time
  raise at once with what each rank was doing; each rank has its own random state and arguments.

Plans are made here, once, and reach the ranks as JSON. The solver needs minutes on three axes
even with a scheme's pins (a one-block GPT on (2, 2, 4): no plan within 60 s), so these plans are
made axis by axis (``plan_by_axis``).
"""
import math
import time

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard import schemes
from autoshard.api import plan_graph
from autoshard.options import PlanOptions
from autoshard.testing.launch import LocalWorld
from autoshard.passes.capture import capture
from autoshard.testing.simulate import SimWorld
from cases import rel_err
from models import GPT

pytestmark = pytest.mark.long("worlds of 16 and 64 ranks simulated in one process: 25 s on 2 cores")

SMALL = dict(vocab=64, d=32, heads=4, seq=16, layers=1, batch=8, dtype=torch.float64)
LARGE = dict(vocab=64, d=64, heads=8, seq=16, layers=1, batch=64)   # every dim divides over 64 ranks
TOL = 1e-5


def _gpt(sizes):
    torch.manual_seed(0)
    model = GPT(**{k: v for k, v in sizes.items() if k not in ("batch", "dtype")})
    model = model.to(sizes.get("dtype", torch.float32))
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g) for _ in range(2))
    return model, (idx, targets)


def _adam(params):
    # eps well above the attention key bias's gradient, which is rounding noise (softmax ignores a
    # shift shared by every key): the default 1e-8 would turn that noise into full steps
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def plan_by_axis(graph, mesh, axis_pins) -> autoshard.Plan:
    """A plan of the captured ``graph`` on ``mesh``, made one axis at a time: ``axis_pins[a]``
    (one-axis pins) planned on a mesh of axis ``a`` alone (a fraction of a second), then every
    node's per-axis choices pinned together on the whole mesh, where autoshard checks each is
    legal and plans the conversions. An nd strategy is any combination of one-axis signatures
    that divides evenly (passes/annotate.py), so the combination is a plan; not always the
    cheapest, as the cost of a conversion on one axis depends on the others' splits."""
    per_axis = [plan_graph(graph, (n,), PlanOptions(pin=pins)) for n, pins in zip(mesh, axis_pins)]
    full = {name: tuple(p.nodes[name].outputs[0][0] for p in per_axis)
            for name, choice in per_axis[0].nodes.items() if choice.kind in ("op", "input") and choice.outputs}
    full.update({fqn: tuple(p.params[fqn][0] for p in per_axis) for fqn in per_axis[0].params})
    return plan_graph(graph, mesh, PlanOptions(pin=full))


def train_case(sizes, plan_json):
    """On every rank: one training step of the parallel GPT; what each rank sees, whole."""
    model, inputs = _gpt(sizes)
    pm = autoshard.parallelize(model, inputs, plan=autoshard.Plan.from_json(plan_json))
    opt = _adam(pm.parameters())
    loss = pm(*inputs)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
    opt.step()
    with torch.no_grad():
        loss2 = pm(*inputs)
    return {"loss": loss.detach(), "loss2": loss2, "grads": grads,
            "params": {n: p.detach().full_tensor() for n, p in pm.named_parameters()},
            "shares": {n: tuple(p.to_local().shape) for n, p in pm.named_parameters()}}


def reference(sizes, step_on=None):
    """The single device's step; with ``step_on`` (a result of ``train_case``), Adam steps on that
    result's gradients rather than its own (``cases.step_on_the_same_gradients`` says why)."""
    model, inputs = _gpt(sizes)
    opt = _adam(model.parameters())
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if step_on is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.grad.copy_(step_on["grads"][n])
    opt.step()
    with torch.no_grad():
        loss2 = model(*inputs)
    return {"loss": loss.detach(), "loss2": loss2, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def max_diff(a, b) -> float:
    """The largest difference between two results of ``train_case`` or ``reference``, each
    relative to ``b``'s largest magnitude where that is above 1 (``cases.rel_err``: the loss, about
    4 in float32, rounds in the 1e-6 absolute)."""
    worst = max(rel_err(a[k], b[k]) for k in ("loss", "loss2"))
    for part in ("grads", "params"):
        assert a[part].keys() == b[part].keys()
        worst = max([worst] + [rel_err(a[part][n], b[part][n]) for n in a[part]])
    return worst


def _plan(sizes, mesh, scheme):
    """``scheme`` over ``mesh`` (its pins kept), or a list of one-axis schemes, one per axis."""
    model, inputs = _gpt(sizes)
    graph = capture(model, inputs)
    if isinstance(scheme, str):
        pins = schemes.SCHEMES[scheme](model, inputs, mesh, graph=graph)
        axis_pins = [{k: (v[a],) for k, v in pins.items()} for a in range(len(mesh))]
    else:
        axis_pins = [schemes.SCHEMES[s](model, inputs, (n,), graph=graph) for s, n in zip(scheme, mesh)]
        # one scheme per axis: a fused qkv's weight stored S(0) by one and split in its blocks
        # (S(0)/3) by the other cannot be both; keep the plain split (the solver re-lays the output)
        axis_pins = [{k: tuple(p.split("/")[0] for p in v) for k, v in a.items()} for a in axis_pins]
        pins = {k: tuple(axis_pins[a].get(k, (None,))[0] for a in range(len(mesh)))
                for k in set().union(*axis_pins)}
    plan = plan_by_axis(graph, mesh, axis_pins)
    for name, want in pins.items():
        got = plan.placement(name)
        assert all(w is None or g == w for g, w in zip(got, want)), (name, got, want)
    return plan


# ---- agreement with real processes ------------------------------------------------------------------

AGREE = [((4,), "megatron"), ((2, 2), ["fsdp", "megatron"])]
AGREE_IDS = ["4-megatron", "2x2-fsdp-megatron"]


@pytest.fixture(scope="module")
def gloo():
    """The agreement cases' plans, and their per-rank results in a real gloo group of 4."""
    plans = [_plan(SMALL, mesh, scheme).to_json() for mesh, scheme in AGREE]
    with LocalWorld(4) as world:
        return plans, [world.run(train_case, SMALL, p) for p in plans]


@pytest.mark.parametrize("i", range(len(AGREE)), ids=AGREE_IDS)
def test_simulation_agrees_with_gloo(gloo, i):
    plans, results = gloo
    sim = SimWorld(4).run(train_case, SMALL, plans[i])
    ref = reference(SMALL)
    for rank, (g, s) in enumerate(zip(results[i], sim)):
        assert s["shares"] == g["shares"], rank
        # float64: both backends' partial sums agree to rounding (they add them in different
        # orders), and both equal the single device's; a wrong scale or a missed share would not
        assert max_diff(s, g) <= 1e-12, (rank, max_diff(s, g))
        assert max_diff(s, ref) <= 1e-12 and max_diff(g, ref) <= 1e-12, rank
    if i == 1:          # fc2.weight (32, 128): FSDP splits dim 0 over axis 0, Megatron dim 1 over axis 1
        assert sim[0]["shares"]["blocks.0.fc2.weight"] == (16, 64)


# ---- numerics at worlds 16 and 64 -------------------------------------------------------------------

LARGE_CASES = [((16,), "fsdp"), ((4, 4), "tensor_2d"), ((2, 2, 4), "tensor_3d"), ((8, 8), "tensor_2d"),
               ((4, 4, 4), "tensor_3d")]


@pytest.mark.parametrize("mesh,scheme", LARGE_CASES, ids=[f"{'x'.join(map(str, m))}-{s}" for m, s in LARGE_CASES])
def test_large_world_matches_single_device(mesh, scheme):
    plan = _plan(LARGE, mesh, scheme)
    assert {a for c in plan.collectives for a in c.axes} == set(range(len(mesh)))   # every axis works
    per_rank = SimWorld(math.prod(mesh)).run(train_case, LARGE, plan.to_json())
    ref = reference(LARGE, step_on=per_rank[0])
    for rank, res in enumerate(per_rank):
        assert max_diff(res, ref) <= TOL, (rank, max_diff(res, ref))
        assert torch.equal(res["loss"], per_rank[0]["loss"]), rank
    fc = per_rank[0]["shares"]["blocks.0.fc.weight"]         # (256, 64) whole
    if scheme == "fsdp":
        assert fc == (256 // 16, 64)
    if scheme == "tensor_2d":
        assert fc == (256 // mesh[1], 64 // mesh[0])
    if scheme == "tensor_3d":                                # (l: S(1), j: S(0), i: S(0))
        assert fc == (256 // (mesh[0] * mesh[1]), 64 // mesh[2])


# ---- the simulator itself --------------------------------------------------------------------------

def _mismatch():
    if dist.get_rank() == 1:
        dist.all_gather_single(torch.empty(8), torch.ones(2))
    else:
        dist.all_reduce(torch.ones(2))


def _early_return():
    if dist.get_rank() == 1:
        return
    dist.all_reduce(torch.ones(2))


def _fails_on_rank_2():
    if dist.get_rank() == 2:
        raise ValueError("rank 2 gives up")
    dist.all_reduce(torch.ones(2))


def test_misuse_raises_at_once_saying_where_each_rank_is():
    world = SimWorld(4)
    with pytest.raises(RuntimeError, match=r"(?s)collective #0 on group 0 .* not the same call.*rank 1: all_gather"):
        world.run(_mismatch)
    with pytest.raises(RuntimeError, match=r"(?s)deadlock.*rank 1: returned.*rank 3: waits in all_reduce #0"):
        world.run(_early_return)
    with pytest.raises(RuntimeError, match=r"(?s)failed on rank 2:.*ValueError: rank 2 gives up"):
        world.run(_fails_on_rank_2)
    assert world.run(dist.get_rank) == [0, 1, 2, 3]     # a failed run leaves nothing behind


def _slow_rank_0():
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(1.5)
    dist.barrier()


def test_a_run_past_its_time_raises():
    stands = r"(?s)within 0.5 s.*rank 0: running.*rank 1: (waits in|going on after) barrier"
    with pytest.raises(TimeoutError, match=stands):
        SimWorld(2, timeout_s=0.5).run(_slow_rank_0)


def _draws(box):
    box.append(dist.get_rank())
    torch.manual_seed(3)
    dist.barrier()                 # every rank draws after the others have seeded
    return box, torch.rand(2), torch.rand(2)


def test_each_rank_has_its_own_random_state_and_arguments():
    before = torch.get_rng_state()
    world = SimWorld(3)
    res = world.run(_draws, [])
    assert [box for box, _, _ in res] == [[0], [1], [2]]
    g = torch.Generator().manual_seed(3)
    want = [torch.rand(2, generator=g) for _ in range(3)]
    for _, a, b in res:
        assert torch.equal(a, want[0]) and torch.equal(b, want[1])
    assert torch.equal(torch.get_rng_state(), before)       # the caller's state is its own
    for x in world.run(torch.rand, 2):                       # and a rank's lives on between runs
        assert torch.equal(x, want[2])
