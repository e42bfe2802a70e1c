"""plan.explain(name): each alternative the solver had, priced as the plan with only that node
changed, with the words and the pin that force it; what it needs survives to_json/from_json."""
import pytest
import torch

import autoshard
from models import GPT, TwoLayer


def _two_layer(d, hidden, tokens):
    with torch.device("meta"):
        return TwoLayer(d, hidden), (torch.empty(tokens, d), torch.empty(tokens, d))


@pytest.fixture(scope="module")
def big():
    """Big weights, few tokens: tensor parallel on (8,)."""
    model, x = _two_layer(8192, 32768, 8)
    return model, x, autoshard.plan(model, x, mesh=(8,))


def test_explain_names_the_placement_alternatives_and_the_pin(big):
    model, x, plan = big
    assert plan.placement("fc1.weight") == ("S(0)",)
    text = plan.explain("fc1.weight")
    assert text.startswith("parameter fc1.weight (graph node p_fc1_weight), shape 32768x8192")
    assert "axis 0 (8 devices): S(0), dim 0 split 8 ways" in text
    entry = plan.alternatives["p_fc1_weight"]
    chosen, others = entry["options"][0], entry["options"][1:]
    assert chosen["outputs"] == [["S(0)"]] and chosen["step"] == pytest.approx(plan.cost, rel=1e-9)
    replicated = next(o for o in others if o["outputs"] == [["B"]])
    assert replicated["step"] > plan.cost and replicated["memory"] > chosen["memory"]
    assert "why: the next best" in text
    assert "to force it: autoshard.plan(..., pin={'fc1.weight': " in text
    # the price of an alternative is a plan the solver could return: pinned, it costs at most that
    for o in others:
        pinned = autoshard.plan(model, x, mesh=(8,), pin={"fc1.weight": tuple(o["outputs"][0])})
        assert plan.cost * (1 - 1e-9) <= pinned.cost <= o["step"] * (1 + 1e-9), o["outputs"]


def test_no_single_change_beats_an_optimal_plan():
    """Every alternative of every node, priced by the solver's own costs, is no cheaper than the
    plan the solver proved optimal: the local pricing agrees with the objective."""
    with torch.device("meta"):
        model = GPT(vocab=512, d=128, heads=4, layers=4, seq=64)
        idx = torch.empty(32, 64, dtype=torch.long)
    plan = autoshard.plan(model, (idx, idx), mesh=(8,))
    gap = plan.solver["gap"]
    assert gap is not None
    twins = 0
    for name, entry in plan.alternatives.items():
        if "same_as" in entry:
            twins += 1
            assert "same_as" not in plan.alternatives[entry["same_as"]]
            continue
        assert entry["options"][0]["outputs"] == [list(p) for p in plan.nodes[name].outputs]
        assert entry["options"][0]["step"] == pytest.approx(plan.cost, rel=1e-9), name
        for o in entry["options"][1:]:
            assert o["step"] >= plan.cost * (1 - gap) - 1e-12, (name, o["outputs"])
    assert twins > 0   # blocks 2 and 3 share blocks 0 and 1's entries (period-2 ties)
    text = plan.explain("blocks.3.fc.weight")
    assert "shares one choice with p_blocks_1_fc_weight's" in text


def test_alternatives_survive_json(big):
    _, _, plan = big
    again = autoshard.Plan.from_json(plan.to_json())
    assert again.alternatives == plan.alternatives
    assert again.to_json() == plan.to_json()
    for name in ("fc1.weight", "fc2.weight", "x", next(n for n in plan.nodes if n.startswith("linear"))):
        assert again.explain(name) == plan.explain(name)


def test_an_alternative_over_the_memory_budget_says_so():
    model, x = _two_layer(8192, 32768, 8)
    free = autoshard.plan(model, x, mesh=(8,))
    budget = free.memory["total"] + 2**30   # replicating fc1.weight (with its gradient and Adam state) needs 4 GiB more
    plan = autoshard.plan(model, x, mesh=(8,), memory_budget=budget)
    replicated = next(o for o in plan.alternatives["p_fc1_weight"]["options"] if o["outputs"] == [["B"]])
    assert not replicated["fits"]
    assert "(B) would not fit the memory budget" in plan.explain("fc1.weight")


def test_two_axes_explained_axis_by_axis():
    model, x = _two_layer(1024, 4096, 4096)
    plan = autoshard.plan(model, x, mesh=(4, 2))
    text = plan.explain("fc2.weight")
    assert "axis 0 (4 devices): " in text and "axis 1 (2 devices): " in text
    assert "  axis 0: " in text and "  axis 1: " in text


def test_unknown_names_are_told_what_exists(big):
    _, _, plan = big
    with pytest.raises(KeyError, match="did you mean 'fc1.weight'"):
        plan.explain("fc1.weigth")
