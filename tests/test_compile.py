"""Compiled autoshard trains exactly as eager autoshard and the single-device model do, in real gloo
groups: ``parallelize(..., compile=True)`` (the program compiled whole by inductor), and a user's own
``torch.compile`` around the parallel module, which dynamo traces with no graph break (the runtime's
collectives traced as functional collectives, its buckets and parameters as plain autograd).

The user's own compile runs with ``backend="aot_eager"``: the point there is dynamo's and
AOTAutograd's tracing of the runtime (graph breaks, the collectives' autograd, the partition into
forward and backward), which inductor's code generation, shown by ``compile=True`` and by one
user's compile with ``mode="max-autotune"``, does not change."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from cases import rel_err, run_each, step_on_the_same_gradients
from models import GPT

pytestmark = pytest.mark.long("inductor compiles each plan's program, forward and backward, on every rank: "
                              "about 30 s a plan on 2 cores")

TOL = 1e-5   # cases.rel_err: compiled kernels reorder float sums, no more
BF16_TOL = 2e-2   # the bf16 policy: eager and compiled round their bf16 copies' products apart


def _pins(scheme, model, inputs, mesh):
    if scheme == "dp":   # the batch split, every parameter whole
        return {"idx": ("S(0)",), "targets": ("S(0)",), **{n: ("B",) * len(mesh) for n, _ in model.named_parameters()}}
    if scheme == "2d":   # Megatron on the last axis, the batch on the first
        return autoshard.schemes.megatron(model, inputs, mesh)
    return getattr(autoshard.schemes, scheme)(model, inputs, mesh)


def _case(scheme, mesh, *, compile_option=False, backend=None, mode=None, policy=None, recompute=None):
    """Loss and every gradient of one compiled step against eager autoshard and one device, the
    graph breaks of a user's compile, and a second step (no recompile for the same shapes)."""
    torch.manual_seed(0)
    model = GPT()
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    pin = _pins(scheme, model, inputs, mesh)
    kw = {"mp_policy": policy} if policy is not None else {}
    if recompute is not None:
        kw["recompute"] = recompute
    ref, eager = copy.deepcopy(model), copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=pin, verbose=False, compile=compile_option, **kw)
    pe = autoshard.parallelize(eager, inputs, mesh=mesh, pin=pin, verbose=False, **kw)
    out = {}
    run = pm
    if backend is not None:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(pm)(*inputs)
        out["breaks"] = explained.graph_break_count
        out["graphs"] = explained.graph_count
        torch._dynamo.reset()
        run = torch.compile(pm, backend=backend, mode=mode, fullgraph=True)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = [m(*inputs) for m in (run, pe, ref)]
    for loss in losses:
        loss.backward()
    ref_params, eager_params = dict(ref.named_parameters()), dict(pe.named_parameters())
    out["loss"] = (rel_err(losses[0], losses[2]), rel_err(losses[0], losses[1]))
    out["grads"] = {n: (rel_err(p.grad.full_tensor(), ref_params[n].grad),
                        rel_err(p.grad.full_tensor(), eager_params[n].grad.full_tensor()))
                    for n, p in pm.named_parameters()}
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    opt.zero_grad()
    ref_opt.zero_grad()
    out["again"] = rel_err(run(*inputs), ref(*inputs))   # after a step, the same compiled program
    out["programs"] = len(pm._programs)
    out["passes"] = pm.program.splitlines()[0]
    return out


def _compile_option(scheme):
    return _case(scheme, (dist.get_world_size(),), compile_option=True)


def _user_compile(scheme, mesh, policy=None, recompute=None):
    return _case(scheme, mesh, backend="aot_eager", policy=policy, recompute=recompute)


def _max_autotune(scheme):
    """A user's compile with inductor's ``mode="max-autotune"``, which on a CPU tunes its C++ GEMM
    templates and runs."""
    return _case(scheme, (dist.get_world_size(),), backend="inductor", mode="max-autotune")


SCHEMES = ["dp", "megatron", "fsdp"]
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# world 4: a 2-D plan, FSDP under the bf16 policy, Megatron. Not here: recomputed blocks, whose
# checkpoint (passes.checkpoint) reads the shared generator's state, which dynamo cannot trace
WORLD4 = [("2d", (2, 2), None, None), ("fsdp", (4,), BF16, None), ("megatron", (4,), None, None)]


def _call(fn, *args):
    return fn(*args)


def _world_run(n, fn, cases):
    # one group per size for the module, given the minutes inductor's compiles take on 2 cores
    from autoshard.testing.launch import LocalWorld
    with LocalWorld(n, timeout_s=900) as world:
        return world.run(run_each, fn, cases)


@pytest.fixture(scope="module")
def world2_results():
    cases = [(_compile_option, s) for s in SCHEMES] + [(_user_compile, s, (2,)) for s in SCHEMES] + \
        [(_max_autotune, "megatron")]
    return _world_run(2, _call, cases)


@pytest.fixture(scope="module")
def world4_results():
    return _world_run(4, _user_compile, WORLD4)


def _check(r, tol=TOL):
    assert "error" not in r, r.get("error")
    assert max(r["loss"]) <= tol, r["loss"]
    for n, (vs_ref, vs_eager) in r["grads"].items():
        assert vs_ref <= tol and vs_eager <= tol, (n, vs_ref, vs_eager)
    assert r["again"] <= tol, r["again"]
    assert r["programs"] == 1   # the same shapes again: no new program, nothing compiled again


@pytest.mark.parametrize("index", range(len(SCHEMES)), ids=SCHEMES)
def test_compile_option_matches_eager_and_single_device(world2_results, index):
    for rank in world2_results:
        r = rank[index]
        _check(r)
        assert r["passes"].endswith("compile"), r["passes"]


@pytest.mark.parametrize("index", range(len(SCHEMES)), ids=SCHEMES)
def test_users_compile_has_no_graph_break_and_matches(world2_results, index):
    for rank in world2_results:
        r = rank[len(SCHEMES) + index]
        _check(r)
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])


def test_users_max_autotune(world2_results):
    for rank in world2_results:
        r = rank[2 * len(SCHEMES)]
        _check(r)
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[f"{c[0]}-{c[1]}" for c in WORLD4])
def test_users_compile_world4(world4_results, index):
    for rank in world4_results:
        r = rank[index]
        _check(r, BF16_TOL if WORLD4[index][2] is not None else TOL)
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])


def test_compile_is_checked():
    with pytest.raises(TypeError, match="compile is True or False"):
        autoshard.parallelize(GPT(), compile="yes")
