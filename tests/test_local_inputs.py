"""Per-rank batches (``parallelize(..., inputs="local")``), as a DDP or FSDP2 user's loader gives
them: each rank passes its own rows, the global batch is the ranks' rows in rank order, and the
loss and every gradient equal one device's on that global batch; an output with the batch dim
comes back as this rank's rows, whose gradients, each rank seeding its own, sum to the whole's.
Ragged batches (ranks with different row counts) too. Default, Megatron, FSDP and 2-D plans at
world 4, and world 2.

The rows arrive split on dim 0 over every mesh axis (rank r holds chunk r: ``S(0)`` on each), and
the plan prices each input's conversion from there to its layout (``autoshard.inputs``): a
data-parallel layout moves no input byte, one that needs the batch whole on an axis gathers on
that axis alone, and the solver chooses with it."""
import copy

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard import schemes
from autoshard.plan import Plan
from autoshard.runtime import steps as runtime_steps
from cases import rel_err
from models import GPT, MLP

TOL = 1e-5


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=64, d=32, heads=4, layers=2, seq=16)


def _global_batch(rows_per_rank, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (sum(rows_per_rank), 16), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _mine(t, rows_per_rank):
    first = sum(rows_per_rank[:dist.get_rank()])
    return t[first:first + rows_per_rank[dist.get_rank()]]


def loss_case(scheme, mesh, rows_per_rank):
    """The model returns the loss over the global batch: each rank passes only its rows."""
    model = _gpt()
    ref = copy.deepcopy(model)
    idx, tgt = _global_batch(rows_per_rank)
    mine = (_mine(idx, rows_per_rank), _mine(tgt, rows_per_rank))
    pin = None if scheme == "default" else getattr(schemes, scheme)(model, (idx, tgt), mesh)
    pm = autoshard.parallelize(model, mine, mesh=mesh, pin=pin, inputs="local", verbose=False)
    loss = pm(*mine)
    loss.backward()
    want = ref(idx, tgt)
    want.backward()
    ref_params = dict(ref.named_parameters())
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    # a ragged next batch (other row counts per rank, the same global batch: the schemes pin the
    # batch split evenly) is gathered and planned for too
    ragged = [rows_per_rank[0] + 1, rows_per_rank[1] - 1] + list(rows_per_rank[2:])
    idx2, tgt2 = _global_batch(ragged, seed=2)
    with torch.no_grad():
        again = rel_err(pm(_mine(idx2, ragged), _mine(tgt2, ragged)), ref(idx2, tgt2))
    return rel_err(loss, want), grads, again, (pm.data_shards, pm.data_rank)


def rows_case(mesh):
    """An output with the batch dim: this rank's rows, each rank seeding its own rows' gradient."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    rows = [2, 3, 1, 2][:dist.get_world_size()]
    x = torch.randn(sum(rows), 32, generator=torch.Generator().manual_seed(3))
    pm = autoshard.parallelize(model, (_mine(x, rows),), mesh=mesh, inputs="local", verbose=False)
    out = pm(_mine(x, rows))
    (out * out).sum().backward()
    want = ref(x)
    (want * want).sum().backward()
    ref_params = dict(ref.named_parameters())
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    return tuple(out.shape), rel_err(out, _mine(want, rows)), grads


CASES = [("default", (4,)), ("megatron", (4,)), ("fsdp", (4,)), ("default", (2, 2)), ("tensor_2d", (2, 2))]


@pytest.fixture(scope="module")
def results(world4):
    out = {case: world4.run(loss_case, *case, [2, 2, 2, 2]) for case in CASES}
    out["rows"] = world4.run(rows_case, (2, 2))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}")
def test_per_rank_batches_train_as_one_device_on_the_global_batch(results, case):
    for rank, (loss, grads, ragged, shards) in enumerate(results[case]):
        assert loss <= TOL and grads <= TOL and ragged <= TOL, (loss, grads, ragged)
        assert shards == (4, rank)


def test_an_output_with_the_batch_dim_comes_back_as_this_ranks_rows(results):
    for rank, (shape, out, grads) in enumerate(results["rows"]):
        assert shape == ([2, 3, 1, 2][rank], 32)
        assert out <= TOL and grads <= TOL, (out, grads)


def test_per_rank_batches_at_world_2(world2):
    for loss, grads, ragged, _ in world2.run(loss_case, "default", (2,), [3, 5]):
        assert loss <= TOL and grads <= TOL and ragged <= TOL


def bad_inputs():
    with pytest.raises(ValueError, match='inputs is "whole"'):
        autoshard.parallelize(MLP(), inputs="per-rank")
    return True


def test_inputs_is_whole_or_local(world2):
    assert all(world2.run(bad_inputs))


# ---- the arrival, priced and run ----------------------------------------------------------------

def _input_collectives(plan, name="x"):
    return [(c.kind, c.phase, c.axes, c.bytes) for c in plan.collectives if c.node == name]


def _mlp_plan(rows, mesh, **kw):
    torch.manual_seed(0)
    return autoshard.plan(MLP(), (torch.randn(rows, 32),), mesh=mesh, verbose=False, **kw)


def test_pricing_the_arrival_changes_the_choice():
    """A small MLP on a large batch: with the batch whole on every rank, replicating it all is
    cheapest (x ``B``, no collective); with each rank's rows, gathering them costs an all-gather
    the solver now sees, and it splits the batch instead, moving no input byte. The first plan's
    layout, fed per-rank rows, costs exactly that gather more."""
    whole = _mlp_plan(1024, (4,))
    local = _mlp_plan(1024, (4,), inputs="local")
    assert whole.placement("x") == ("B",) and whole.arrival == {}
    assert local.placement("x") == ("S(0)",) and local.arrival == {"x": ("S(0)",)}
    assert _input_collectives(whole) == [] and _input_collectives(local) == []
    gathered = _mlp_plan(1024, (4,), inputs="local", pin={"x": ("B",)})
    assert _input_collectives(gathered) == [("all_gather", "forward", (0,), 256 * 32 * 4)]
    paid = sum(c.seconds for c in gathered.collectives if c.node == "x")
    assert gathered.cost == pytest.approx(whole.cost + paid, rel=1e-9)
    assert local.cost < gathered.cost
    assert "all_gather  forward   (0)   32.0KB" in str(gathered)   # str(plan) shows the input's gather
    assert "inputs: each rank's own rows (inputs=\"local\"), arriving (S(0)); converting them costs" in str(gathered)
    assert "no input byte moved" in str(local) and "inputs: each rank" not in str(whole)
    assert Plan.from_json(gathered.to_json()).arrival == {"x": ("S(0)",)}


@pytest.mark.parametrize("pin,want", [
    (("S(0)", "S(0)"), []),                                        # data parallel on both axes
    (("S(0)", "B"), [("all_gather", "forward", (1,), 16 * 32 * 4)]),   # whole on axis 1: its gather alone
], ids=["data-parallel", "whole-on-axis-1"])
def test_the_plan_prices_what_its_layout_needs_of_the_arrival(pin, want):
    plan = _mlp_plan(64, (2, 2), inputs="local", pin={"x": pin})
    assert plan.arrival == {"x": ("S(0)", "S(0)")}
    assert _input_collectives(plan) == want
    assert plan.nodes["x"].comm == pytest.approx(sum(c.seconds for c in plan.collectives if c.node == "x"))


def arrival_case(mesh, pin):
    """This rank's 16 rows of a 64-row batch that requires grad: the all-gathers each forward
    runs (of the rows as the rank brought them, or not; over a group of how many), the global
    batch gathered outside the program (``dist.all_gather`` of floats), and the output, the
    parameters' and the input's gradients against one device."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    mine = _mine(x, [16] * 4).clone().requires_grad_(True)
    pm = autoshard.parallelize(model, (mine.detach(),), mesh=mesh, pin={"x": pin}, inputs="local", verbose=False)
    gathers, outside = [], []
    real, real_dist = runtime_steps._all_gather, dist.all_gather

    def counted(out, inp, *a, **k):
        gathers.append((inp.data_ptr() == mine.data_ptr(), dist.get_world_size(k.get("group")), inp.numel()))
        return real(out, inp, *a, **k)

    def counted_dist(parts, t, *a, **k):
        if t.is_floating_point():
            outside.append(t.numel())
        return real_dist(parts, t, *a, **k)

    runtime_steps._all_gather, dist.all_gather = counted, counted_dist
    try:
        out = pm(mine)
    finally:
        runtime_steps._all_gather, dist.all_gather = real, real_dist
    (out * out).sum().backward()
    xr = x.clone().requires_grad_(True)
    want = ref(xr)
    (want * want).sum().backward()
    ref_params = dict(ref.named_parameters())
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    return dict(rows=[g for g in gathers if g[0]], outside=outside, out=rel_err(out, _mine(want, [16] * 4)),
                grads=grads, x_grad=rel_err(mine.grad, _mine(xr.grad, [16] * 4)))


@pytest.mark.parametrize("mesh,pin,want", [
    ((4,), ("S(0)",), []),
    ((2, 2), ("S(0)", "S(0)"), []),
    ((2, 2), ("S(0)", "B"), [(True, 2, 16 * 32)]),
], ids=["data-parallel-4", "data-parallel-2x2", "whole-on-axis-1"])
def test_the_rows_a_rank_brings_move_only_where_the_layout_needs_them(world4, mesh, pin, want):
    """The program takes each rank's rows as they are: a data-parallel layout gathers none of
    them, one whole on axis 1 all-gathers them once over that axis's 2 ranks; the global batch is
    never gathered outside the program, and the output, the parameters' gradients and the
    gradient flowing back to each rank's rows equal one device's."""
    for r in world4.run(arrival_case, mesh, pin):
        assert r["rows"] == want and r["outside"] == [], (r["rows"], r["outside"])
        assert max(r["out"], r["grads"], r["x_grad"]) <= TOL, r
