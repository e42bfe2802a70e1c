"""Planning at scale: the work that is the same for every layer and every mesh is done once, the
phases are timed, and a long search or solve says how far it got (on stderr, unless verbose=False).
Planned on the meta device with no process group."""
import math

import pytest
import torch

import autoshard
from autoshard import placement as pl
from autoshard.machine.cluster import PRESETS
from autoshard.passes import annotate as annotate_pass
from autoshard.planner import progress
from autoshard.passes.capture import capture
from autoshard.planner.repeat import tie_repeated
from autoshard.cost.price import Costs
from autoshard.cost.step import Cost
from autoshard.planner.solve import NoBetterPlan, lower_bound, solve
from models import GPT

CLUSTER = PRESETS["a100-80gb-nvlink-ib"]


def _gpt(layers, batch=16):
    with torch.device("meta"):
        model = GPT(vocab=256, d=64, heads=2, layers=layers, seq=32)
    idx = torch.zeros(batch, 32, dtype=torch.long, device="meta")
    return model, (idx, idx)


def test_the_rules_are_asked_once_per_distinct_op_whatever_the_depth_and_the_mesh(monkeypatch):
    asked = []
    real = annotate_pass.one_axis_sigs
    monkeypatch.setattr(annotate_pass, "one_axis_sigs", lambda node, graph: asked.append(node.name) or real(node, graph))
    counts = {}
    for layers in (2, 6):
        graph = capture(*_gpt(layers))
        asked.clear()
        for mesh in [(8,), (2, 4), (4, 2)]:
            annotate_pass.annotate(graph, mesh)
        counts[layers] = len(asked)
    assert counts[6] == counts[2] > 0   # the layers of a stack ask the rule once between them, once for all meshes


def test_reused_annotation_equals_a_fresh_one_and_ties_the_layers():
    graph = capture(*_gpt(6))
    mesh = (2, 4)
    first = annotate_pass.annotate(graph, mesh)
    again = annotate_pass.annotate(graph, mesh)
    fresh = annotate_pass.annotate(capture(*_gpt(6)), mesh)   # a graph of its own: nothing worked out yet
    assert first.keys() == fresh.keys()
    assert all(first[k] == fresh[k] == again[k] for k in first)
    rep = tie_repeated(graph, first)
    tied = sum(1 for k, v in rep.items() if k != v)
    assert tied > 0 and tied == sum(1 for k, v in tie_repeated(graph, fresh).items() if k != v)
    # a pin narrows one layer's strategies: that layer is no longer tied to its twin
    pinned = dict(first)
    w = next(n.name for n in graph.nodes if n.kind == "param" and n.fqn == "blocks.4.fc.weight")
    pinned[w] = pinned[w][:1]
    assert tie_repeated(graph, pinned)[w] == w


def test_the_integer_program_reads_one_table_per_mesh():
    # the LP bound, the solve and a solve that must beat a cost share one pricing of the mesh and
    # one LP relaxation, whose support gives the plan and whose bound proves it
    graph = capture(*_gpt(2))
    mesh = (2, 2)
    strategies = annotate_pass.annotate(graph, mesh)
    costs = Costs(graph, mesh, CLUSTER, True)
    progress.CLOCK.reset()
    bound = lower_bound(graph, strategies, costs, 80e9)
    spent = dict(progress.CLOCK.seconds)
    assert lower_bound(graph, strategies, costs, 80e9) == bound and progress.CLOCK.seconds == spent
    solution = solve(graph, strategies, costs, 60, 80e9)
    assert solution.status == "OPTIMAL" and solution.gap <= 1e-3
    assert bound <= solution.objective * (1 + 1e-6)
    exact = solve(graph, strategies, costs, 60, 80e9, hint=solution.choice)   # CP-SAT alone, on the whole program
    assert exact.objective >= solution.objective * (1 - 1e-3)
    with pytest.raises(NoBetterPlan) as info:
        solve(graph, strategies, costs, 60, 80e9, below=solution.objective * (1 - 1e-3))
    assert info.value.proven
    assert solve(graph, strategies, costs, 60, 80e9, below=solution.objective * (1 + 1e-3)).objective == \
        pytest.approx(solution.objective, rel=1e-6)


def test_every_phase_is_timed():
    progress.CLOCK.reset()
    autoshard.plan(*_gpt(2), world=8, verbose=False)
    seconds = progress.CLOCK.seconds
    assert set(seconds) == set(progress.PHASES)
    assert all(seconds[k] > 0 for k in ("capture", "annotate", "cost", "build", "solve"))


def test_the_solver_seconds_cover_every_solve_of_a_fixed_mesh_plan():
    # under recompute="auto" with a budget, the solve bounds its modes before it solves one: its
    # time is all of it (it read the last mode's solve alone, 0.0 s for a Llama-3-style model)
    progress.CLOCK.reset()
    plan = autoshard.plan(*_gpt(2), mesh=(2, 2), verbose=False)
    seconds = progress.CLOCK.seconds
    assert plan.solver["seconds"] >= seconds["build"] + seconds["solve"] > 0


