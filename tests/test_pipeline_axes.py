"""Pipelines whose stages span more than one other axis, and stages alike planned once: 2 stages
on mesh (2, 2, 2) at world 8, each stage planned on its (2, 2) sub-mesh (data by Megatron tensor
parallel pins, and the solver's own plan), exact against the single-device model (fp32, gloo);
4 stages whose middle two are one program, solved once."""
import contextlib
import copy

import pytest
import torch

import autoshard
from autoshard.planner.pipeline import PipelinePlan
from cases import rel_err
from models import GPT, megatron_pins
from test_pipeline import TOL, _batch

CLUSTER = "a100-80gb-nvlink-ib"


@pytest.fixture(scope="module")
def world8():
    from autoshard.testing.launch import LocalWorld
    with LocalWorld(8, timeout_s=900) as world:
        yield world


def _pins(layers: int) -> dict:
    """Megatron's tensor parallel on the stage's second axis, data parallel on its first."""
    return {name: ("B",) + v for name, v in megatron_pins([f"blocks.{i}." for i in range(layers)]).items()}


def _accumulated(path, pin=None, recompute=None, layers=4, pipeline=2, mesh=(2, 2, 2), no_sync=True, microbatches=None):
    """Two calls' gradients (the first under ``no_sync``) against the model's own, then an SGD
    step and the loss after it; with ``path``, the state saved with torch.distributed.checkpoint
    and loaded onto 4 stages of a model started from other weights. Per rank: (the worst relative
    error of the first loss, of every gradient, of the loss after the step, of the loss loaded;
    the loss before loading; the plan)."""
    torch.manual_seed(0)
    model = GPT(layers=layers)
    ref = copy.deepcopy(model)
    idx, tgt = _batch()
    idx2, tgt2 = _batch()[1], _batch()[0]
    options = dict(pin=pin, recompute=recompute) if pin else {}
    pm = autoshard.parallelize(model, (idx, tgt), pipeline=pipeline, mesh=mesh, microbatches=microbatches,
                               verbose=False, cluster=CLUSTER, **options)
    with pm.no_sync() if no_sync else contextlib.nullcontext():
        first = pm(idx, tgt)
        first.backward()
    pm(idx2, tgt2).backward()
    want = ref(idx, tgt)
    want.backward()
    ref(idx2, tgt2).backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.step()
    ref_opt.step()
    after = pm(idx, tgt).detach()
    out = [rel_err(first, want), grads, rel_err(after, ref(idx, tgt)), 0.0, 1.0, pm.plan.to_json()]
    if path is not None:
        import torch.distributed.checkpoint as dcp
        dcp.save(pm.state_dict(), checkpoint_id=path)
        torch.manual_seed(1)
        other = autoshard.parallelize(GPT(layers=layers), (idx, tgt), pipeline=4, microbatches=4, verbose=False,
                                      cluster=CLUSTER)
        out[4] = rel_err(other(idx, tgt).detach(), after)
        state = other.state_dict()
        dcp.load(state, checkpoint_id=path)
        other.load_state_dict(state)
        out[3] = rel_err(other(idx, tgt).detach(), after)
    return out


def _check(results, mesh):
    for loss, grads, after, loaded, before, _ in results:
        assert loss < TOL and grads < TOL and after < TOL and loaded < TOL, (loss, grads, after, loaded)
        assert before > 1e-3
    plan = PipelinePlan.from_json(results[0][-1])
    assert plan.mesh_shape == mesh
    assert all(s.plan.mesh_shape == mesh[1:] for s in plan.stages)
    return plan


def test_two_stages_by_data_and_megatron_recomputed_on_mesh_2_2_2(world8):
    plan = _check(world8.run(_accumulated, None, _pins(4), "blocks"), (2, 2, 2))
    assert [s.ranks for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for s in plan.stages:   # data parallel on the first axis, tensor parallel on the second, recomputed
        assert s.plan.params[f"{s.blocks[0]}.fc2.weight"] == ("B", "S(1)")
        assert sorted(s.plan.recompute.get("blocks", [])) == list(s.blocks), s.plan.recompute


def test_solver_planned_stages_on_mesh_2_2_2_and_a_checkpoint_onto_4_stages(world8, tmp_path):
    _check(world8.run(_accumulated, str(tmp_path), no_sync=False), (2, 2, 2))


def test_stages_alike_are_solved_once_and_run(world8):
    """GPT of 4 blocks in 4 stages by 2: stages 1 and 2 (a block each, no embedding, no head) are
    one program on one mesh; the second takes the first's plan, its names moved to its block. 8
    microbatches of the batch of 8: one row each, which the data axis of 2 cannot split (what
    crosses between stages splits its next dim there: ``inputs.crossing_layout``)."""
    results = world8.run(_accumulated, None, layers=4, pipeline=4, mesh=(4, 2), no_sync=False, microbatches=8)
    plan = _check(results, (4, 2))
    a, b = plan.stages[1].plan, plan.stages[2].plan
    assert sorted(b.params) == sorted(n.replace("blocks.1.", "blocks.2.") for n in a.params)
    assert b.cost == a.cost and b.solver == a.solver   # the same solve, not another


def test_alike_stages_planned_once():
    """The planner's calls counted: 4 stages, of which the middle two are alike, take 3 solves;
    the reused plan is the one its own solve makes."""
    import dataclasses
    from autoshard.api import plan_graph
    from autoshard.options import PlanOptions
    from autoshard.planner.pipeline import capture_stage, cut, plan_pipeline
    calls = []

    def counted(graph, mesh_shape, options):
        calls.append(graph)
        return plan_graph(graph, mesh_shape, options)
    torch.manual_seed(0)
    model, batch = GPT(layers=8), _batch()
    options = PlanOptions(mesh=(4, 2, 2), pipeline=4, pin=_pins(8), recompute="blocks", cluster=CLUSTER,
                          verbose=False)
    plan = plan_pipeline(model, batch, (4, 2, 2), options, counted)
    assert len(calls) == 3 and [len(s.blocks) for s in plan.stages] == [2, 2, 2, 2]
    stages = cut(model, batch, 4, plan.microbatches, "whole")
    graph = capture_stage(stages, 2, torch.device("cpu"), "whole")
    alone = plan_graph(graph, (2, 2), dataclasses.replace(
        options, mesh=(2, 2), pipeline=None, pin={n: v for n, v in _pins(8).items() if n in graph.param_aliases}))
    reused = plan.stages[2].plan
    assert reused.params == alone.params and reused.cost == alone.cost and reused.recompute == alone.recompute
    assert reused.nodes == alone.nodes and reused.collectives == alone.collectives
    assert "blocks.5.fc2.weight" in reused.explain("blocks.5.fc2.weight")
