"""An optimizer built before ``parallelize`` keeps working: at its first step it is handed the
parameters' shares, with the state it already has cut to their layouts, and trains on as it
would have on one device (``autoshard.runtime.optim._take_shares``). State that has no share to
cut raises at that step instead. Real gloo groups of 2 and 4 ranks, on plans that split the
parameters (FSDP's, and Megatron's on a GPT whose head is tied to its embedding)."""
from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard import schemes
from cases import rel_err, run_each, step_on_the_same_gradients
from models import GPT, MLP

STEPS = 3   # steps after parallelize, each compared with one device's


def _optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=1e-2, max_iter=2)
    return torch.optim.Adafactor(params, lr=1e-2)


def _model(name, mesh):
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(vocab=64, d=32, heads=4, layers=2, seq=16)
        batches = []
        for _ in range(2 + STEPS):
            idx = torch.randint(0, 64, (8, 16))
            batches.append((idx, torch.roll(idx, -1, dims=1)))
        pin = schemes.megatron(model, batches[0], mesh)
        return model, batches, (lambda m, b: m(*b)), pin
    model = MLP()
    batches = [(torch.randn(8, 32),) for _ in range(2 + STEPS)]
    pin = schemes.fsdp(model, batches[0], mesh, shard=len(mesh) - 1)   # hybrid where there are 2 axes
    return model, batches, (lambda m, b: m(*b).square().mean()), pin


def carried_case(model_name, mesh, opt_name, warm):
    """``warm`` steps of an optimizer on one device, then the model parallelized and ``STEPS``
    more of the same optimizer, each against a copy of the model and optimizer stepped on one
    device on the same gradients (``step_on_the_same_gradients``: the step itself is compared,
    on any processor)."""
    model, batches, loss_of, pin = _model(model_name, mesh)
    opt = _optimizer(opt_name, model.parameters())
    for b in batches[:warm]:
        loss_of(model, b).backward()
        opt.step()
        opt.zero_grad()
    ref = copy.deepcopy(model)
    ref_opt = _optimizer(opt_name, ref.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    pm = autoshard.parallelize(model, batches[0], pin=pin, mesh=mesh, verbose=False)
    losses, params = [], []
    for b in batches[warm:warm + STEPS]:
        loss, ref_loss = loss_of(pm, b), loss_of(ref, b)
        loss.backward()
        ref_loss.backward()
        losses.append(rel_err(loss, ref_loss))
        step_on_the_same_gradients(pm, ref, opt, ref_opt)
        refp = dict(ref.named_parameters())
        params.append(max(rel_err(p.full_tensor(), refp[n]) for n, p in pm.named_parameters()))
        opt.zero_grad()
        ref_opt.zero_grad()
    held = [p for group in opt.param_groups for p in group["params"]]
    shares = list(pm.parameters())
    placed = all(v.placements == p.placements for p in shares for v in opt.state[p].values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    steps = {float(opt.state[p]["step"]) for p in shares if "step" in opt.state[p]}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    saved = get_optimizer_state_dict(pm, opt)["state"]
    return {"losses": losses, "params": params, "split": any("Shard" in str(p.placements) for p in shares),
            "held": len(held) == len(shares) and all(a is b for a, b in zip(held, shares)), "placed": placed,
            "steps": steps, "saved": sorted(saved) == sorted(n for n, _ in pm.named_parameters())}


def _check(results, cases):
    for case, res in zip(cases, results):
        assert "error" not in res, (case, res.get("error"))
        model_name, mesh, opt_name, warm = case
        assert res["split"] and res["held"] and res["placed"] and res["saved"], (case, res)
        assert max(res["losses"]) <= 1e-5 and max(res["params"]) <= 1e-5, (case, res)
        if opt_name == "adamw":
            assert res["steps"] == {float(warm + STEPS)}, (case, res["steps"])


WORLD2 = [("mlp", (2,), "adamw", 0), ("mlp", (2,), "adamw", 2), ("mlp", (2,), "sgd", 2)]
WORLD4 = [("mlp", (2, 2), "adamw", 2), ("gpt", (2, 2), "adamw", 0), ("gpt", (2, 2), "adamw", 2),
          ("gpt", (2, 2), "sgd", 2)]


def test_an_optimizer_built_before_parallelize_trains_on_at_world2(world2):
    for results in world2.run(run_each, carried_case, WORLD2):
        _check(results, WORLD2)


def test_an_optimizer_built_before_parallelize_trains_on_on_a_2_axis_mesh(world4):
    for results in world4.run(run_each, carried_case, WORLD4):
        _check(results, WORLD4)


def built_before_the_first_call():
    """``parallelize`` without example inputs shards at the first call: an optimizer built from
    the module's parameters between the two is handed their shares at its step."""
    model, batches, loss_of, pin = _model("mlp", (2,))
    pm = autoshard.parallelize(model, pin=pin, verbose=False)
    opt = _optimizer("adamw", pm.parameters())
    loss_of(pm, batches[0]).backward()
    w = pm._model.out.weight.full_tensor().clone()
    opt.step()
    held = [p for group in opt.param_groups for p in group["params"]]
    return all(a is b for a, b in zip(held, pm.parameters())), bool((pm._model.out.weight.full_tensor() != w).any())


def test_an_optimizer_built_before_the_first_call_trains(world2):
    for held, moved in world2.run(built_before_the_first_call):
        assert held and moved


def cannot_carry(how):
    """An optimizer whose state is not one value per element of the parameter (Adafactor's
    factored second moment of a matrix, LBFGS's history of the whole model), or that holds a
    parameter and its share both: its step raises, before it has changed anything, and says what
    to do."""
    model, batches, loss_of, pin = _model("mlp", (2,))
    opt = _optimizer({"factored": "adafactor", "history": "lbfgs"}.get(how, "sgd"), model.parameters())

    def closure():
        opt.zero_grad()
        loss = loss_of(model, batches[0])
        loss.backward()
        return loss
    if how == "factored":
        closure()
        opt.step()
    elif how == "history":
        opt.step(closure)
    pm = autoshard.parallelize(model, batches[0], pin=pin, verbose=False)
    if how == "twice":
        opt.add_param_group({"params": list(pm.parameters())})
    loss_of(pm, batches[1]).backward()
    w = pm._model.out.weight.full_tensor().clone()
    try:
        opt.step(lambda: loss_of(pm, batches[1])) if how == "history" else opt.step()
        said = None
    except RuntimeError as e:
        said = str(e)
    return said, bool((pm._model.out.weight.full_tensor() == w).all())


@pytest.mark.parametrize("how, why", [("factored", "is not one value per element"),
                                      ("history", "is not one value per element"),
                                      ("twice", "holds that parameter's share too")])
def test_an_optimizer_that_cannot_be_handed_the_shares_says_so_at_its_step(world2, how, why):
    for said, unchanged in world2.run(cannot_carry, how):
        assert said and why in said and "Build the optimizer after parallelize" in said, said
        assert unchanged
