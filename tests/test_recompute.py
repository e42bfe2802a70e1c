"""Recomputation chosen by the planner (``recompute="auto"``, ``"none"``, ``"blocks"``): the plan
says which blocks keep only their inputs and what running their forward again costs; the
program runs those blocks under torch.utils.checkpoint, exactly (real gloo groups, world 4, on
Megatron and data-parallel plans), runs their forward collectives again in backward, and holds
less memory at its peak (measured)."""
import copy

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard import schemes
from autoshard._compat import cpu_memory_peak
from autoshard.planner.solve import MemoryBudgetError
from models import GPT

pytestmark = pytest.mark.long("recomputed plans trained on 4 ranks, and a 6-layer GPT planned under budgets: 20 s on 2 cores")


def _gpt(layers=4, d=32, seq=16, batch=8, dropout=0.0, device=None):
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = GPT(vocab=64, d=d, heads=4, layers=layers, seq=seq, dropout=dropout)
    idx = torch.randint(0, 64, (batch, seq), device=device)
    return model, (idx, torch.roll(idx, -1, dims=1))


class _AllReduces:
    """Counts the all-reduces the runtime issues."""

    def __enter__(self):
        self.calls, self.saved = 0, dist.all_reduce

        def count(*a, **k):
            self.calls += 1
            return self.saved(*a, **k)
        dist.all_reduce = count
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.saved


def exact_case(mode, mesh, budget):
    """Loss and gradients against one device, the blocks recomputed, the program's checkpointed
    regions, and the all-reduces the backward issued."""
    model, batch = _gpt()
    ref = copy.deepcopy(model)
    pin = schemes.megatron(model, batch, mesh)   # tensor parallel on the last axis, data on the others
    pm = autoshard.parallelize(model, batch, pin=pin, mesh=mesh, recompute=mode, memory_budget=budget)
    out = pm(*batch)
    with _AllReduces() as c:
        out.backward()
    r = ref(*batch)
    r.backward()
    refp = dict(ref.named_parameters())
    grad = max(((p.grad.full_tensor() - refp[n].grad).abs().max() / refp[n].grad.abs().max().clamp_min(1e-6)).item()
               for n, p in pm.named_parameters())
    return {"loss": abs(out.item() - r.item()) / abs(r.item()), "grad": grad,
            "blocks": pm.plan.recompute.get("blocks", []), "regions": pm.program.count("self.recompute_blocks_"),
            "selective": pm.plan.recompute.get("selective"),
            "backward_all_reduces": c.calls, "kinds": {c.kind for c in pm.plan.collectives}}


def _budget_for_two_blocks():
    """A budget that the plan on (2, 2) meets only by recomputing some blocks, not all."""
    model, batch = _gpt()
    pin = schemes.megatron(model, batch, (2, 2))
    full = autoshard.plan(model, batch, mesh=(2, 2), pin=pin, recompute="none", verbose=False)
    every = autoshard.plan(model, batch, mesh=(2, 2), pin=pin, recompute="blocks", verbose=False)
    return (full.memory["total"] + every.memory["total"]) / 2


@pytest.fixture(scope="module")
def exact(world4):
    budget = _budget_for_two_blocks()
    cases = [("none", (2, 2), None), ("blocks", (2, 2), None), ("auto", (2, 2), budget), ("blocks", (4,), None),
             ("selective", (2, 2), None)]
    return {case: world4.run(exact_case, *case) for case in cases}


def test_recomputed_blocks_are_exact_in_fp32(exact):
    for case, ranks in exact.items():
        for r in ranks:
            assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, (case, r)
            assert "all_reduce" in r["kinds"], case   # the plan splits the work: Megatron's all-reduces


def test_the_program_checkpoints_the_blocks_the_plan_names(exact):
    none, every, auto, wide, cheap = (exact[k][0] for k in exact)
    assert none["blocks"] == [] and none["regions"] == 0
    assert every["blocks"] == [f"blocks.{i}" for i in range(4)] and every["regions"] == 4
    assert wide["regions"] == 4
    # under a budget between the two, the solver recomputes some blocks, not all, or every
    # block's cheap ops only
    assert (0 < len(auto["blocks"]) < 4 or auto["selective"]) and auto["regions"] == len(auto["blocks"]), auto
    assert cheap["blocks"] == every["blocks"] and cheap["regions"] == 4 and cheap["selective"]


