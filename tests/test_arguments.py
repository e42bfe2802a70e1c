"""Every argument of plan, parallelize, Cluster, the schemes and LocalWorld/run_local is checked up
front: each bad value raises a TypeError (wrong kind) or ValueError (out of range) that names the
argument and says what to pass, before any tracing, solving or process starts."""
import math

import pytest
import torch

import autoshard
from autoshard import Cluster, schemes
from autoshard.testing.launch import LocalWorld, run_local
from models import MLP

MODEL, X = MLP(), torch.randn(8, 32)
NAN, INF = float("nan"), math.inf


def plan(**kw):
    return lambda: autoshard.plan(MODEL, (X,), **{"world": 2, **kw})


def parallelize(*args, **kw):
    return lambda: autoshard.parallelize(*(args or (MODEL, (X,))), **kw)


BAD = [
    # plan
    (lambda: autoshard.plan("mlp", (X,), world=2), TypeError, "model must be a torch.nn.Module"),
    (lambda: autoshard.plan(MODEL, 3, world=2), TypeError, "example_inputs must be a tensor, a tuple"),
    (plan(world=2.0), TypeError, "world is a number of devices"),
    (plan(world=0), ValueError, "world must be at least 1"),
    (plan(world=None), ValueError, "world=N, or mesh="),
    (plan(world=None, mesh="2x2"), TypeError, "mesh is a tuple of axis sizes"),
    (plan(world=None, mesh=(2, 1)), ValueError, "needs at least 2 devices"),
    (plan(world=None, mesh=(2, 2, 2, 2, 2)), ValueError, "at most 4 axes"),
    (plan(mesh=(2, 2)), ValueError, "holds 4 devices but world=2"),
    (plan(cluster=3), TypeError, "cluster is an autoshard.Cluster, a preset name"),
    (plan(cluster="a100"), ValueError, "unknown cluster preset 'a100'; choose one of"),
    (plan(pin=["fc1.weight"]), TypeError, "pin is a dict"),
    (plan(pin={"nope.weight": ("S(0)",)}), ValueError, "cannot pin 'nope.weight'"),
    (plan(training="x"), TypeError, "training is True or False"),
    (plan(training=1), TypeError, "training is True or False"),
    (plan(time_limit="x"), TypeError, "time_limit is a number"),
    (plan(time_limit=0), ValueError, "time_limit must be greater than 0"),
    (plan(time_limit=-1), ValueError, "time_limit must be greater than 0"),
    (plan(time_limit=NAN), ValueError, "time_limit must be a finite number"),
    (plan(time_limit=INF), ValueError, "time_limit must be a finite number"),
    (plan(bucket_bytes=2.5), TypeError, "bucket_bytes is a whole number"),
    (plan(bucket_bytes=0), ValueError, "bucket_bytes must be at least 1"),
    (plan(memory_budget=NAN), ValueError, "memory_budget is a positive number"),
    (plan(memory_budget=INF), ValueError, "memory_budget is a positive number"),
    (plan(memory_budget=-1), ValueError, "memory_budget is a positive number"),
    (plan(memory_budget="80GB"), ValueError, "memory_budget is a positive number"),
    (plan(reshard_after_forward="yes"), ValueError, "reshard_after_forward is True or False"),
    (lambda: autoshard.plan(MODEL, (X,), world=2, timelimit=5), TypeError, "unexpected keyword argument 'timelimit'"),
    # parallelize: checked before it looks for a process group
    (parallelize("mlp", (X,)), TypeError, "model must be a torch.nn.Module"),
    (parallelize(MODEL, 3), TypeError, "example_inputs must be a tensor"),
    (parallelize(plan="{}"), TypeError, r"plan is an autoshard.Plan \(Plan.from_json"),
    (parallelize(overlap="no"), TypeError, "overlap is True or False"),
    (parallelize(timelimit=5), TypeError, "unknown option 'timelimit'.*did you mean 'time_limit'"),
    (parallelize(memory_budget=NAN), ValueError, "memory_budget is a positive number"),
    (parallelize(time_limit=-5), ValueError, "time_limit must be greater than 0"),
    (parallelize(training="x"), TypeError, "training is True or False"),
    (parallelize(timeout=0), ValueError, "timeout must be greater than 0"),
    (parallelize(timeout="1m"), TypeError, "timeout is a number"),
    (parallelize(pin=("fc1.weight",)), TypeError, "pin is a dict"),
    # Cluster
    (lambda: Cluster(memory=NAN), ValueError, "Cluster.memory must be a finite number"),
    (lambda: Cluster(memory=0), ValueError, "Cluster.memory must be greater than 0"),
    (lambda: Cluster(intra_bandwidth=INF), ValueError, "Cluster.intra_bandwidth must be a finite number"),
    (lambda: Cluster(peak_flops="312T"), TypeError, "Cluster.peak_flops is a number"),
    (lambda: Cluster(gpus_per_node=0), ValueError, "Cluster.gpus_per_node must be at least 1"),
    (lambda: Cluster(gpus_per_node=8.0), TypeError, "Cluster.gpus_per_node is a whole number"),
    (lambda: Cluster(inter_latency=-1e-6), ValueError, "Cluster.inter_latency must be at least 0"),
    (lambda: Cluster(efficiency=1.5), ValueError, "Cluster.efficiency must be at most 1"),
    (lambda: Cluster(efficiency=NAN), ValueError, "Cluster.efficiency must be a finite number"),
    (lambda: Cluster(overlap=-0.1), ValueError, "Cluster.overlap must be at least 0"),
    (lambda: Cluster(op_overhead=INF), ValueError, "Cluster.op_overhead must be a finite number"),
    (lambda: Cluster(name=None), TypeError, "Cluster.name is a string"),
    (lambda: Cluster(nodes=4), TypeError, "unexpected keyword argument 'nodes'"),
    (lambda: Cluster.preset("h100"), ValueError, "unknown cluster preset 'h100'; choose one of"),
    (lambda: autoshard.measure(repeats=0), ValueError, "repeats"),
    # schemes
    (lambda: schemes.data_parallel("mlp", (X,), (2,)), TypeError, "model must be a torch.nn.Module"),
    (lambda: schemes.roles("mlp", (X,)), TypeError, "model must be a torch.nn.Module"),
    (lambda: schemes.roles(MODEL, X.numpy()), TypeError, "example_inputs must be a tensor"),
    (lambda: schemes.data_parallel(MODEL, (X,), "2x2"), TypeError, "mesh is a tuple of axis sizes"),
    (lambda: schemes.data_parallel(MODEL, (X,), (2, 0)), ValueError, "needs at least 2 devices"),
    (lambda: schemes.megatron(MODEL, (X,), (2, 2), tp=2), ValueError, r"tp=2 is not an axis of mesh \(2, 2\)"),
    (lambda: schemes.megatron(MODEL, (X,), (2, 2), tp="tp"), TypeError, "tp is the index of a mesh axis"),
    (lambda: schemes.megatron(MODEL, (X,), (2, 2), tp=True), TypeError, "tp is the index of a mesh axis"),
    (lambda: schemes.tensor_2d(MODEL, (X,), (2, 2), row=0, col=0), ValueError, "row and col are both axis 0"),
    (lambda: schemes.fsdp(MODEL, (X,), (2, 2), shard="all"), TypeError, "shard is a mesh axis or a list"),
    (lambda: schemes.fsdp(MODEL, (X,), (2, 2), shard=[0, 0]), ValueError, "are both axis 0"),
    (lambda: schemes.fsdp(MODEL, (X,), (2, 2), shard=[3]), ValueError, r"shard\[0\]=3 is not an axis"),
    (lambda: schemes.axonn_4d(MODEL, (X,), (2, 2), x=0, y=1, z=2), ValueError, "z=2 is not an axis"),
    # LocalWorld and run_local: checked before any process starts
    (lambda: LocalWorld(0), ValueError, "world must be at least 1"),
    (lambda: LocalWorld(2.0), TypeError, "world is a whole number"),
    (lambda: LocalWorld(2, backend="tcp"), ValueError, "backend is the name of a torch.distributed backend"),
    (lambda: LocalWorld(2, timeout_s=0), ValueError, "timeout_s must be greater than 0"),
    (lambda: LocalWorld(2, timeout_s=NAN), ValueError, "timeout_s must be a finite number"),
    (lambda: LocalWorld(2).run("len"), TypeError, "fn is the function to run on every rank"),
    (lambda: run_local(len, "2"), TypeError, "world is a whole number"),
    (lambda: run_local(len, 2, backend=None), ValueError, "backend is the name"),
]


