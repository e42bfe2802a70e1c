"""Coverage reports: which ops of a traced model have rules, which run replicated, and what that
costs. The test GPT and CNNs run every compute op split; a model built around ops without rules is
reported with their cost, priced by the solver's cost model."""
import collections
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.cost import compute
from autoshard.report.coverage import COMPUTE_OPS, NO_RULE, NO_SPLIT, UNEVEN, coverage_of, is_compute_op
from autoshard.passes.capture import capture
from autoshard.rules import rule_for
from models import GPT
from models_cnn import ResNet, UNet

aten = torch.ops.aten
CLUSTER = autoshard.Cluster.preset("a100-80gb-nvlink-ib")


class Unruled(nn.Module):
    """A conv net around ops that have no rule: an instance norm (a compute op by the list), a
    logcumsumexp over the whole activation (compute by its share of the step) and a per-channel
    gain through exp2 (bookkeeping). Its call counter, written in place, runs as an out-of-place
    add on a scalar (passes.functionalize), which nothing could split."""

    def __init__(self, c=16):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.head = nn.Linear(c, 10)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.gain = nn.Parameter(torch.zeros(c))

    def forward(self, x):
        self.calls.add_(1)
        y = F.instance_norm(self.conv(x)) * torch.exp2(self.gain).view(1, -1, 1, 1)
        return self.head(y.flatten(2).logcumsumexp(-1).mean(-1))


UNRULED_X = (8, 3, 16, 16)
UNRULED_ACT = 8 * 16 * 16 * 16 * 4   # bytes of the conv's float32 output, (8, 16, 16, 16)


def _gpt_graph(batch=4):
    with torch.device("meta"):
        model = GPT()
        ids = torch.empty(batch, 16, dtype=torch.long)
    return capture(model, (ids, ids))


@pytest.fixture(scope="module")
def gpt():
    return _gpt_graph()


@pytest.fixture(scope="module")
def unruled():
    return capture(Unruled(), torch.randn(UNRULED_X))


def _op_counts(graph) -> dict:
    return dict(collections.Counter(n.op_name for n in graph.nodes if n.kind == "op"))


def test_ops_without_rules_really_lack_them():
    # the fallback model is only a test while these ops have no rule; give it others when they get one
    for op in (aten.instance_norm.default, aten.logcumsumexp.default, aten.exp2.default):
        assert rule_for(op) is None, f"{op} has a rule now: build Unruled from an op that has none"


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_gpt_runs_every_compute_op_split(gpt, mesh):
    cov = coverage_of(gpt, mesh, CLUSTER, model="GPT")
    assert cov.compute_fallbacks == []
    assert [(o.op, o.why, o.has_rule, o.compute) for o in cov.fallbacks] == [
        ("arange.default", (NO_SPLIT,), True, False)]   # the positions, drawn whole on every rank
    for op in ("linear.default", "scaled_dot_product_attention.default", "embedding.default",
               "layer_norm.default", "cross_entropy_loss.default"):
        row = cov.op(op)
        assert row.has_rule and row.compute and not row.falls_back, row
    assert not cov.op("view.default").compute   # a view moves no data
    assert str(cov).endswith("verdict: every compute op has a rule and runs split; 1 op(s) without real "
                             "compute run replicated (0.0ns per step)")


def test_counts_match_the_traced_graph(gpt, unruled):
    for graph in (gpt, unruled):
        cov = coverage_of(graph, (4,), CLUSTER)
        counts = _op_counts(graph)
        assert {o.op: o.nodes for o in cov.ops} == counts
        assert cov.nodes == sum(counts.values())
        assert sorted(o.op for o in cov.with_rules + cov.without_rules) == sorted(counts)
        text = str(cov)
        for o in cov.ops:
            assert re.search(rf"^{re.escape(o.op)} +{o.nodes} ", text, re.M), o.op
        head = text.splitlines()[0]
        assert f"{cov.nodes} op nodes of {len(counts)} ops" in head
    cov = coverage_of(gpt, (32,), CLUSTER)
    assert {op: cov.op(op).nodes for op in ("linear.default", "layer_norm.default", "embedding.default",
                                            "scaled_dot_product_attention.default")} == {
        "linear.default": 9, "layer_norm.default": 5, "embedding.default": 2,
        "scaled_dot_product_attention.default": 2}


@pytest.mark.parametrize("name, model, mesh", [("ResNet", ResNet, (4,)), ("UNet", UNet, (2, 2))])
def test_cnns_run_every_compute_op_split(name, model, mesh):
    torch.manual_seed(0)
    cov = autoshard.coverage(model(), torch.randn(8, 3, 16, 16), mesh=mesh)
    assert cov.model == name and cov.mesh_shape == mesh
    assert cov.compute_fallbacks == []
    # batch norm's num_batches_tracked += 1: an add on a scalar once functionalized, nothing to split
    assert cov.fallbacks == []
    assert cov.op("conv2d.default").compute and not cov.op("conv2d.default").falls_back
    assert "without: 0 (0 nodes)" in str(cov) and "nothing falls back" in str(cov)