def test_a_long_solve_shows_its_progress_unless_silenced(monkeypatch, capfd):
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)   # every solve counts as long here
    monkeypatch.setattr(progress, "EVERY", 0.0)
    model, inputs = _gpt(2)
    autoshard.plan(model, inputs, mesh=(4, 2))
    err = capfd.readouterr().err
    assert "autoshard: solving mesh (4, 2): best" in err and "ms per step" in err
    assert "autoshard: solving mesh (4, 2): optimal" in err
    autoshard.plan(model, inputs, mesh=(4, 2), verbose=False)
    assert "autoshard" not in capfd.readouterr().err


def test_verbose_is_a_bool():
    with pytest.raises(TypeError, match="verbose is True or False"):
        autoshard.plan(*_gpt(2), mesh=(8,), verbose="yes")


# ---- the large search's shortcuts price what the long way prices ----------------------------------

def test_a_plan_priced_once_per_price_and_weighed_twin_by_twin_is_priced_and_weighed_node_by_node():
    from autoshard.cost import memory
    from autoshard.planner.make import _priced
    from autoshard.planner.repeat import tied_plan
    from autoshard.planner.solve import choice_cost
    graph = capture(*_gpt(6))
    mesh = (2, 4)
    strategies = annotate_pass.annotate(graph, mesh)
    costs = Costs(graph, mesh, CLUSTER, True)
    choice = solve(graph, strategies, costs, 60, 80e9).choice
    tied = tied_plan(graph, strategies, choice)
    assert tied is not None and sum(tied[0].values()) == len(graph.nodes) > len(tied[0])
    def node_by_node(choice):
        return sum((cost for _, _, cost in _priced(graph, strategies, choice, costs)), start=Cost()).step

    assert choice_cost(graph, strategies, choice, costs) == pytest.approx(node_by_node(choice), rel=1e-12)
    assert memory.rank_memory(graph, strategies, choice, mesh, True, False, tied) == \
        memory.rank_memory(graph, strategies, choice, mesh, True, False)
    # a plan whose twins differ is priced node by node
    name, twin = next((a, b) for a, b in tie_repeated(graph, strategies).items() if a != b and len(strategies[a]) > 1)
    apart = dict(choice, **{name: (choice[twin] + 1) % len(strategies[name])})
    assert tied_plan(graph, strategies, apart) is None
    assert choice_cost(graph, strategies, apart, costs) == pytest.approx(node_by_node(apart), rel=1e-12)


def test_a_quick_bound_is_a_bound_and_raising_it_gives_the_exact_one():
    from autoshard.planner import recompute
    from autoshard.planner.relax import mode_bounds, relaxation
    from autoshard.cost import memory
    graph = capture(*_gpt(4))
    mesh = (2, 4)
    strategies = annotate_pass.annotate(graph, mesh)
    costs = Costs(graph, mesh, CLUSTER, True)
    need = memory.rank_memory(graph, strategies, solve(graph, strategies, costs, 60, None).choice, mesh, True)["total"]
    for share in (0.8, 0.5, 0.4, 0.05):   # budgets that bind: recomputation in play, or nothing fits
        budget = need * share
        costs = Costs(graph, mesh, CLUSTER, True, recompute=recompute.AUTO)
        quick = lower_bound(graph, strategies, costs, budget, quick=True)
        exact = lower_bound(graph, strategies, costs, budget)
        assert quick <= exact and math.isinf(quick) == math.isinf(exact)   # quick says as surely that nothing fits
        if math.isinf(exact):
            continue
        if share == 0.8:   # the tighter budgets' plans take CP-SAT 20-30 s here: benchmarks/budget_bounds.py
            plan = solve(graph, strategies, costs, 60, budget)
            assert exact <= plan.objective * (1 + 1e-6)
        # the cheap ops' relaxation is skipped only where it cannot move the least of the modes
        modes = mode_bounds(graph, strategies, costs, budget)
        selective = relaxation(graph, strategies, costs.with_recompute(recompute.SELECTIVE), budget)[0]
        assert min(modes.values()) == pytest.approx(min(modes["none"], modes["blocks"], max(selective, modes["selective"])),
                                                    rel=1e-12)


def test_a_descent_step_whose_relaxation_is_whole_takes_its_plan_as_cp_sat_would():
    from autoshard.planner import descend
    from autoshard.planner import solve as solve_module
    graph = capture(*_gpt(4, batch=64))
    coarse = annotate_pass.annotate(graph, (4, 4))
    start = solve(graph, coarse, Costs(graph, (4, 4), CLUSTER, True), 60, None)
    real, whole = solve_module.whole_plan, []

    def spy(*args):
        got = real(*args)
        whole.append(got is not None)
        return got

    for fine, groups in [((2, 2, 4), (2, 1)), ((4, 2, 2), (1, 2))]:
        strategies = annotate_pass.annotate(graph, fine)
        lifted = descend.lift(graph, coarse, start.choice, groups, strategies)
        found = {}
        for name, step in (("whole", spy), ("cp-sat", lambda *args: None)):
            solve_module.whole_plan = step
            try:
                found[name] = descend.solve_mesh(graph, strategies, Costs(graph, fine, CLUSTER, True), 60, None,
                                                 lambda: [lifted])
            finally:
                solve_module.whole_plan = real
        # the same plan cost, CP-SAT's in whole picoseconds
        assert found["whole"].objective == pytest.approx(found["cp-sat"].objective, rel=1e-6)
    assert whole and all(whole)   # every step's relaxation was whole: no CP-SAT at all


