"""Per-rank batches (``parallelize(..., inputs="local")``), as a DDP or FSDP2 user's loader gives
them: each rank passes its own rows, the global batch is the ranks' rows in rank order, and the
loss and every gradient equal one device's on that global batch; an output with the batch dim
comes back as this rank's rows, whose gradients, each rank seeding its own, sum to the whole's.
Ragged batches (ranks with different row counts) too. Default, Megatron, FSDP and 2-D plans at
world 4, and world 2."""
import copy

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard import schemes
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
