"""What the schedule hides of activation collectives is priced into the solver's objective and
into ``plan.cost`` alike (``cost.overlap.edge_price``), so the solver picks layouts whose
conversions compute can cover, and a plan reports the step it was chosen by. Planned on the meta
device, no processes.

The blind plans price every activation conversion blocking, as the solver did before: the one
internal hook patched is ``cost.overlap._overlap``, which says what a conversion hides."""
import pytest
import torch

import autoshard
from autoshard.cost import overlap
from autoshard.cost.price import Costs
from autoshard.passes import recompute
from autoshard.passes.solve import choice_cost
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
    """A 2048-wide GPT block on 8 A100s. Priced blocking, the MLP's first linear is best
    data-parallel with its weight stored split (FSDP); priced as the schedule runs it, the solver
    computes that linear column-parallel instead: its input's all-gather flies beside the
    linear's own rows and, in backward, beside its weight gradient. Each plan is the cheaper
    under the model it was chosen by, and the overlap-aware plan's step, objective and re-priced
    choice are one figure."""
    model, inputs = _gpt(2048)
    aware = autoshard.plan(model, inputs, mesh=MESH, verbose=False)
    with monkeypatch.context() as m:
        _blind(m)
        blind = autoshard.plan(model, inputs, mesh=MESH, verbose=False)
    graph = aware._priced[0]
    fc = next(n.name for n in graph.nodes if n.op_name == "linear.default"
              and graph.by_name[n.inputs[1][0]].fqn == "blocks.0.fc.weight")
    assert aware.nodes[fc].inputs[1] == ("S(0)",) and aware.params["blocks.0.fc.weight"] == ("S(0)",)
    assert blind.nodes[fc].inputs[1] == ("B",) and blind.params["blocks.0.fc.weight"] == ("S(1)",)
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
    rerun = {o for b in plan.recompute["blocks"] for o in recompute._stack_blocks(graph)[b]}

    def priced(m, patch):
        patch(m)
        fresh = Costs(graph, costs.mesh_shape, costs.cluster, costs.training, costs.bucket_bytes, costs.reshard)
        fresh.recompute = "blocks"
        counts = recompute.best_counts(graph, strategies, choice, fresh, None)
        return choice_cost(graph, strategies, choice, fresh, recompute.chosen(graph, strategies, choice, fresh, counts)[0])
    real = overlap._cached
    with monkeypatch.context() as m:
        afresh = priced(m, lambda m: None)
    with monkeypatch.context() as m:   # every conversion into a recomputed op priced blocking
        blocking = priced(m, lambda m: m.setattr(overlap, "_cached", lambda c, v, s, d, consumer, slot: None
                                                  if consumer.name in rerun else real(c, v, s, d, consumer, slot)))
    with monkeypatch.context() as m:   # as before: the blocks' conversions priced as if overlapped
        counted = priced(m, lambda m: m.setattr(recompute, "unhidden", lambda *a: 0.0))
    assert plan.cost == pytest.approx(plan.solver["objective"], rel=1e-7)   # the solver counts integer picoseconds
    assert plan.cost == pytest.approx(afresh, rel=1e-12)
    assert plan.cost == pytest.approx(blocking, rel=1e-9)
    assert plan.cost > counted * (1 + 1e-3)
    assert not [c for c in plan.schedule["chunks"] if c[0] in rerun or c[1] in rerun]
    kept = autoshard.plan(model, inputs, mesh=MESH, pin=pins, recompute="none", verbose=False)
    assert [c for c in kept.schedule["chunks"] if c[1] in rerun]
    assert plan.breakdown["activations_hidden"] < kept.breakdown["activations_hidden"]
