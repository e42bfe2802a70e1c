"""What the schedule hides of activation collectives is priced into the solver's objective and
into ``plan.cost`` alike (``cost.overlap.edge_price``), so the solver picks layouts whose
conversions compute can cover, and a plan reports the step it was chosen by. Planned on the meta
device, no processes.

The blind plans price every activation conversion blocking, as the solver did before: the one
internal hook patched is ``cost.overlap._overlap``, which says what a conversion hides."""
import pytest
import torch

import autoshard
from autoshard.cost import overlap, price
from autoshard.cost.price import Costs
from autoshard.planner import recompute, repeat
from autoshard.planner.solve import choice_cost
from models import GPT

MESH = (8,)


def _gpt(d, seq=512, batch=8, layers=1):
    with torch.device("meta"):
        model = GPT(vocab=512, d=d, heads=4, layers=layers, seq=seq)
    idx = torch.randint(0, 512, (batch, seq))
    return model, (idx, torch.roll(idx, -1, dims=1))


def _blind(monkeypatch):
    monkeypatch.setattr(overlap, "_overlap", lambda *args: None)


def _priced(plan, blind, monkeypatch) -> float:
    """The plan's choice priced afresh, with overlap (``blind=False``) or without."""
    graph, strategies, choice, costs, _ = plan._priced
    with monkeypatch.context() as m:
        if blind:
            _blind(m)
        fresh = Costs(graph, costs.mesh_shape, costs.cluster, costs.training, costs.bucket_bytes, costs.reshard)
        return choice_cost(graph, strategies, choice, fresh)


def test_the_solver_chooses_a_layout_whose_conversions_compute_hides(monkeypatch):
    """A 4096-wide GPT block on 8 A100s: priced as the schedule runs it, the solver lays the
    block out otherwise than priced blocking (the blocking plan stores qkv's weight split and
    gathers it; the overlap-aware one keeps it whole and splits fc's), because compute covers
    some of its conversions. Each plan is the cheaper under the model it was chosen by, and the
    overlap-aware plan's step, objective and re-priced choice are one figure. (At 2048 wide the
    two agreed once a decomposed linear's weight gradient stopped being counted beside its
    input's dual reduce-scatter: ``test_a_gathered_linears_weight_gradient_covers_no_dual``.)"""
    model, inputs = _gpt(4096)
    aware = autoshard.plan(model, inputs, mesh=MESH, verbose=False)
    with monkeypatch.context() as m:
        _blind(m)
        blind = autoshard.plan(model, inputs, mesh=MESH, verbose=False)
    assert aware.params["blocks.0.qkv.weight"] == ("B",) and blind.params["blocks.0.qkv.weight"] == ("S(0)",)
    # the plan's step is what the solver minimised, and what its choice prices at afresh
    assert aware.cost == pytest.approx(aware.solver["objective"], rel=1e-7)   # the solver counts integer picoseconds
    assert aware.cost == pytest.approx(_priced(aware, False, monkeypatch), rel=1e-12)
    assert blind.cost == pytest.approx(_priced(blind, True, monkeypatch), rel=1e-12)
    # overlap changed the choice: each plan beats the other under its own model
    assert aware.cost < _priced(blind, False, monkeypatch) * (1 - 1e-3)
    assert blind.cost < _priced(aware, True, monkeypatch) * (1 - 1e-3)
    assert aware.cost < blind.cost
    b = aware.breakdown
    assert b["activations_hidden"] > 0 and b["compute"] + b["exposed"] == pytest.approx(aware.cost)
    assert blind.breakdown["activations_hidden"] == 0


def test_a_chunked_conversion_prices_lower_than_blocking(monkeypatch):
    """Megatron pinned on a 4096-wide GPT: the same layouts with and without overlap priced,
    the step lower by what the schedule hides (chunks' drag deducted), and the chunked
    conversions' collectives reported at their k chunks' seconds."""
    model, inputs = _gpt(4096, seq=2048, batch=4)
    pins = autoshard.schemes.megatron(model, inputs, MESH)
    aware = autoshard.plan(model, inputs, mesh=MESH, pin=pins, verbose=False)
    blocking = _priced(aware, True, monkeypatch)
    chunks = aware.schedule["chunks"]
    assert chunks and all(k > 1 for _, _, k, _ in chunks)
    assert aware.cost == pytest.approx(blocking - aware.breakdown["activations_hidden"], rel=1e-9)
    assert aware.cost == pytest.approx(aware.solver["objective"], rel=1e-7)   # the solver counts integer picoseconds
    expr, values = aware.formula()
    assert float(expr.subs(values)) == pytest.approx(aware.cost, rel=1e-9)


