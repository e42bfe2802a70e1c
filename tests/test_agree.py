"""Ranks that call parallelize differently are told so, on every rank, before they could deadlock
or compute a wrong answer: another batch shape or another batch, a plan on some ranks only,
different plans, options, models or modes; different initial weights warn (rank 0's are taken). A rank
that never comes is named when parallelize has a timeout (autoshard.runtime.agree)."""
import warnings

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.api import PresetWarning
from autoshard.testing.launch import LocalWorld
from models import MLP


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(2)
    yield w
    w.close()


def batch(rows=8, seed=0):
    return (torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)),)


def attempt(how):
    """parallelize an MLP with rank 1 doing ``how`` differently; what each rank saw."""
    rank = dist.get_rank()
    torch.manual_seed(0 if how != "weights" or rank == 0 else 1)
    model, inputs, kwargs = MLP(hidden=32 if how == "model" and rank == 1 else 64), batch(), {}
    if how == "mode" and rank == 1:
        model.eval()
    if how == "shapes" and rank == 1:
        inputs = batch(rows=4)
    if how == "values" and rank == 1:
        inputs = batch(seed=1)
    if how in ("plan on rank 0", "plans", "plans alike"):
        pin = {"layers.0.fc1.weight": ("S(0)",)} if how == "plans" and rank == 1 else None
        planned = autoshard.plan(MLP(), batch(), mesh=(2,), pin=pin, time_limit=10)
        kwargs = {"plan": planned} if rank == 0 or how != "plan on rank 0" else {}
    if how == "options":
        kwargs = {"time_limit": 10.0 + rank}
    if how == "first call":   # no example inputs: planned at the first call, from its batch
        pm = autoshard.parallelize(model)
        try:
            pm(*(batch(rows=4) if rank == 1 else batch()))
        except ValueError as e:
            return str(e)
        return "ran"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pm = autoshard.parallelize(model, inputs, **kwargs)
        except ValueError as e:
            return str(e)
    said = [str(w.message) for w in caught if "autoshard" in str(w.message) and w.category is not PresetWarning]
    return said, pm(*batch()).detach()


@pytest.mark.parametrize("how, says", [
    ("shapes", "on shapes: ranks [0] have 'inputs of shapes [8, 32] float32'; ranks [1] have 'inputs of shapes [4, 32]"),
    ("values", "on values"),
    ("plan on rank 0", "on plan"),
    ("plans", "on plan"),
    ("options", "on options"),
    ("model", "on model"),
    ("mode", "on training: ranks [0] have True; ranks [1] have False"),
    ("first call", "on shapes"),
])
def test_ranks_that_disagree_are_told_on_every_rank(world, how, says):
    got = world.run(attempt, how)
    for rank, text in enumerate(got):
        assert isinstance(text, str), (rank, text)
        assert "the ranks disagree" in text and says in text, (rank, text)
        assert "every rank" in text


def test_different_initial_weights_warn_and_take_rank_0s(world):
    (said0, out0), (said1, out1) = world.run(attempt, "weights")
    assert any("rank 0's" in s for s in said0) and said0 == said1
    torch.manual_seed(0)
    torch.testing.assert_close(out0, MLP()(*batch()).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out1, out0)


@pytest.mark.parametrize("how", ["nothing", "plans alike"])
def test_ranks_that_agree_hear_nothing(world, how):
    # each rank planning for itself makes the same layouts, though its solver took its own time
    for said, _ in world.run(attempt, how):
        assert said == []


def absent(timeout):
    if dist.get_rank() == 1:
        return "stayed away"
    autoshard.parallelize(MLP(), batch(), timeout=timeout)


def test_a_rank_that_never_comes_is_named(world):
    with pytest.raises(RuntimeError, match=r"(?s)failed on rank 0.*not every rank arrived within timeout=2 s.*1"):
        world.run(absent, 2.0)
