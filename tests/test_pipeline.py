"""Pipeline parallelism: the model cut between its blocks into stages on a first mesh axis, each
stage planned on the others and run on torch.distributed.pipelining. Exact against the
single-device model (fp32, gloo) with 2 stages at world 2, 4 stages at world 4, and 2 stages by
2-way data parallel at world 4; planning checked without processes."""
import contextlib
import copy
import json

import pytest
import torch

import autoshard
from autoshard.inputs import crossing_layout
from autoshard.placement import B, S
from autoshard.planner.pipeline import PipelinePlan, timeline
from cases import rel_err
from models import GPT, TwoLayer, megatron_pins

TOL = 1e-5


def _batch(rows=8, seq=16, vocab=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g)


def _against_one_device(pipeline, microbatches=None, layers=4, plan=None, **options):
    """Loss and every held gradient of the pipelined GPT against the model's own, and what the
    rank holds."""
    torch.manual_seed(0)
    model = GPT(layers=layers)
    ref = copy.deepcopy(model)
    idx, tgt = _batch()
    kwargs = dict(plan=plan) if plan is not None else dict(pipeline=pipeline, microbatches=microbatches, **options)
    pm = autoshard.parallelize(model, (idx, tgt), verbose=False, cluster="a100-80gb-nvlink-ib", **kwargs)
    loss = pm(idx, tgt)
    untouched = all(p.grad is None for p in pm.parameters())   # the grads wait for backward
    loss.backward()
    want = ref(idx, tgt)
    want.backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    grads = {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()}
    return {"stage": pm.stage, "chunks": pm.chunks, "loss": rel_err(loss, want), "grads": grads,
            "untouched": untouched, "held": sorted(n for n, _ in pm.named_parameters()), "plan": pm.plan.to_json()}