def test_backward_runs_the_blocks_forward_collectives_again(exact):
    none, every, auto, _, _ = (exact[k][0] for k in exact)
    # Megatron all-reduces each block's attention output in forward, and again in the block's
    # backward; its MLP output's all-reduce is not run again, since checkpoint stops recomputing
    # after the last tensor backward needs (fc2's input), before it
    assert every["backward_all_reduces"] - none["backward_all_reduces"] == 4
    assert auto["backward_all_reduces"] - none["backward_all_reduces"] == len(auto["blocks"])


def dropout_case():
    """With dropout, a recomputed block draws the masks it drew in forward: the gradients equal
    those of the same plan without recomputation, from the same seed."""
    grads = []
    for mode in ("none", "blocks", "selective"):
        model, batch = _gpt(dropout=0.3)
        pm = autoshard.parallelize(model, batch, pin=schemes.megatron(model, batch, (4,)), recompute=mode)
        pm.manual_seed(7)
        pm(*batch).backward()
        grads.append({n: p.grad.full_tensor() for n, p in pm.named_parameters()})
    return max((grads[0][n] - g[n]).abs().max().item() for g in grads[1:] for n in grads[0])


def test_recomputation_replays_dropout_masks(world4):
    assert max(world4.run(dropout_case)) == 0.0


class _Block(torch.nn.Module):
    """A residual block normalised by ``norm``, and counting its calls in a buffer if ``counts``."""

    def __init__(self, norm, counts):
        super().__init__()
        self.fc, self.norm, self.counts = torch.nn.Linear(16, 16), norm(16), counts
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.counts:
            self.calls.add_(1)
        return x + torch.relu(self.norm(self.fc(x)))


def _stack(norm=torch.nn.LayerNorm, counts=False):
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(_Block(norm, counts) for _ in range(4)))
    return torch.nn.Sequential(blocks, torch.nn.Linear(16, 1)), (torch.randn(8, 16),)


def state_case():
    """A stack whose blocks write their state (batch norm's running statistics, a counter
    updated in place) runs with ``recompute="blocks"`` as on one device: no block recomputes, where
    the same stack without state recomputes all four."""
    out = {}
    for name, kw in (("plain", {}), ("batch norm", {"norm": torch.nn.BatchNorm1d}), ("counter", {"counts": True})):
        model, batch = _stack(**kw)
        ref = copy.deepcopy(model)
        pm = autoshard.parallelize(model, batch, mesh=(4,), recompute="blocks", verbose=False)
        for _ in range(2):
            pm(*batch).sum().backward()
            ref(*batch).sum().backward()
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pm.state_dict().items()}
        out[name] = (pm.plan.recompute.get("blocks", []),
                     max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
                     max((p.grad.full_tensor() - r.grad).abs().max().item()
                         for p, r in zip(pm.parameters(), ref.parameters())))
    return out


def test_blocks_that_write_state_never_recompute(world4):
    for out in world4.run(state_case):
        assert len(out["plain"][0]) == 4, out
        assert out["batch norm"][0] == [] and out["counter"][0] == [], out
        assert all(state < 1e-5 and grad < 1e-5 for _, state, grad in out.values()), out


def memory_case():
    """The most memory a training step holds at once, without and with recomputation."""
    out = {}
    for mode in ("none", "blocks", "selective"):
        model, batch = _gpt(layers=6, d=64, seq=64, batch=16)
        pm = autoshard.parallelize(model, batch, pin=schemes.megatron(model, batch, (4,)), recompute=mode)
        pm(*batch).backward()   # the program is built and the gradients exist: a step like any later one
        out[mode] = cpu_memory_peak(lambda: pm(*batch).backward())
        out[mode + "_planned"] = pm.plan.memory["activations"]
    return out