def test_a_recomputed_blocks_conversions_are_priced_as_they_run(monkeypatch):
    """A recomputed block runs in a checkpointed submodule that the schedule pass leaves as it
    is: its conversions block where the rewriter put them, and none is chunked. Megatron pinned
    on two 4096-wide blocks, every block recomputed: the plan's step is the solver's objective
    and its choice priced afresh, and that is the choice priced with every conversion into a
    block's op blocking (``cost.overlap.unhidden``); no chunk and no hidden activation
    communication is reported from a block, where without recomputation its conversions chunk."""
    model, inputs = _gpt(4096, seq=2048, batch=4, layers=2)
    pins = autoshard.schemes.megatron(model, inputs, MESH)
    plan = autoshard.plan(model, inputs, mesh=MESH, pin=pins, recompute="blocks", verbose=False)
    graph, strategies, choice, costs, _ = plan._priced
    assert plan.recompute["blocks"] == ["blocks.0", "blocks.1"]
    rerun = {o for b in plan.recompute["blocks"] for o in repeat.stack_blocks(graph)[b]}

    def priced(m, patch):
        patch(m)
        fresh = Costs(graph, costs.mesh_shape, costs.cluster, costs.training, costs.bucket_bytes, costs.reshard,
                      recompute="blocks")
        counts = recompute.best_counts(graph, strategies, choice, fresh, None)
        return choice_cost(graph, strategies, choice, fresh, recompute.chosen(graph, strategies, choice, fresh, counts)[0])
    real = overlap._cached
    with monkeypatch.context() as m:
        afresh = priced(m, lambda m: None)
    with monkeypatch.context() as m:   # every conversion into a recomputed op priced blocking
        blocking = priced(m, lambda m: m.setattr(overlap, "_cached", lambda c, v, s, d, consumer, slot: None
                                                  if consumer.name in rerun else real(c, v, s, d, consumer, slot)))
    with monkeypatch.context() as m:   # as before: the blocks' conversions priced as if overlapped
        counted = priced(m, lambda m: m.setattr(price, "unhidden", lambda *a: 0.0))
    assert plan.cost == pytest.approx(plan.solver["objective"], rel=1e-7)   # the solver counts integer picoseconds
    assert plan.cost == pytest.approx(afresh, rel=1e-12)
    assert plan.cost == pytest.approx(blocking, rel=1e-9)
    assert plan.cost > counted * (1 + 1e-3)
    assert not [c for c in plan.schedule["chunks"] if c[0] in rerun or c[1] in rerun]
    kept = autoshard.plan(model, inputs, mesh=MESH, pin=pins, recompute="none", verbose=False)
    assert [c for c in kept.schedule["chunks"] if c[1] in rerun]
    assert plan.breakdown["activations_hidden"] < kept.breakdown["activations_hidden"]


def test_a_gathered_linears_weight_gradient_covers_no_dual():
    """Sequence parallelism pinned on a GPT: the all-gather into each column-parallel linear is
    a collective matmul (``runtime.linear_local_part`` / ``linear_gathered``), whose weight
    gradient the linear's own backward makes before the dual reduce-scatter starts. Only the own
    block's input gradient flies beside that reduce-scatter, and that is all the price hides of
    it: no more than a p-th of half the linear's backward. (It had counted the weight gradient
    too, and on a measured CPU cluster priced sequence parallelism's step 5 ms under its
    run on the world-2 GPT of benchmarks/calibration.py.)"""
    model, inputs = _gpt(1024, seq=512, batch=8, layers=2)
    pins = autoshard.schemes.sequence_parallel(model, inputs, MESH)
    plan = autoshard.plan(model, inputs, mesh=MESH, pin=pins, verbose=False)
    graph, strategies, choice, costs, _ = plan._priced
    gathered = 0
    for n in graph.nodes:
        if n.op_name != "linear.default":
            continue
        value, strat = n.inputs[0], strategies[n.name][choice[n.name]]
        src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
        o = overlap.edge_overlap(costs, value, src, strat.inputs[0], n, 0)
        if o is None or o.kinds != ("all_gather",):
            continue
        gathered += 1
        own = costs.node(n, strat).compute_bwd / 2 / MESH[0]
        assert 0 < o.hidden_bwd <= own * (1 + 1e-9) and o.hidden_bwd < o.bwd
    assert gathered == 4   # qkv and fc of each block


@pytest.mark.parametrize("scheme", ["megatron", "sequence_parallel"])
def test_the_cost_model_interleaves_the_batch_where_it_hides_more_than_it_drags(scheme):
    """The batch cut into k interleaved chunks (``cost.interleave``): a 2048-wide GPT on 8 A100s
    pinned to ``scheme`` runs in k > 1 chunks, which save part of the communication it leaves
    exposed, and the plan says so; a 32-wide one keeps k = 1 (each chunk's launches and latency
    cost more than its compute hides), and so does a cluster whose compute hides nothing."""
    def meta(d, seq):
        with torch.device("meta"):
            model = GPT(vocab=512, d=d, heads=4, layers=2, seq=seq)
        idx = torch.zeros(8, seq, dtype=torch.long, device="meta")
        return model, (idx, idx)

    def planned(d, seq, cluster=None):
        model, batch = meta(d, seq)
        pin = getattr(autoshard.schemes, scheme)(model, batch, MESH)
        return autoshard.plan(model, batch, mesh=MESH, pin=pin, cluster=cluster)

    plan = planned(2048, 1024)
    k, saved = plan.schedule["interleave"], plan.breakdown["interleave_saved"]
    assert k > 1 and 0 < saved < plan.breakdown["exposed"] + saved, (k, saved, plan.breakdown["exposed"])
    # the step the plan estimates (and a mesh search compares) is the one it runs: the solver's,
    # less the saving, which moves from exposed to hidden communication
    assert plan.cost == pytest.approx(plan.solver["objective"] - saved, rel=1e-6)
    assert plan.cost == pytest.approx(plan.breakdown["compute"] + plan.breakdown["exposed"], rel=1e-9)
    assert f"the batch cut into {k} interleaved chunks" in str(plan)
    assert autoshard.Plan.from_json(plan.to_json()).schedule["interleave"] == k
    small = planned(32, 16)
    assert small.schedule["interleave"] == 1 and small.breakdown["interleave_saved"] == 0
    assert small.breakdown["exposed"] > 0 and "interleaved" not in str(small)
    blind = planned(2048, 1024, autoshard.Cluster(name="no-overlap", overlap=0.0))
    assert blind.schedule["interleave"] == 1