def test_fallbacks_are_named_and_priced(unruled):
    cov = coverage_of(unruled, (4,), CLUSTER, model="Unruled")
    assert sorted(o.op for o in cov.compute_fallbacks) == ["instance_norm.default", "logcumsumexp.default"]
    norm, scan, calls = cov.op("instance_norm.default"), cov.op("logcumsumexp.default"), cov.op("exp2.default")
    assert is_compute_op(aten.instance_norm.default)          # on the list
    assert not is_compute_op(aten.logcumsumexp.default) and scan.compute   # by its share of the step
    assert calls.falls_back and not calls.compute and calls not in cov.compute_fallbacks
    # the compute model's own numbers: forward + backward on whole tensors, then split evenly
    act = (8, 16, 16, 16)
    whole = compute.op_time(aten.instance_norm.default, [act], [act], 4, CLUSTER) * (1 + compute.BACKWARD_FACTOR)
    assert norm.whole_time == pytest.approx(whole)
    assert norm.split_time == pytest.approx(whole / 4)
    # the input is gathered (all-gather of a quarter) and its gradient reduce-scattered (the whole)
    assert norm.conversion_bytes == UNRULED_ACT // 4 + UNRULED_ACT
    assert norm.conversion_time > 0
    assert norm.fallback_cost == pytest.approx(whole - whole / 4 + norm.conversion_time)
    assert cov.fallback_cost == pytest.approx(sum(o.fallback_cost for o in cov.fallbacks))
    text = str(cov)
    assert "without: 3 (3 nodes): instance_norm.default, logcumsumexp.default, exp2.default" in text
    assert re.search(r"^instance_norm\.default +1 +no rule +yes ", text, re.M)
    verdict = text.splitlines()[-1]
    assert verdict.startswith("verdict: 2 compute op(s) fall back: ")
    assert "instance_norm.default (no rule, " in verdict and "logcumsumexp.default (no rule, " in verdict


def test_inference_pays_no_backward_conversions(unruled):
    cov = coverage_of(unruled, (4,), CLUSTER, training=False)
    norm = cov.op("instance_norm.default")
    assert norm.conversion_bytes == UNRULED_ACT // 4
    act = (8, 16, 16, 16)
    assert norm.whole_time == pytest.approx(compute.op_time(aten.instance_norm.default, [act], [act], 4, CLUSTER))


def test_one_device_loses_nothing(unruled):
    cov = coverage_of(unruled, (1,), CLUSTER)
    assert cov.fallback_cost == 0
    assert [o.op for o in cov.compute_fallbacks] == ["instance_norm.default"]   # the list holds at any size


def test_a_rule_without_an_even_split_falls_back(gpt):
    # batch 4, 4 heads, 16 positions: attention splits only those (its queries' positions too,
    # unevenly), and none has a part for each of 32 ranks
    cov = coverage_of(gpt, (32,), CLUSTER)
    sdpa = cov.op("scaled_dot_product_attention.default")
    assert sdpa.has_rule and sdpa.why == (UNEVEN,) and sdpa in cov.compute_fallbacks
    assert sdpa.whole_time > sdpa.split_time > 0   # what running it whole costs over a split
    assert "scaled_dot_product_attention.default (no even split on the mesh, " in cov.verdict


@torch.library.custom_op("autoshard_test::check_finite", mutates_args=())
def check_finite(x: torch.Tensor) -> None:
    """A user's own check on an activation: an op with no outputs and no rule."""
    if not torch.isfinite(x).all():
        raise ValueError("not finite")


@check_finite.register_fake
def _(x):
    return None


class Checked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc1(x)
        check_finite(h)
        return self.fc2(h)


def test_an_op_without_outputs_carries_no_compute_but_forces_a_gather():
    cov = autoshard.coverage(Checked(), torch.randn(8, 16), world=4)
    check = cov.op("autoshard_test.check_finite.default")
    assert (check.why, check.compute) == ((NO_RULE,), False)
    assert cov.compute_fallbacks == [] and cov.fallbacks == [check]
    # fc1's output, (8, 16) float32: gathered forward, its gradient reduce-scattered backward
    assert check.conversion_bytes == 8 * 16 * 4 // 4 + 8 * 16 * 4
    assert check.fallback_cost > check.conversion_time > 0


def test_default_world_is_one_node():
    cov = autoshard.coverage(Unruled(), torch.randn(UNRULED_X))
    assert cov.mesh_shape == (CLUSTER.gpus_per_node,)
    assert f"mesh ({CLUSTER.gpus_per_node},) ({CLUSTER.gpus_per_node} devices, {CLUSTER.name})" in str(cov)


def test_compute_ops_name_aten_ops():
    assert [n for n in sorted(COMPUTE_OPS) if not hasattr(aten, n)] == []


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


def test_bad_input_says_what_is_wrong(unruled):
    with pytest.raises(autoshard.CaptureError, match="torch.export could not capture Branchy"):
        autoshard.coverage(Branchy(), torch.randn(4, 4), world=2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        autoshard.coverage(lambda x: x, torch.randn(4), world=2)
    with pytest.raises(ValueError, match="world must be at least 1"):
        autoshard.coverage(Unruled(), torch.randn(UNRULED_X), world=0)
    with pytest.raises(ValueError, match="unknown cluster preset"):
        autoshard.coverage(Unruled(), torch.randn(UNRULED_X), world=2, cluster="tpu")
    with pytest.raises(KeyError, match="Did you mean 'instance_norm.default'"):
        coverage_of(unruled, (2,), CLUSTER).op("instance_norm")
