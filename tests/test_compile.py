"""``parallelize(..., compile=True)``: the program's runs of ops between collectives compiled by
inductor train exactly as eager autoshard and the single-device model do, in a real gloo group,
with the same collectives in the same order."""
import copy
import re

import pytest
import torch
import torch.distributed as dist

import autoshard
from cases import rel_err, run_each, step_on_the_same_gradients
from models import GPT

pytestmark = pytest.mark.long("inductor compiles each plan's regions, forward and backward, on every rank: "
                              "about 30 s a plan on 2 cores")

TOL = 1e-5   # cases.rel_err: inductor's fused kernels reorder float sums, no more


# the bookkeeping of a weight gradient made beside a dual step, which a compiled program leaves out
# (passes.lower: each linear keeps its weight gradient in its own backward)
WEIGHTS_LATER = {"pending", "weight_later", "linear_dw_later"}


def _runtime_calls(program: str) -> list:
    """The program's runtime calls in order (its collectives, their starts and waits), but the
    weight-later bookkeeping."""
    return [c for c in re.findall(r"autoshard_runtime_(\w+)\(", program) if c not in WEIGHTS_LATER]


def compiled_case(scheme):
    torch.manual_seed(0)
    model = GPT()
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    if scheme == "megatron":
        pin = autoshard.schemes.megatron(model, inputs, (dist.get_world_size(),))
    elif scheme == "fsdp":
        pin = autoshard.schemes.fsdp(model, inputs, (dist.get_world_size(),))
    else:   # data parallel: the batch split, every parameter whole
        pin = {"idx": ("S(0)",), "targets": ("S(0)",), **{n: ("B",) for n, _ in model.named_parameters()}}
    ref, eager = copy.deepcopy(model), copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, pin=pin, verbose=False, compile=True)
    pe = autoshard.parallelize(eager, inputs, pin=pin, verbose=False)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = [m(*inputs) for m in (pm, pe, ref)]
    for loss in losses:
        loss.backward()
    ref_params, eager_params = dict(ref.named_parameters()), dict(pe.named_parameters())
    grads = {n: (rel_err(p.grad.full_tensor(), ref_params[n].grad),
                 rel_err(p.grad.full_tensor(), eager_params[n].grad.full_tensor())) for n, p in pm.named_parameters()}
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    opt.zero_grad()
    ref_opt.zero_grad()
    again = rel_err(pm(*inputs), ref(*inputs))   # after a step, the same compiled program
    return {"loss": (rel_err(losses[0], losses[2]), rel_err(losses[0], losses[1])), "grads": grads, "again": again,
            "programs": len(pm._programs), "compiled": pm.program.count("self.compiled_"),
            "passes": pm.program.splitlines()[0], "calls": (_runtime_calls(pm.program), _runtime_calls(pe.program)),
            "cuts": sorted(set(re.findall(r"autoshard_runtime_(\w+)\(", pm.program)) & {"weight_later", "linear_dw_later",
                                                                                     "dropout"})}


SCHEMES = ["dp", "megatron", "fsdp"]


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(run_each, compiled_case, [(s,) for s in SCHEMES])


@pytest.mark.parametrize("index", range(len(SCHEMES)), ids=SCHEMES)
def test_compiled_matches_eager_and_single_device(results, index):
    for rank in results:
        r = rank[index]
        assert "error" not in r, r.get("error")
        assert max(r["loss"]) <= TOL, r["loss"]
        for n, (vs_ref, vs_eager) in r["grads"].items():
            assert vs_ref <= TOL and vs_eager <= TOL, (n, vs_ref, vs_eager)
        assert r["again"] <= TOL, r["again"]
        assert r["programs"] == 1   # the same shapes again: no new program, nothing compiled again
        assert r["compiled"] >= 1 and r["passes"].endswith("compile"), r["passes"]
        # the collectives (their starts and waits) run eagerly, as many and in the same order
        assert r["calls"][0] == r["calls"][1]
        # nothing cuts a region but a collective: no dropout that draws nothing, no weight-later linear
        assert r["cuts"] == [], r["cuts"]


def test_compile_is_checked():
    with pytest.raises(TypeError, match="compile is True or False"):
        autoshard.parallelize(GPT(), compile="yes")