@pytest.mark.parametrize("call, kind, says", BAD, ids=[f"{i}-{b[2][:30]}" for i, b in enumerate(BAD)])
def test_a_bad_argument_is_named_with_what_to_pass(call, kind, says):
    with pytest.raises(kind, match=says):
        call()


def test_plan_takes_the_options_one_by_one_with_their_defaults():
    """``plan``'s keyword options (but ``world``) are ``PlanOptions``'s fields, with its defaults:
    what a user writes is what travels to the planner, and ``parallelize`` takes the same names."""
    import dataclasses
    import inspect

    from autoshard.options import PLAN_OPTIONS, PlanOptions
    given = {n: p.default for n, p in inspect.signature(autoshard.plan).parameters.items()
             if p.kind is p.KEYWORD_ONLY and n != "world"}
    assert given == {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    assert PLAN_OPTIONS == tuple(given)


def test_plan_options_are_checked_when_made():
    from autoshard.options import PlanOptions
    with pytest.raises(TypeError, match="training is True or False"):
        PlanOptions(training="yes")
    with pytest.raises(TypeError):
        PlanOptions(True)   # keyword-only
    assert PlanOptions(mesh=4, memory_budget=10).mesh == (4,)
    assert PlanOptions(memory_budget=10).memory_budget == 10.0
