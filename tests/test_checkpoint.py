"""Checkpoint and resume with torch.distributed.checkpoint: a GPT (fused qkv, tied head) trained
a few steps under a pinned Megatron plan at world 4, its model and optimizer state saved
(``get_state_dict``), loaded into fresh processes and trained on: the same parameters as the run
that was never interrupted, under the same plan, under a data-parallel plan, on mesh (2, 2) and at
world 2. The Megatron plan stores the qkv weight as blocked splits, a piece of q, k and v on each
rank, which DCP sees piece by piece (_compat.checkpoint_blocked_splits)."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import autoshard
from autoshard import schemes
from autoshard.testing.launch import LocalWorld
from autoshard.plan import Plan
from models import GPT

pytestmark = pytest.mark.long("DCP saves and resumes across worlds, and 20 parallelizations in one group: 16 s on 2 cores")

BEFORE, AFTER = 3, 3   # steps before the checkpoint, and after it


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)


def build(scheme, mesh, seed=0, plan=None):
    torch.manual_seed(seed)
    model = GPT()
    if plan is not None:
        return autoshard.parallelize(model, batch(0), plan=plan)
    pin = getattr(schemes, scheme)(model, batch(0), mesh)
    return autoshard.parallelize(model, batch(0), mesh=mesh, pin=pin, time_limit=20)


def optimizer(pm, kind):
    if kind == "sgd":   # momentum: a state to save, and no division to magnify rounding across meshes
        return torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(pm.parameters(), lr=1e-2)


def train(pm, opt, steps):
    for step in steps:
        opt.zero_grad()
        pm(*batch(step)).backward()
        opt.step()


def whole(pm) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in pm.named_parameters()}


def save_case(path, kind):
    """Megatron at world 4: train, save, train on; the parameters of the run never interrupted."""
    pm = build("megatron", (4,))
    opt = optimizer(pm, kind)
    train(pm, opt, range(BEFORE))
    model_sd, optim_sd = get_state_dict(pm, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(pm, opt, range(BEFORE, BEFORE + AFTER))
    return whole(pm), pm.plan.params["blocks.0.qkv.weight"]


def resume_case(path, kind, scheme, mesh):
    """A fresh model (other initial weights) and optimizer, loaded from the checkpoint, trained on."""
    pm = build(scheme, mesh, seed=1)
    opt = optimizer(pm, kind)
    model_sd, optim_sd = get_state_dict(pm, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(pm, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(pm, opt, range(BEFORE, BEFORE + AFTER))
    return whole(pm), pm.plan.params["blocks.0.qkv.weight"]


def json_case():
    """A plan through its JSON gives every rank the same program as the plan itself."""
    first = build("megatron", (4,))
    again = build(None, None, plan=Plan.from_json(first.plan.to_json()))
    return first.program == again.program, first.plan.to_json() == again.plan.to_json()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    with LocalWorld(4) as world:
        out = {kind: world.run(save_case, str(path / kind), kind)[0] for kind in ("sgd", "adamw")}
        out["json"] = world.run(json_case)
    return path, out


def assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_torch_whose_dtensor_lays_out_blocked_splits_otherwise_is_refused_by_name():
    """A blocked split (a fused qkv cut by its blocks) is written as DTensor's private strided
    shard; this torch's layout of it is checked on a small tensor first. One that lays it out as
    plain chunks gets an error naming the parameter and what to change, not DTensor views that
    disagree with the program; torch's own passes."""
    from torch.distributed.tensor.placement_types import _StridedShard
    from autoshard._compat import _check_blocked_layout

    class PlainChunks:   # a strided shard that ignores its split factor
        def __init__(self, dim, split_factor):
            pass

        def _split_tensor(self, t, n, with_padding=False):
            return list(t.chunk(n)), []

    for groups in (2, 3):
        _check_blocked_layout(_StridedShard, groups, "blocks.0.attn.qkv.weight")
        with pytest.raises(RuntimeError, match=r"blocks\.0\.attn\.qkv\.weight is stored split by its "
                                               rf"{groups} blocks.*Use torch 2\.13 or later, or pin it whole"):
            _check_blocked_layout(PlainChunks, groups, "blocks.0.attn.qkv.weight")


def test_megatron_stores_qkv_as_blocked_splits(saved):
    _, out = saved
    assert out["sgd"][1] == ("S(0)/3",)