def test_recomputation_lowers_the_measured_peak(world4):
    for r in world4.run(memory_case):
        # measured here: 18.0 MB without, 5.1 MB with (the plan's upper bounds: 26.2 and 6.6 MB)
        assert r["blocks"] < 0.5 * r["none"], r
        assert r["blocks_planned"] < 0.5 * r["none_planned"], r
        # only the cheap ops' outputs (norms, gelu, adds) freed: between the two, as planned
        assert r["blocks"] < r["selective"] < r["none"], r
        assert r["blocks_planned"] < r["selective_planned"] < r["none_planned"], r


# ---- the planner --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def meta_plans():
    """A 6-layer GPT on the meta device at mesh (4,): plans without a budget, and under a budget
    below the memory of the plan that recomputes nothing."""
    model, batch = _gpt(layers=6, d=128, seq=128, batch=32, device="meta")
    kw = dict(mesh=(4,), verbose=False)
    free = {m: autoshard.plan(model, batch, recompute=m, **kw) for m in ("none", "auto", "blocks")}
    budget = 0.8 * free["none"].memory["total"]
    tight = {}
    for m in ("none", "auto", "blocks"):
        try:
            tight[m] = autoshard.plan(model, batch, recompute=m, memory_budget=budget, **kw)
        except MemoryBudgetError as e:
            tight[m] = e
    return free, tight, budget


def test_auto_recomputes_only_what_the_budget_asks(meta_plans):
    free, tight, budget = meta_plans
    assert free["auto"].recompute == {} and free["auto"].cost == pytest.approx(free["none"].cost)
    assert len(free["blocks"].recompute["blocks"]) == 6 and free["blocks"].cost > free["none"].cost
    auto, every = tight["auto"], tight["blocks"]
    assert auto.memory["total"] <= budget and every.memory["total"] <= budget
    assert 0 < len(auto.recompute["blocks"]) <= 6
    assert auto.cost <= every.cost * (1 + 1e-6)
    # the plan's estimated step carries the forward again: compute in backward, and collectives
    assert auto.breakdown["compute_bwd"] >= free["none"].breakdown["compute_bwd"]


def test_without_recomputation_the_budget_costs_more_or_breaks(meta_plans):
    free, tight, _ = meta_plans
    none = tight["none"]
    assert isinstance(none, MemoryBudgetError) or none.cost > tight["auto"].cost, none


def test_the_plan_says_which_blocks_recompute_and_round_trips(meta_plans):
    _, tight, _ = meta_plans
    plan = tight["auto"]
    text = str(plan)
    line = next(ln for ln in text.splitlines() if ln.startswith("recompute:"))
    assert f"{len(plan.recompute['blocks'])} of 6 blocks" in line and "run their forward again in backward" in line
    back = autoshard.Plan.from_json(plan.to_json())
    assert back.recompute == plan.recompute and back.cost == plan.cost


def test_recompute_argument_is_checked():
    model, batch = _gpt(device="meta")
    with pytest.raises(ValueError, match="recompute is one of 'auto', 'none', 'blocks'"):
        autoshard.plan(model, batch, mesh=(2,), recompute="always")
    with pytest.raises(TypeError, match="recompute is one of"):
        autoshard.plan(model, batch, mesh=(2,), recompute=True)


def test_mesh_search_recomputes_where_the_budget_asks(meta_plans):
    """A mesh search under the same budget: every mesh's plan without recomputation is weighed
    against recomputing some blocks (a plan beaten by the best so far goes on to recomputation)."""
    _, tight, budget = meta_plans
    model, batch = _gpt(layers=6, d=128, seq=128, batch=32, device="meta")
    plan = autoshard.plan(model, batch, world=4, memory_budget=budget, verbose=False)
    assert plan.memory["total"] <= budget
    assert plan.cost <= tight["auto"].cost * (1 + 1e-3)   # (4,) is one of its candidates


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_a_search_where_nothing_fits_says_so(mode):
    """Nothing fits at one or two axes: the search refines none of the other meshes and raises
    what the least memory is, rather than descending on every mesh of three or four axes."""
    model, batch = _gpt(layers=4, d=64, seq=64, batch=16, device="meta")
    with pytest.raises(MemoryBudgetError, match="the least it can reach is") as err:
        autoshard.plan(model, batch, world=16, memory_budget=1e4, recompute=mode, verbose=False)
    assert "Raise memory_budget=" in str(err.value)
