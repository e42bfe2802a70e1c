"""Capture on the device type the model runs on (issue 32, point 2): the model is traced on fake
tensors of its own device type, so code that looks at its device captures as written.

One small model holds the idioms a meta-device trace got wrong: a router under
``torch.autocast(device_type=x.device.type)`` (torchtitan's MoE; "unsupported autocast device_type
'meta'"), a branch on ``x.device.type``, a tensor made without ``device=`` (``torch.arange(n)``),
and Falcon's indexing with a Python list, which torch.export lifts as a constant tensor (on meta it
had no data: "Cannot copy out of meta tensor"). It plans, and trains exactly as on one device in a
gloo group of 2, on the solver's plan and on two pinned ones, and in a group of 4 on (2, 2); built on the meta device it still plans for 256 devices
with no memory for its weights."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture import capture
from cases import against_one_device, by_case, run_each

D, VOCAB, BATCH, SEQ, EXPERTS = 16, 32, 4, 8, 4
TOL = 1e-5


class DeviceMinded(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, ids, labels):
        h = self.emb(ids)
        if h.device.type == "cpu":   # a device branch: a meta trace took the other one
            h = h * 0.5
        h = h * torch.arange(1, D + 1) / D   # made without device=: on the CPU, as the run makes it
        qkv = self.qkv(h).unflatten(-1, (3, D))
        k = qkv[..., [-2], :].squeeze(-2)   # Falcon's multi-query split: a list index, a lifted constant
        with torch.autocast(device_type=h.device.type, enabled=False):   # torchtitan's router
            scores = torch.softmax(self.router(h.float()), dim=-1)
        h = h + k * scores.amax(-1, keepdim=True)
        logits = self.out(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def test_captured_as_the_cpu_runs_it():
    graph = capture(DeviceMinded(), inputs())
    ops = [n.op_name for n in graph.nodes if n.kind == "op"]
    assert ops.count("mul.Tensor") >= 3, ops           # the CPU branch's scale, the arange's and the gate's
    assert "arange.start" in ops or "arange.default" in ops, ops
    constants = [n for n in graph.nodes if n.kind == "buffer" and n.fqn.startswith("lifted_tensor")]
    assert constants, [n.fqn for n in graph.nodes if n.kind == "buffer"]   # the list index, with its data
    assert graph.exported.constants[constants[0].fqn].tolist() == [-2]


def test_a_meta_model_plans_with_no_memory_for_its_weights():
    with torch.device("meta"):
        model = DeviceMinded()
    plan = autoshard.plan(model, inputs(), world=256, verbose=False)
    assert plan.mesh_shape and len(plan.nodes) > 10
    assert all(p.device.type == "meta" for p in model.parameters())   # untouched


def train_case(pin, mesh=(2,)):
    torch.manual_seed(0)
    model = DeviceMinded()
    ref = copy.deepcopy(model)
    ids, labels = inputs()
    pm = autoshard.parallelize(model, (ids, labels), mesh=mesh, pin=pin)
    return {**against_one_device(pm, ref, (ids, labels)),
            "placed": {n: [tuple(q) for q in node.outputs] for n, node in pm.plan.nodes.items()
                       if n in ("index", "amax", "linear_1")}}


# the solver's plan; the batch split through the list index and the router's max; the features
# split (the router's columns: its scores' max over a split dim is refused, so it gathers them)
PLANS = {"solver": None,
         "batch": {"index": ("S(0)",), "amax": ("S(0)",)},
         "features": {"qkv.weight": ("S(0)",), "router.weight": ("S(0)",), "out.weight": ("S(0)",)}}


@pytest.fixture(scope="module")
def trained(world2):
    per_rank = world2.run(run_each, train_case, [(pin,) for pin in PLANS.values()])
    return by_case(PLANS, per_rank)


# on (2, 2): each pin over both axes alike, and the batch on one with the features on the other
PLANS_2D = {"solver": None, "batch": {k: v * 2 for k, v in PLANS["batch"].items()},
            "features": {k: v * 2 for k, v in PLANS["features"].items()},
            "batch-features": {"index": ("S(0)", "B"), "amax": ("S(0)", "B"), "qkv.weight": ("B", "S(0)"),
                               "router.weight": ("B", "S(0)"), "out.weight": ("B", "S(0)")}}


@pytest.fixture(scope="module")
def trained_2d(world4):
    per_rank = world4.run(run_each, train_case, [(pin, (2, 2)) for pin in PLANS_2D.values()])
    return by_case(PLANS_2D, per_rank)


@pytest.mark.parametrize("plan", PLANS_2D)
def test_exact_against_one_device_on_two_axes(trained_2d, plan):
    _exact(trained_2d[plan])


@pytest.mark.parametrize("plan", PLANS)
def test_exact_against_one_device(trained, plan):
    _exact(trained[plan])
    if plan == "batch":
        assert trained[plan][0]["placed"]["index"] == [("S(0)",)], trained[plan][0]["placed"]


def _exact(ranks):
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["loss"] < TOL and res["logits"] < TOL, res
        bad = {n: e for n, e in res["grads"].items() if e > TOL}
        assert not bad, f"rank {r}: gradients differ: {bad}"