def held():
    """What this process holds that a forgotten module could leak: process groups, threads, files."""
    import os
    import threading
    from torch.distributed import distributed_c10d
    return len(distributed_c10d._world.pg_map), threading.active_count(), len(os.listdir("/proc/self/fd"))


def parallelize_twenty():
    """The same model parallelized 20 times on mesh (2, 2), after a first time that makes the
    mesh's groups: nothing held grows."""
    from models import MLP
    x = torch.randn(8, 32)
    first = autoshard.parallelize(MLP(), (x,), mesh=(2, 2), time_limit=10)
    first(x).sum().backward()
    before = held()
    for _ in range(20):
        pm = autoshard.parallelize(MLP(), (x,), plan=first.plan)
        pm(x).sum().backward()
    return before, held()


@pytest.fixture(scope="module")
def fresh4(saved):
    # new processes: nothing of the saving run survives but the files
    path, _ = saved
    cases = [("adamw", "megatron", (4,)), ("sgd", "data_parallel", (4,)), ("sgd", "megatron", (2, 2))]
    with LocalWorld(4) as world:
        out = {case: world.run(resume_case, str(path / case[0]), *case)[0] for case in cases}
        out["held"] = world.run(parallelize_twenty)
    return out


def test_parallelize_twenty_times_leaks_nothing(fresh4):
    for before, after in fresh4["held"]:
        assert after == before, "(process groups, threads, open files) grew"


@pytest.mark.parametrize("kind, scheme, mesh, stored", [
    ("adamw", "megatron", (4,), ("S(0)/3",)),
    ("sgd", "data_parallel", (4,), ("B",)),
    ("sgd", "megatron", (2, 2), ("B", "S(0)/3")),
])
def test_resume_at_world_4(saved, fresh4, kind, scheme, mesh, stored):
    params, qkv = fresh4[(kind, scheme, mesh)]
    assert qkv == stored
    assert_same(params, saved[1][kind][0])


def test_resume_at_world_2(saved):
    path, out = saved
    with LocalWorld(2) as world:
        params, qkv = world.run(resume_case, str(path / "sgd"), "sgd", "megatron", (2,))[0]
    assert qkv == ("S(0)/3",)
    assert_same(params, out["sgd"][0])


def test_plan_json_round_trip_gives_the_same_program(saved):
    assert all(same_program and same_plan for same_program, same_plan in saved[1]["json"])


def reloaded_case():
    """A trained program's parameters given other values after its first steps, in place (as the
    optimizer and a checkpoint's load write them) and as new parameters in the modules: each next
    step computes with the new values, loss and gradients as the plain model with those weights."""
    from torch.distributed.tensor import distribute_tensor
    pm = build("data_parallel", (2,))
    opt = optimizer(pm, "sgd")
    train(pm, opt, range(2))   # the program has fed its parameters to two steps
    out = []
    for seed, replace in ((5, False), (6, True)):
        torch.manual_seed(seed)
        ref = GPT()
        new = dict(ref.named_parameters())
        given = {id(p): (p, distribute_tensor(new[n].detach().clone(), p.device_mesh, p.placements))
                 for n, p in pm.named_parameters()}
        if replace:   # one new parameter for each, in every module holding it (the tied head too)
            given = {i: (p, torch.nn.Parameter(value)) for i, (p, value) in given.items()}
            for mod in pm.modules():
                for key, p in list(mod._parameters.items()):
                    if p is not None and id(p) in given:
                        mod._parameters[key] = given[id(p)][1]
        else:
            with torch.no_grad():
                for p, value in given.values():
                    p.copy_(value)
        opt.zero_grad()
        loss = pm(*batch(7))
        loss.backward()
        want = ref(*batch(7))
        want.backward()
        grads = max(((p.grad.full_tensor() - new[n].grad).abs().max() / new[n].grad.abs().max()).item()
                    for n, p in pm.named_parameters())
        out.append((abs(loss.item() - want.item()) / abs(want.item()), grads))
    return out


def test_parameters_given_new_values_after_training_feed_the_next_step():
    with LocalWorld(2) as world:
        for loss_gap, grad_gap in world.run(reloaded_case)[0]:
            assert loss_gap < 1e-5 and grad_gap < 1e-4