def _check(results, stages):
    assert sorted(r["stage"] for r in results) == sorted(s for s in range(stages) for _ in range(len(results) // stages))
    plan = PipelinePlan.from_json(results[0]["plan"])
    for r in results:
        assert r["loss"] < TOL, r["loss"]
        assert max(r["grads"].values()) < TOL, r["grads"]
        assert r["untouched"]
        assert r["chunks"] == tuple(s.index for s in plan.chunks(r["stage"]))
        assert r["held"] == sorted({n for c in r["chunks"] for n in plan.stages[c].plan.params if n != "emb.weight"})
    held = [set(r["held"]) for r in results]
    assert "blocks.0.qkv.weight" in held[0]   # and no other block than its chunks' (above)
    ends = {0, len(plan.stages) - 1}
    assert all("head.weight" in h for h, r in zip(held, results) if ends & set(r["chunks"]))   # tied: both ends


def test_two_stages_at_world_2(world2):
    _check(world2.run(_against_one_device, 2), 2)


def test_four_stages_at_world_4(world4):
    _check(world4.run(_against_one_device, 4), 4)


def _shares_sent(*args, **options):
    """``_against_one_device``, with the bytes of what each microbatch handed torch's stage to
    send ("gave"), what it received ("took") and the gradients it sent back ("back"): the
    tensors torch's PipelineStage sends and receives, as the stage program gives and takes them."""
    from autoshard.runtime.pipeline import StageProgram
    seen = {"gave": [], "took": [], "back": []}
    forward = StageProgram.forward

    def recorded(self, *crossing, **batch):
        for x in crossing:
            seen["took"].append(x.numel() * x.element_size())
            x.register_hook(lambda g: seen["back"].append(g.numel() * g.element_size()))
        out = forward(self, *crossing, **batch)
        if not self.last:
            seen["gave"] += [x.numel() * x.element_size() for x in (out if isinstance(out, tuple) else (out,))]
        return out

    StageProgram.forward = recorded
    try:
        return {**_against_one_device(*args, **options), **seen}
    finally:
        StageProgram.forward = forward


def _each_ranks_share(results):
    """What crosses the cut (the residual stream, a microbatch of 4 rows x 16 x 32 in fp32)
    travels as each of a stage's 2 ranks' share of it, half the whole, forward and back."""
    whole = 4 * 16 * 32 * 4
    for r in results:
        share = [whole // 2] * 2   # each of 2 microbatches
        want = {"gave": share, "took": [], "back": []} if r["stage"] == 0 else {"gave": [], "took": share, "back": share}
        assert {k: r[k] for k in want} == want, r["stage"]
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert plan.stages[0].sends == ((whole, True, (4, 16, 32)),)
    assert list(plan.stages[1].plan.arrival.values()) == [("S(0)",)]   # its rows split over the stage's axis
    return plan


def test_two_stages_by_two_data_parallel_at_world_4(world4):
    """Each rank of stage 0 sends its own rows to the rank at its place in stage 1, which takes
    them as they are: its data-parallel layout is the rows split."""
    results = world4.run(_shares_sent, 2, 2)
    _check(results, 2)
    plan = _each_ranks_share(results)
    assert plan.mesh_shape == (2, 2) and plan.microbatches == 2 and plan.schedule == "1F1B"
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    # each stage data parallel on its axis: the weights' gradients all-reduced over it
    assert all(any(c.kind == "all_reduce" for c in s.plan.collectives) for s in plan.stages)
    # nothing converted where the stages hand the rows on and take them
    first, second = plan.stages
    assert not any(c.node == "output" for c in first.plan.collectives)
    assert not any(c.node in second.plan.arrival for c in second.plan.collectives)


def test_two_stages_by_two_way_megatron_recomputed_at_world_4(world4):
    """Megatron-LM's scatter and gather: each tensor-parallel rank sends half the residual, and
    the next stage gathers it on its own axis where its linears need it whole."""
    pins = megatron_pins([f"blocks.{i}." for i in range(4)])
    results = world4.run(_shares_sent, 2, 2, pin=pins, recompute="blocks")
    _check(results, 2)
    plan = _each_ranks_share(results)
    for s in plan.stages:   # tensor parallel on the stage's axis, every block run again in backward
        assert s.plan.params[f"{s.blocks[0]}.fc2.weight"] == ("S(1)",)
        assert sorted(s.plan.recompute.get("blocks", [])) == list(s.blocks), s.plan.recompute


# ---- interleaved 1F1B: virtual=v chunks per rank ---------------------------------------------------

def test_interleaved_two_stages_of_two_chunks_at_world_2(world2):
    results = world2.run(_against_one_device, 2, virtual=2)
    _check(results, 2)
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert plan.schedule == "Interleaved1F1B" and plan.virtual == 2 and plan.microbatches == 4
    assert [s.blocks for s in plan.stages] == [("blocks.0",), ("blocks.1",), ("blocks.2",), ("blocks.3",)]
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    assert [r["chunks"] for r in results] == [(0, 2), (1, 3)]


def test_interleaved_four_stages_of_two_chunks_at_world_4(world4):
    _check(world4.run(_against_one_device, 4, layers=8, virtual=2), 4)


def test_interleaved_two_stages_by_two_data_parallel_at_world_4(world4):
    results = world4.run(_against_one_device, 2, 4, virtual=2)
    _check(results, 2)
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert plan.mesh_shape == (2, 2) and [s.ranks for s in plan.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert all(any(c.kind == "all_reduce" for c in s.plan.collectives) for s in plan.stages)


def test_interleaved_is_priced_and_drawn():
    """``virtual=v``: the fill and drain of a chunk, ``v`` times shorter, against ``v`` times the
    sends; each chunk's activations in flight read off torch's interleaved order."""
    torch.manual_seed(0)
    plain = autoshard.plan(GPT(layers=8), _batch(16), world=4, pipeline=4, microbatches=8, verbose=False)
    plan = autoshard.plan(GPT(layers=8), _batch(16), world=4, pipeline=4, microbatches=8, virtual=2, verbose=False)
    assert plan.bubble == pytest.approx(3 / (2 * 8 + 3)) and plain.bubble == pytest.approx(3 / 11)
    ranks = [sum(plan.slot(s) for s in plan.stages if s.index % 4 == r) for r in range(4)]
    assert plan.cost == pytest.approx((8 + 3 / 2) * max(ranks) + max(plan.reduction(s) for s in plan.stages))
    assert sum(1 for s in plan.stages if plan.send_time(s) > 0) == 7 and sum(1 for s in plain.stages if s.sends) == 3
    # rank 0 fills with (v - 1) rounds of 4 and 2 (k - 1) more forwards: 6 of chunk 0 before its first backward
    assert [plan.in_flight(s) for s in plan.stages] == [8, 8, 7, 5, 4, 4, 3, 1]
    assert plan.rank_memory(0) == pytest.approx(plan.memory(plan.stages[0]) + plan.memory(plan.stages[4]))
    text = str(plan)
    assert "a pipeline of 4 stages, 2 chunks per rank (8 in all), 8 microbatches, schedule Interleaved1F1B" in text
    assert "(8 microbatches + 3/2) x slowest rank" in text
    assert "  rank 3: .    .    .    F0a  F1a  F2a  F3a  F0b  B0b  B0b" in text
    again = PipelinePlan.from_json(plan.to_json())
    assert again.virtual == 2 and again.cost == pytest.approx(plan.cost)


def test_interleaved_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="pass pipeline=k"):
        autoshard.plan(GPT(layers=4), _batch(), world=2, virtual=2, verbose=False)
    with pytest.raises(ValueError, match="rounds of equal size"):
        autoshard.plan(GPT(layers=8), _batch(36), world=4, pipeline=4, virtual=2, microbatches=9, verbose=False)
    with pytest.raises(ValueError, match="pipeline=2 by virtual=4 needs at least 8 repeated blocks"):
        autoshard.plan(GPT(layers=4), _batch(), world=2, pipeline=2, virtual=4, verbose=False)


# ---- zero bubble: schedule="InterleavedZeroBubble" ------------------------------------------------

@pytest.mark.parametrize("virtual", [1, 2])
def test_zero_bubble_at_world_2(world2, virtual):
    results = world2.run(_against_one_device, 2, virtual=virtual, schedule="InterleavedZeroBubble")
    _check(results, 2)
    assert PipelinePlan.from_json(results[0]["plan"]).schedule == "InterleavedZeroBubble"


def test_zero_bubble_four_stages_of_two_chunks_at_world_4(world4):
    _check(world4.run(_against_one_device, 4, layers=8, virtual=2, schedule="InterleavedZeroBubble"), 4)


@pytest.mark.parametrize("scheme", ["data", "megatron"])
def test_zero_bubble_two_stages_by_two_at_world_4(world4, scheme):
    """Each stage data or tensor parallel on its axis: the weight passes run each parameter
    group's reduction on its own, the microbatches kept unreduced handing on zeros."""
    pins = megatron_pins([f"blocks.{i}." for i in range(4)]) if scheme == "megatron" else None
    results = world4.run(_against_one_device, 2, 4, virtual=2, schedule="InterleavedZeroBubble", pin=pins)
    _check(results, 2)
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert plan.mesh_shape == (2, 2)
    if scheme == "megatron":
        assert all(s.plan.params[f"{s.blocks[0]}.fc2.weight"] == ("S(1)",) for s in plan.stages)
    else:
        assert all(any(c.kind == "all_reduce" for c in s.plan.collectives) for s in plan.stages)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_interleaved_schedules_recomputed_and_under_bf16(world2, schedule):
    # chunks of two blocks: a stage of one block is not a stack, and recomputes nothing
    results = world2.run(_against_one_device, 2, layers=8, virtual=2, schedule=schedule, recompute="blocks")
    _check(results, 2)
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert all(sorted(s.plan.recompute.get("blocks", [])) == list(s.blocks) for s in plan.stages)
    _check_bf16(world2.run(_bf16_against_one_device, 2, virtual=2, schedule=schedule))


def test_zbv_two_stages_in_a_v_at_world_2(world2):
    """ZBV: rank r holds chunks r and 2k - 1 - r, so the first rank holds both ends, the
    embedding and the head tied to it one parameter there; the turn of the V stays on a rank."""
    results = world2.run(_against_one_device, 2, virtual=2, schedule="ZBVZeroBubble")
    _check(results, 2)
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]
    assert [r["chunks"] for r in results] == [(0, 3), (1, 2)]
    assert plan.send_time(plan.stages[1]) == 0 and plan.send_time(plan.stages[0]) > 0
    assert "rank 1: .    F0a  F0b" in str(plan)


@pytest.mark.parametrize("pipeline, microbatches, layers", [(4, None, 8), (2, 4, 4)])
def test_zbv_at_world_4(world4, pipeline, microbatches, layers):
    _check(world4.run(_against_one_device, pipeline, microbatches, layers=layers, virtual=2, schedule="ZBVZeroBubble"),
           pipeline)


def test_schedules_priced_by_their_timelines():
    """The step in microbatches through the slowest rank, ``m + k - 1`` for 1F1B and GPipe and
    ``m + (k - 1) / v`` interleaved, is the simulated timeline's; zero bubble's weight passes
    fill part of what is left."""
    from autoshard.planner.pipeline import simulate, step_slots
    for k, m, v in ((2, 4, 1), (4, 8, 1), (4, 4, 1), (2, 4, 2), (4, 8, 2), (4, 16, 3)):
        for name in (["1F1B", "GPipe"] if v == 1 else ["ZBVZeroBubble"] if v == 2 else []) + \
                ["Interleaved1F1B", "InterleavedZeroBubble"]:
            slots = step_slots(name, k, m, v)
            assert slots == pytest.approx(simulate(name, k, m, v)[1] / (3 * v)), (name, k, m, v)
            if name in ("InterleavedZeroBubble", "ZBVZeroBubble"):
                assert m < slots < step_slots("Interleaved1F1B", k, m, v)
    torch.manual_seed(0)
    plan = autoshard.plan(GPT(layers=8), _batch(16), world=4, pipeline=4, schedule="InterleavedZeroBubble",
                          verbose=False)
    assert plan.bubble == pytest.approx(1 / 9) and "I0  W0  F4" in str(plan)
    with pytest.raises(ValueError, match="schedule is one of"):
        autoshard.plan(GPT(layers=4), _batch(), world=2, pipeline=2, schedule="ZBV", verbose=False)
    with pytest.raises(ValueError, match="exactly two chunks per rank"):
        autoshard.plan(GPT(layers=4), _batch(), world=2, pipeline=2, schedule="ZBVZeroBubble", verbose=False)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        autoshard.plan(GPT(layers=4), _batch(), world=2, pipeline=2, virtual=2, schedule="1F1B", verbose=False)


def _local_rows(rows_per_rank):
    """``inputs="local"``: each rank passes its own rows of the batch, the global batch the
    ranks' rows in rank order (ragged on the second call); against one device on that batch."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = GPT(layers=4)
    ref = copy.deepcopy(model)
    idx, tgt = _batch()

    def mine(t, rows):
        first = sum(rows[:dist.get_rank()])
        return t[first:first + rows[dist.get_rank()]]

    pm = autoshard.parallelize(model, (mine(idx, rows_per_rank), mine(tgt, rows_per_rank)), pipeline=2,
                               inputs="local", verbose=False, cluster="a100-80gb-nvlink-ib")
    ragged = [rows_per_rank[0] + 1, rows_per_rank[1] - 1] + list(rows_per_rank[2:])
    pm(mine(idx, rows_per_rank), mine(tgt, rows_per_rank)).backward()
    loss = pm(mine(idx, ragged), mine(tgt, ragged))
    loss.backward()
    want = ref(idx, tgt)
    (want * 2).backward()
    refp = dict(ref.named_parameters(remove_duplicate=False))
    return rel_err(loss, want), max(rel_err(p.grad.full_tensor(), refp[n].grad) for n, p in pm.named_parameters())


def test_local_inputs_gathered_whole(world4):
    for loss, grads in world4.run(_local_rows, [2, 2, 2, 2]):
        assert loss < TOL and grads < TOL, (loss, grads)


def _timed_out(seconds):
    """parallelize(timeout=) bounds the pipeline's groups: rank 1 skips a collective on the
    pipeline axis, and rank 0 waits at most that long."""
    import time

    import torch.distributed as dist
    torch.manual_seed(0)
    pm = autoshard.parallelize(GPT(layers=4), _batch(), pipeline=2, timeout=seconds, verbose=False)
    start = time.monotonic()
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.ones(1), group=pm.device_mesh.get_group("pipeline"))
        except Exception as e:  # noqa: BLE001 - gloo's timeout error
            return time.monotonic() - start, str(e)
        return "rank 0's all-reduce returned though rank 1 never joined it"
    time.sleep(seconds * 2)
    return None


def test_timeout_bounds_the_pipeline_groups():
    from autoshard.testing.launch import LocalWorld
    world = LocalWorld(2)   # its own: the group rank 0 gave up on is of no use after
    try:
        waited, error = world.run(_timed_out, 2.0)[0]
    finally:
        world.close()
    assert "Timed out" in error and waited < 30, (waited, error)


def _bf16_against_one_device(pipeline, microbatches=None, **options):
    """Under MixedPrecisionPolicy(bf16, reduce fp32): the pipelined GPT's loss and every held
    gradient against one device computing in bf16 from its fp32 parameters (the policy's own
    semantics), with that device's distance from fp32 (test_precision's bound)."""
    from test_precision import POLICY, _err, _fp32_run, _noise
    torch.manual_seed(0)
    model = GPT(layers=4)
    ref = copy.deepcopy(model)
    idx, tgt = _batch()
    fp32_loss, fp32 = _fp32_run(model, (idx, tgt))
    pm = autoshard.parallelize(model, (idx, tgt), verbose=False, cluster="a100-80gb-nvlink-ib", pipeline=pipeline,
                               microbatches=microbatches, mp_policy=POLICY, **options)
    loss = pm(idx, tgt)
    loss.backward()
    copies = {n: p.to(torch.bfloat16) for n, p in ref.named_parameters()}
    want = torch.func.functional_call(ref, copies, (idx, tgt), tie_weights=True)
    want.backward()
    refp = dict(ref.named_parameters(remove_duplicate=False))
    return {"stage": pm.stage, "loss": _err(loss, want), "noise": _noise(want, ref, fp32_loss, fp32),
            "grads": {n: _err(p.grad.full_tensor(), refp[n].grad) for n, p in pm.named_parameters()},
            "dtypes": {str(p.dtype) for p in pm.parameters()} | {str(p.grad.dtype) for p in pm.parameters()},
            "loss_dtype": str(loss.dtype), "program": pm.program, "plan": pm.plan.to_json()}


def _check_bf16(results):
    from test_precision import bf16_tol
    for r in results:
        assert r["dtypes"] == {"torch.float32"}, r["dtypes"]   # fp32 masters and their gradients
        assert r["loss_dtype"] == "torch.bfloat16"
        assert "torch.bfloat16" in r["program"]
        assert r["loss"] <= bf16_tol(r), (r["loss"], r["noise"])
        bad = {n: e for n, e in r["grads"].items() if e > bf16_tol(r)}
        assert not bad, (bad, r["noise"])
    plan = PipelinePlan.from_json(results[0]["plan"])
    assert all(s.plan.schedule["precision"]["policy"]["param_dtype"] == "bfloat16" for s in plan.stages)
    # the residual crosses in bf16: half the bytes of fp32 (the targets, int64, beside it)
    assert plan.stages[0].sends[-1][0] == 8 // plan.microbatches * 16 * 32 * 2


@pytest.mark.parametrize("virtual", [1, 2])
def test_bf16_policy_two_stages_at_world_2(world2, virtual):
    _check_bf16(world2.run(_bf16_against_one_device, 2, virtual=virtual))


@pytest.mark.parametrize("scheme", ["data", "megatron"])
@pytest.mark.parametrize("schedule", [None, "InterleavedZeroBubble"])
def test_bf16_policy_two_stages_by_two_at_world_4(world4, scheme, schedule):
    pins = megatron_pins([f"blocks.{i}." for i in range(4)]) if scheme == "megatron" else None
    results = world4.run(_bf16_against_one_device, 2, 2, pin=pins, schedule=schedule)
    _check_bf16(results)
    plan = PipelinePlan.from_json(results[0]["plan"])
    if scheme == "megatron":
        assert all(s.plan.params[f"{s.blocks[0]}.fc2.weight"] == ("S(1)",) for s in plan.stages)


def _steps(pipeline, no_sync=False, virtual=1, schedule=None):
    """Accumulation over two calls (the first under ``no_sync``), a scaled loss, an SGD step and
    evaluation, beside the model's own."""
    torch.manual_seed(0)
    model = GPT(layers=4)
    ref = copy.deepcopy(model)
    idx, tgt = _batch()
    idx2, tgt2 = _batch()[1], _batch()[0]
    pm = autoshard.parallelize(model, (idx, tgt), pipeline=pipeline, virtual=virtual, schedule=schedule,
                               verbose=False, cluster="a100-80gb-nvlink-ib")
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scale = 1 if no_sync else 3   # steps under no_sync take their loss's backward unscaled
    with pm.no_sync() if no_sync else contextlib.nullcontext():
        pm(idx, tgt).backward()
    (pm(idx2, tgt2) * scale).backward()
    ref(idx, tgt).backward()
    (ref(idx2, tgt2) * scale).backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    opt.step()
    ref_opt.step()
    after = rel_err(pm(idx, tgt), ref(idx, tgt))
    pm.eval()
    ref.eval()
    with torch.no_grad():
        if schedule == "ZBVZeroBubble":   # torch's ZBV does not evaluate: told so
            with pytest.raises(ValueError, match="does not evaluate"):
                pm(idx2, tgt2)
            return grads, after, 0.0
        evaluated = rel_err(pm(idx2, tgt2), ref(idx2, tgt2))
    return grads, after, evaluated


@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("virtual, schedule", [(1, None), (2, None), (2, "InterleavedZeroBubble"),
                                               (2, "ZBVZeroBubble")])
def test_accumulation_scaled_loss_sgd_step_and_eval(world4, no_sync, virtual, schedule):
    for grads, after, evaluated in world4.run(_steps, 2, no_sync, virtual, schedule):
        assert grads < TOL and after < TOL and evaluated < TOL, (grads, after, evaluated)


def _checkpointed(path, virtual=1, schedule=None):
    """A step at 2 stages (of ``virtual`` chunks each) by 2-way data parallel, saved with
    torch.distributed.checkpoint, loaded onto 4 stages of a model started from other weights:
    the same loss."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    idx, tgt = _batch()
    pm = autoshard.parallelize(GPT(layers=4), (idx, tgt), pipeline=2, virtual=virtual, schedule=schedule,
                               verbose=False, cluster="a100-80gb-nvlink-ib")
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    pm(idx, tgt).backward()
    opt.step()
    want = pm(idx, tgt).detach()
    dcp.save(pm.state_dict(), checkpoint_id=path)
    torch.manual_seed(1)
    other = autoshard.parallelize(GPT(layers=4), (idx, tgt), pipeline=4, verbose=False, cluster="a100-80gb-nvlink-ib")
    before = other(idx, tgt).detach()
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    return rel_err(before, want), rel_err(other(idx, tgt).detach(), want)


@pytest.mark.parametrize("virtual, schedule", [(1, None), (2, None), (2, "ZBVZeroBubble")])
def test_a_checkpoint_loads_onto_another_pipeline_degree(world4, tmp_path, virtual, schedule):
    for before, after in world4.run(_checkpointed, str(tmp_path), virtual, schedule):
        assert before > 1e-3 and after < TOL, (before, after)


def test_a_saved_plan_runs(world2):
    torch.manual_seed(0)
    plan = autoshard.plan(GPT(layers=4), _batch(), world=2, pipeline=2, microbatches=2, verbose=False)
    again = PipelinePlan.from_json(plan.to_json())
    _check(world2.run(_against_one_device, None, plan=again), 2)


# ---- planning, without processes ----------------------------------------------------------------

def test_plan_lists_stages_and_the_schedule():
    torch.manual_seed(0)
    plan = autoshard.plan(GPT(layers=6), _batch(16), world=8, pipeline=4, verbose=False)
    assert plan.mesh_shape == (4, 2) and plan.microbatches == 8
    assert [s.blocks for s in plan.stages] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3"), ("blocks.4",),
                                               ("blocks.5",)]
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    text = str(plan)
    assert "a pipeline of 4 stages, 8 microbatches, schedule 1F1B" in text
    assert "embedding + blocks.0-1" in text and "blocks.5 + head" in text
    assert f"bubble {3 / 11:.0%}" in text and "stage 3: .   .   .   F0  B0" in text
    assert plan.cost == pytest.approx(11 * max(s.plan.cost - plan.reduction(s) + plan.send_time(s) for s in plan.stages)
                                      + max(plan.reduction(s) for s in plan.stages))
    assert plan.placement("blocks.2.fc.weight")[0] == "stage 1"
    assert plan.explain("head.weight").startswith("head.weight: held by stage 0 (ranks 0,1), stage 3 (ranks 6,7)")


def test_sends_and_activations_in_flight_are_priced():
    """A microbatch crosses each cut as the residual stream (the targets are read by the last
    stage from its own call, never sent): one send forward, its gradient back, on the pipeline
    axis's link; 1F1B keeps ``k - s`` microbatches' activations on stage ``s``."""
    with torch.device("meta"):
        model = GPT(layers=8, d=1024, heads=16, vocab=32000, seq=1024)
    idx = torch.zeros(64, 1024, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (idx, idx), world=64, pipeline=4, verbose=False)
    assert plan.mesh_shape == (4, 16) and plan.microbatches == 8
    first, last = plan.stages[0], plan.stages[-1]
    assert first.sends == ((8 * 1024 * 1024 * 4, True, (8, 1024, 1024)),)   # the residual alone
    latency, bandwidth, _ = first.plan.cluster.group_link((4, 16), (0,))
    assert bandwidth == 200e9 / 8   # stages 16 ranks apart: a node's network shared by its 8 GPUs
    # 8 rows do not split over a stage's 16 ranks, its sequence does: each rank sends a sixteenth
    assert crossing_layout((8, 1024, 1024), (16,)) == (S(1),)
    # Megatron-LM's microbatch (a sequence per data-parallel rank): rows over data, sequence over tensor
    assert crossing_layout((16, 2048, 12288), (16, 8)) == (S(0), S(1)) and crossing_layout((), (2,)) == (B,)
    want = 2 * latency + 2 * 8 * 1024 * 1024 * 4 / 16 / bandwidth   # forward, and its gradient back
    assert plan.send_time(first) == pytest.approx(want) and plan.send_time(last) == 0
    assert [plan.in_flight(s) for s in plan.stages] == [4, 3, 2, 1]
    mem = first.plan.memory
    assert plan.memory(first) == pytest.approx(mem["total"] + 3 * mem["activations"])
    assert "sends" in str(plan) and "in flight" in str(plan)


def test_a_stage_reads_the_inputs_it_needs_from_its_own_call():
    """Every rank has the whole batch: the first stage reads the tokens and the last the
    targets, each from its own call; only the residual stream crosses between stages (the
    targets are not carried through the stages to the loss), and the search prices no cut with
    them either."""
    from autoshard.planner.pipeline import cut
    from autoshard.planner.pipeline_search import block_prices
    from autoshard.api import plan_graph
    from autoshard.options import PlanOptions
    from autoshard.passes.capture import capture
    torch.manual_seed(0)
    model = GPT(layers=4)
    idx, tgt = _batch()
    stages = cut(model, (idx, tgt), 4, 4, "whole")
    residual = ((2, 16, 32), torch.float32)
    assert stages.reads == ((0,), (), (), (1,))
    assert [stages.crossing(s) for s in range(4)] == [(), (residual,), (residual,), (residual,)]
    assert stages.inputs[0] == (((2, 16), torch.int64),) and stages.inputs[3] == (residual, ((2, 16), torch.int64))
    for s, module in enumerate(stages.modules):   # the programs take just those
        assert len([n for n in module.graph.nodes if n.op == "placeholder"]) == len(stages.inputs[s])
    graph = capture(model, (idx[:2], tgt[:2]), None, "whole")
    prices = block_prices(graph, plan_graph(graph, (1,), PlanOptions(mesh=(1,), verbose=False)))
    assert [len(c) for c in prices.crossing] == [0, 1, 1, 1]   # each cut: the residual alone


def test_pins_go_to_the_stage_that_holds_them():
    torch.manual_seed(0)
    pins = {"blocks.3.fc.weight": ("S(0)",), "blocks.0.proj.weight": ("S(1)",)}
    plan = autoshard.plan(GPT(layers=4), _batch(), world=4, pipeline=2, pin=pins, verbose=False)
    assert plan.placement("blocks.3.fc.weight") == ("stage 1", "S(0)")
    assert plan.placement("blocks.0.proj.weight") == ("stage 0", "S(1)")
    with pytest.raises(ValueError, match="no stage holds"):
        autoshard.plan(GPT(layers=4), _batch(), world=4, pipeline=2, pin={"nothing.weight": ("B",)}, verbose=False)


def test_no_pipeline_plans_as_before():
    torch.manual_seed(0)
    model = GPT(layers=2)
    plain = autoshard.plan(model, _batch(), world=4, mesh=(4,), verbose=False)
    one = autoshard.plan(model, _batch(), world=4, mesh=(4,), pipeline=1, verbose=False)
    strip = lambda p: {k: v for k, v in json.loads(p.to_json()).items() if k != "solver"}   # noqa: E731
    assert strip(plain) == strip(one)


def test_timeline_of_gpipe():
    assert timeline("GPipe", 2, 2) == ["  stage 0: F0  F1  .   .   .   B0  B0  B1  B1",
                                       "  stage 1: .   F0  F1  B0  B0  B1  B1  .   ."]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world=8, pipeline=8), "at least 8 repeated blocks"),
    (dict(world=6, pipeline=4), "must divide the world"),
    (dict(world=4, pipeline=2, microbatches=3), "must divide the batch"),
    (dict(world=4, microbatches=2), "pass pipeline=k"),
    (dict(world=4, pipeline=2, mesh=(4,)), "must start with 2"),
])
def test_bad_pipeline_arguments_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        autoshard.plan(GPT(layers=4), _batch(), verbose=False, **kwargs)


def test_a_model_without_blocks_or_loss_is_told():
    with pytest.raises(ValueError, match="no stack of two or more"):
        autoshard.plan(TwoLayer(8, 16), (torch.randn(4, 8), torch.randn(4, 8)), world=2, pipeline=2, verbose=False)
    with pytest.raises(ValueError, match="returns its training loss"):
        autoshard.plan(GPT(layers=4), (_batch()[0],), world=2, pipeline=2, verbose=False)


# ---- the search: pipeline=None ------------------------------------------------------------------

def test_cuts_balance_the_slowest_stage_with_its_sends():
    from autoshard.planner.pipeline_search import Prices, best_cuts
    free = Prices((1.0, 1.0, 1.0, 1.0, 4.0), ((),) * 5)
    assert best_cuts(free, 2, lambda sends: 0.0) == (4.0, (0, 4))
    assert best_cuts(free, 3, lambda sends: 0.0) == (4.0, (0, 2, 4))
    # a cut before block 4 that sends a lot moves there no more: the stages before it pay the send
    dear = Prices((1.0, 1.0, 1.0, 1.0, 4.0), ((), (), (), (), ((100, True, 8),)))
    sends = lambda tensors: 10.0 * len(tensors)   # noqa: E731
    assert best_cuts(dear, 2, sends) == (5.0, (0, 3))


def test_schedules_priced_with_what_their_microbatches_in_flight_recompute():
    """The search's estimate of each schedule: 1F1B ``(m + k - 1)`` stage times; interleaved
    ``(m + (k - 1) / 2)`` times a rank's two chunks; where a chunk's microbatches in flight
    overflow its share of the budget, the part that overflows is recomputed (a third more of its
    blocks' time for all of it)."""
    from autoshard.planner.pipeline_search import Held, Prices, schedule_steps
    prices, free = Prices((1.0,) * 8, ((),) * 8), (lambda sends: 0.0)
    roomy = schedule_steps(prices, 2, 4, free, (2, 1))
    assert [(t, s, v, starts) for t, s, v, starts in roomy] == [(20.0, "1F1B", 1, (0, 4)),
                                                                 (18.0, "Interleaved1F1B", 2, (0, 2, 4, 6))]
    # a block's activations 1 byte, the budget 8: 1F1B's first stage keeps 2 microbatches of 4
    # blocks, within it; interleaved's first chunk 4 of 2 blocks in half of it (4 over, half
    # recomputed: 2 x 7/6), its third 2 of 2 (within): rank 0 at 2 x 7/6 + 2
    tight = schedule_steps(prices, 2, 4, free, (2, 1), Held(state=0.0, block=1.0, budget=8.0))
    assert tight[0][:2] == (20.0, "1F1B") and tight[1][1] == "Interleaved1F1B"
    assert tight[1][0] == pytest.approx(4.5 * (2 * 7 / 6 + 2))


def _searched(cluster):
    with torch.device("meta"):
        model = GPT(layers=4, d=512, heads=8, vocab=32000, seq=256)
    idx = torch.zeros(32, 256, dtype=torch.long, device="meta")
    return autoshard.plan(model, (idx, idx), world=8, cluster=cluster, verbose=False)


def test_search_cuts_stages_across_a_slow_network():
    """Two nodes of 4 GPUs whose network carries 1 GB/s per GPU: the gradients' all-reduce across
    it costs more than the bubble, so the planner cuts the model there, a stage per node."""
    from autoshard.machine.cluster import PRESETS
    plan = _searched(PRESETS["a100-80gb-nvlink-ib"].with_(gpus_per_node=4, inter_bandwidth=4e9))
    assert isinstance(plan, PipelinePlan)
    assert plan.mesh_shape == (2, 4) and [s.ranks for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    unpiped = plan.candidates[-1]
    assert unpiped["pipeline"] == 1 and plan.cost < unpiped["estimate"]
    assert "pipelines searched" in str(plan)
    # interleaving twice the sends across this network costs more than the bubble it saves
    assert plan.schedule == "1F1B" and plan.candidates[0]["schedule"] == "1F1B"


def test_search_keeps_an_nvlink_world_unpiped():
    from autoshard.machine.cluster import PRESETS
    fast = PRESETS["a100-80gb-nvlink-ib"].with_(gpus_per_node=4, inter_bandwidth=600e9, inter_latency=5e-6)
    plan = _searched(fast)
    assert not isinstance(plan, PipelinePlan), str(plan)


def test_search_weighs_the_interleaved_schedule():
    """Where a step's bubble costs more than sending twice as often, the search runs two chunks
    a rank interleaved (a network of 16 GB/s a node, 2 microbatches of a GPT of 8 wide blocks):
    the choice agrees with the two schedules planned on the same stages and microbatches, and the
    summary lists both schedules' estimates. Across a slower network (the test above) 1F1B."""
    from autoshard.machine.cluster import PRESETS
    cluster = PRESETS["a100-80gb-nvlink-ib"].with_(gpus_per_node=4, inter_bandwidth=16e9)
    with torch.device("meta"):
        model = GPT(layers=8, d=2048, heads=8, vocab=32000, seq=512)
    idx = torch.zeros(8, 512, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (idx, idx), world=8, cluster=cluster, verbose=False)
    assert isinstance(plan, PipelinePlan), str(plan)
    assert (plan.schedule, plan.virtual) == ("Interleaved1F1B", 2), str(plan)
    weighed = {(c["schedule"], c["virtual"]) for c in plan.candidates if c["pipeline"] > 1}
    assert weighed == {("1F1B", 1), ("Interleaved1F1B", 2)}, plan.candidates
    assert "Interleaved1F1B x2" in str(plan) and plan.cost < plan.candidates[-1]["estimate"]
    fixed = {v: autoshard.plan(model, (idx, idx), world=8, mesh=tuple(plan.mesh_shape), pipeline=2, virtual=v,
                               microbatches=plan.microbatches, cluster=cluster, verbose=False) for v in (1, 2)}
    assert fixed[1].schedule == "1F1B" and fixed[2].cost < fixed[1].cost, (fixed[1].cost, fixed[2].cost)
    assert [len(plan.chunks(r)) for r in range(2)] == [2, 2]


def test_a_few_blocks_price_the_whole_stack():
    """The search prices each degree on the model's first three blocks (first, middle, last):
    the middle one runs the ops every block between runs, on the same shapes, and stretched to the
    whole stack the prices cross each cut with what the whole model sends there."""
    from autoshard.api import plan_graph
    from autoshard.options import PlanOptions
    from autoshard.passes.capture import capture
    from autoshard.planner.pipeline_search import block_prices, pricing_graph, stretched
    from autoshard.planner.repeat import _block_of
    with torch.device("meta"):
        model = GPT(layers=6, d=256, heads=4, vocab=1024, seq=64)
    idx = torch.zeros(16, 64, dtype=torch.long, device="meta")
    whole = capture(model, (idx[:8], idx[:8]), None, "whole")   # one of two microbatches, as ``short``
    short = pricing_graph(model, (idx, idx), 2, "whole", "blocks", 6)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 6   # given back whole

    def ops(graph, block):
        return sorted((str(n.target), tuple(graph.meta((n.name, 0)).shape)) for n in graph.nodes
                      if n.kind == "op" and _block_of(n) == ("blocks", block))
    assert ops(short, 1) == ops(whole, 3) and ops(short, 1)
    assert len([n for n in short.nodes if n.kind == "param"]) < len([n for n in whole.nodes if n.kind == "param"])
    options = PlanOptions(mesh=(4,), cluster="a100-80gb-nvlink-ib", verbose=False)
    full = block_prices(whole, plan_graph(whole, (4,), options))
    few = stretched(block_prices(short, plan_graph(short, (4,), options)), 6)
    assert len(few.seconds) == len(few.crossing) == 6 and len(set(few.seconds[1:5])) == 1
    assert [sorted(c) for c in full.crossing] == [sorted(c) for c in few.crossing]


def test_the_search_prices_blocks_under_the_policy():
    """``pipeline=None`` under a bf16 policy prices the blocks as the stages run them: captured
    with the policy's casts, the residual crossing each cut in bf16, half the bytes of fp32; the
    weights' casts, which the policy writes at the top of the graph and each stage makes for
    itself, neither cross a cut nor move the blocks' boundaries."""
    from test_precision import POLICY
    from autoshard.api import plan_graph
    from autoshard.options import PlanOptions
    from autoshard.planner.pipeline_search import block_prices, pricing_graph
    with torch.device("meta"):
        model = GPT(layers=6, d=256, heads=4, vocab=1024, seq=64)
    idx = torch.zeros(16, 64, dtype=torch.long, device="meta")
    prices = {}
    for name, policy in (("fp32", None), ("bf16", POLICY)):
        graph = pricing_graph(model, (idx, idx), 2, "whole", "blocks", 6, policy)
        options = PlanOptions(mesh=(4,), cluster="a100-80gb-nvlink-ib", verbose=False, mp_policy=policy)
        prices[name] = block_prices(graph, plan_graph(graph, (4,), options))
    assert prices["fp32"].crossing[1] == ((8 * 64 * 256 * 4, True, (8, 64, 256)),)
    assert prices["bf16"].crossing[1] == ((8 * 64 * 256 * 2, True, (8, 64, 256)),)
    assert prices["bf16"].seconds != prices["fp32"].seconds   # its casts priced in


class _Counted(torch.nn.Module):
    """A stack its forward walks by a count of its own, which a shortened stack breaks."""
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        for i in range(5):
            x = torch.relu(self.blocks[i](x))
        return x.square().mean()


def test_a_stack_that_will_not_shorten_is_priced_whole():
    from autoshard.planner.pipeline_search import pricing_graph
    from autoshard.passes.stages import block_stack
    model = _Counted()
    graph = pricing_graph(model, (torch.randn(8, 8),), 2, "whole", "blocks", 5)
    assert block_stack(graph) == ("blocks", (0, 1, 2, 3, 4))
    assert len(model.blocks) == 5