def test_a_descent_step_whose_relaxation_is_fractional_takes_its_rounding_only_within_the_gap_and_the_budget():
    """The 96-layer GPT's (64, 16) plan refined onto (64, 8, 2) under an 80 GB budget: the first
    step's relaxation is fractional (the budget binds). Its rounding is taken without CP-SAT, and
    the descent ends within the solver's gap of the one that asks CP-SAT for every such step,
    in a plan that fits the budget."""
    from autoshard.planner import descend
    from autoshard.planner import relax
    from autoshard.planner import solve as solve_module
    from autoshard.planner.make import make_plan
    with torch.device("meta"):
        model = GPT(vocab=50304, d=2048, heads=16, layers=96, seq=2048)
    idx = torch.zeros(1024, 2048, dtype=torch.long, device="meta")
    graph = capture(model, (idx, idx))
    budget = 80e9

    def costs(mesh):
        return Costs(graph, mesh, CLUSTER, True, recompute="auto")

    coarse = annotate_pass.annotate(graph, (64, 16))
    start = solve(graph, coarse, costs((64, 16)), 60, budget, effort=0)
    fine, groups = (64, 8, 2), (1, 2)
    strategies = annotate_pass.annotate(graph, fine)
    lifted = descend.lift(graph, coarse, start.choice, groups, strategies)
    real, steps = solve_module.whole_plan, []

    def fractional(graph, strategies, c, budget):
        weights = relax.relaxation(graph, strategies, c, budget)[1]
        return weights is not None and any(max(w) < 1 - 1e-6 for w in weights.values())

    def spy(graph, strategies, c, budget, hint=None):
        got = real(graph, strategies, c, budget, hint)
        steps.append((fractional(graph, strategies, c, budget), got is not None))
        return got

    def whole_only(graph, strategies, c, budget, hint=None):
        return None if fractional(graph, strategies, c, budget) else real(graph, strategies, c, budget, hint)

    found = {}
    for name, step in (("rounded", spy), ("cp-sat", whole_only)):
        solve_module.whole_plan = step
        try:
            c = costs(fine)
            found[name] = (descend.solve_mesh(graph, strategies, c, 60, budget, lambda: [lifted],
                                              descend.unsplit(groups)), c)
        finally:
            solve_module.whole_plan = real
    assert (True, True) in steps   # a fractional relaxation's step taken without CP-SAT
    rounded, cp_sat = found["rounded"][0], found["cp-sat"][0]
    assert rounded.objective < start.objective   # the step improved on the lifted plan
    assert rounded.objective == pytest.approx(cp_sat.objective, rel=solve_module.GAP_LIMIT)
    assert make_plan(graph, strategies, rounded, found["rounded"][1]).memory["total"] <= budget


def test_a_conversions_remembered_plan_walks_any_shape_as_planning_it_afresh_would():
    """``convert._axis_by_axis`` remembers each pair of layouts' plan and reuses it for every
    tensor and every mesh of as many axes: every conversion between the layouts of 3-d tensors,
    even and uneven, on meshes of two and three axes, takes the steps planned afresh for its own
    shape and mesh, after the others have filled the memo."""
    import itertools
    from autoshard import convert
    from autoshard.placement import B, P, Split
    convert._PLANS.clear()
    checked = 0
    for mesh, shapes in [((2, 4), [(8, 16, 32), (6, 12, 20)]), ((4, 2), [(8, 16, 32), (3, 5, 7)]),
                         ((2, 2, 2), [(8, 8, 8), (4, 6, 10)])]:
        layouts = list(itertools.product([B, P, Split(0), Split(1), Split(2)], repeat=len(mesh)))
        for whole in shapes:
            for src in layouts:
                local = pl.local_shape(whole, src, mesh)
                if local is None:
                    continue
                for dst in layouts:
                    uneven = convert._uneven_dims(whole, src, dst, mesh)
                    fresh, _ = convert._plan(local, src, dst, mesh, uneven)
                    got = convert._axis_by_axis(local, src, dst, mesh, uneven)
                    steps = [(s.kind, s.axis, s.dim, s.dim2, s.groups) for s in got]
                    assert steps == list(fresh), (mesh, whole, src, dst)
                    shape = tuple(local)
                    for s in got:   # each step takes the shape the ones before it left
                        assert s.in_shape == shape
                        shape = convert.apply_shape(shape, s, mesh[s.axis])
                    checked += 1
    assert checked > 30000
