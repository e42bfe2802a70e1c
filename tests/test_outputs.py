"""Outputs kept in their planned layouts (``outputs="dtensor"``): the logits of a GPT split over the
vocabulary and handed to torch's ``loss_parallel`` outside the model, in real gloo groups of 2
and 4 ranks against the single-device model; outputs split, partial and broadcast, whose
gradients come back through DTensor; and the plan pricing the gather of an output only where
the caller asks for whole outputs."""
import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.plan import Plan
from cases import rel_err
from models import GPT, TwoLayer

TOL = dict(rtol=1e-5, atol=2e-6)
VOCAB, BATCH, SEQ = 64, 4, 16


def _gpt():
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, d=32, heads=4, layers=2, seq=SEQ)   # head tied to the embedding
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, idx, torch.randint(0, VOCAB, (BATCH, SEQ))


def _node_of(model, inputs, mesh, module) -> str:
    """The name of the op of ``module`` in the plan's graph (to pin its output)."""
    plan = autoshard.plan(model, inputs, mesh=mesh, verbose=False, time_limit=10)
    return next(n.name for n in plan.nodes.values() if n.module == module)


def vocab_pins(model, idx, mesh):
    """The head's weight split over the vocabulary on the last mesh axis and the logits with it;
    on two axes the batch split over the first."""
    head = _node_of(model, (idx,), mesh, "head")
    if len(mesh) == 1:
        return {"head.weight": ("S(0)",), head: ("S(2)",)}
    return {"head.weight": ("B", "S(0)"), "idx": ("S(0)", "B"), head: ("S(0)", "S(2)")}


def loss_parallel_case(mesh, from_json=False):
    """Logits kept split over the vocabulary, the loss by ``loss_parallel`` on the DTensor: loss
    and every gradient against the single-device model's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel
    model, idx, targets = _gpt()
    ref = copy.deepcopy(model)
    reduction = "mean" if len(mesh) == 1 else "sum"   # loss_parallel's mean needs a 1-D mesh
    pin = vocab_pins(model, idx, mesh)
    if from_json:   # a plan made elsewhere, read back: it says how outputs are handed back
        plan = Plan.from_json(autoshard.plan(model, (idx,), mesh=mesh, pin=pin, outputs="dtensor",
                                             verbose=False).to_json())
        pm = autoshard.parallelize(model, (idx,), plan=plan)
    else:
        pm = autoshard.parallelize(model, (idx,), mesh=mesh, pin=pin, outputs="dtensor")
    logits = pm(idx)
    result = {"dtensor": isinstance(logits, DTensor), "mesh": logits.device_mesh is pm.device_mesh,
              "placements": tuple(logits.placements), "local": tuple(logits.to_local().shape),
              "shape": tuple(logits.shape)}
    flat = targets.flatten()
    if len(mesh) == 2:   # the targets split over the batch as the logits are
        flat = distribute_tensor(flat, pm.device_mesh, [Shard(0), Replicate()])
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), flat, reduction=reduction)
        loss.backward()
    ref_loss = F.cross_entropy(ref(idx).flatten(0, 1), targets.flatten(), reduction=reduction)
    ref_loss.backward()
    result["loss"] = (loss.full_tensor() - ref_loss).abs().item() / ref_loss.abs().item()
    ref_params = dict(ref.named_parameters())
    result["grads"] = {n: ((p.grad.full_tensor() - ref_params[n].grad).abs().max() / ref_params[n].grad.abs().max()).item()
                       for n, p in pm.named_parameters()}   # relative: a summed loss has large gradients
    result["gathered"] = [(c.kind, c.phase) for c in pm.plan.collectives if c.node == "output"]
    result["program"] = pm.program
    result["vocab_split"] = Shard(2) in result["placements"]
    return result


class ThreeWays(nn.Module):
    """Outputs that leave split (the column-parallel fc1's), partial (the row-parallel fc2's) and
    broadcast (a norm of the whole input)."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, hidden), nn.Linear(hidden, d, bias=False), nn.LayerNorm(d)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(F.relu(h)), h, self.ln(x)


def placements_case(world):
    """Each output a DTensor in its planned layout, its gradient taken back through DTensor:
    ``full_tensor()`` of each, then a loss on the whole tensors, against one device."""
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    model, x = ThreeWays(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    ln = _node_of(model, (x,), (world,), "ln")
    pin = {"fc1.weight": ("S(0)",), "fc1.bias": ("S(0)",), "fc2.weight": ("S(1)",), "x": ("B",), ln: ("B",)}
    pm = autoshard.parallelize(model, (x,), pin=pin, outputs="dtensor")
    outs, ref_outs = pm(x), ref(x)
    result = {"placements": [tuple(map(str, o.placements)) if isinstance(o, DTensor) else None for o in outs]}
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g) for o in ref_outs]
    sum((o.full_tensor() * w).sum() for o, w in zip(outs, weights)).backward()
    sum((o * w).sum() for o, w in zip(ref_outs, weights)).backward()
    # relative to the largest magnitude above 1 (cases.rel_err): fc1's gradients reach 10, where
    # 2e-6 absolute is two units in the last place
    result["outs"] = max(rel_err(o.full_tensor(), r) for o, r in zip(outs, ref_outs))
    ref_params = dict(ref.named_parameters())
    result["grads"] = {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()}
    return result


def partial_loss_case():
    """A loss computed inside the model, left partial by a row-parallel layer: ``backward()`` on
    the DTensor itself."""
    torch.manual_seed(0)
    model, x, y = TwoLayer(16, 32), torch.randn(8, 16), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    pin = {"fc1.weight": ("S(0)",), "fc1.bias": ("S(0)",), "fc2.weight": ("S(1)",)}
    pm = autoshard.parallelize(model, (x, y), pin=pin, outputs="dtensor")
    loss, ref_loss = pm(x, y), ref(x, y)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    return {"placements": tuple(map(str, loss.placements)), "loss": (loss.full_tensor() - ref_loss).abs().item(),
            "grads": max(((p.grad.full_tensor() - ref_params[n].grad).abs().max() / ref_params[n].grad.abs().max()).item()
                         for n, p in pm.named_parameters())}


def arriving_loss_case():
    """A data-parallel loss made whole (the default outputs): returned while its all-reduce runs,
    backward taken without waiting for it, and every read of it the whole loss."""
    from autoshard.runtime import Arriving
    torch.manual_seed(0)
    model, x, y = TwoLayer(16, 32), torch.randn(8, 16), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, (x, y), pin={"x": ("S(0)",), "y": ("S(0)",)})
    loss, ref_loss = pm(x, y), ref(x, y)
    out = {"type": type(loss).__name__, "arriving": isinstance(loss, Arriving), "shape": tuple(loss.shape),
           "grad_fn": loss.grad_fn is not None}
    loss.backward()
    ref_loss.backward()
    out["pending after backward"] = loss.pending
    want = ref_loss.item()
    buf = io.BytesIO()
    torch.save(loss, buf)
    buf.seek(0)
    reads = {"item": loss.item(), "float": float(loss), "tolist": loss.tolist(), "detach": loss.detach().item(),
             "times 2": (loss * 2).item() / 2, "saved": torch.load(buf).item(), "format": float(f"{loss:.9f}"),
             "stack": torch.stack([loss, loss * 3]).sum().item() / 4}   # a list of tensors in one op
    out["repr"] = abs(float(repr(loss)[len("tensor("):-1]) - want)   # printed to 4 decimals
    out["pending after reads"] = loss.pending
    out["reads"] = {k: abs(v - want) / abs(want) for k, v in reads.items()}
    ref_params = dict(ref.named_parameters())
    out["grads"] = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    # and a second step, its loss read before backward: the same values either way
    pm.zero_grad()
    ref.zero_grad()
    loss, ref_loss = pm(x, y), ref(x, y)
    out["read first"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    out["grads read first"] = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    return out


@pytest.fixture(scope="module")
def at2(world2):
    return {"(2,)": world2.run(loss_parallel_case, (2,)), "partial loss": world2.run(partial_loss_case),
            "arriving": world2.run(arriving_loss_case)}


def test_a_whole_loss_arrives_while_backward_runs_and_reads_whole(at2):
    """The all-reduce of a data-parallel loss is not waited for at the end of forward (a barrier
    DDP's step does not have); backward runs from it, and every read gets the whole loss."""
    for r in at2["arriving"]:
        assert r["arriving"] and r["type"] == "Arriving" and r["shape"] == () and r["grad_fn"], r
        assert r["pending after backward"] and not r["pending after reads"], r
        assert max(r["reads"].values()) < 1e-6 and r["repr"] < 1e-4, r
        assert r["grads"] < 1e-5 and r["grads read first"] < 1e-5 and r["read first"] < 1e-6, r


@pytest.fixture(scope="module")
def at4(world4):
    return {"(4,)": world4.run(loss_parallel_case, (4,), True),
            "(2, 2)": world4.run(loss_parallel_case, (2, 2)),
            "placements": world4.run(placements_case, 4)}


def _check_loss_parallel(results, mesh):
    for rank, r in enumerate(results):
        assert r["dtensor"] and r["mesh"], rank
        assert r["vocab_split"], r["placements"]
        local = list(r["shape"])
        local[2] //= mesh[-1]
        if len(mesh) == 2:
            local[0] //= mesh[0]
        assert r["local"] == tuple(local)
        assert r["loss"] < 1e-5, (rank, r["loss"])
        assert r["grads"] and max(r["grads"].values()) < 1e-5, (rank, r["grads"])
        assert r["gathered"] == []   # nothing converted for the output
        assert "to_dtensor" in r["program"] and "to_whole" not in r["program"]


def test_loss_parallel_on_split_logits_world2(at2):
    _check_loss_parallel(at2["(2,)"], (2,))


def test_a_partial_loss_takes_backward_as_a_dtensor(at2):
    for r in at2["partial loss"]:
        assert r["placements"] == ("P(sum)",)
        assert r["loss"] < 1e-6 and r["grads"] < 1e-5, r


def test_loss_parallel_on_split_logits_world4_from_json(at4):
    _check_loss_parallel(at4["(4,)"], (4,))


def test_loss_parallel_batch_and_vocab_split_on_2x2(at4):
    _check_loss_parallel(at4["(2, 2)"], (2, 2))


def test_split_partial_and_broadcast_outputs_take_their_gradients_back(at4):
    for r in at4["placements"]:
        assert r["placements"] == [("P(sum)",), ("S(1)",), ("R",)]   # DTensor's short names
        assert r["outs"] < 2e-6
        assert max(r["grads"].values()) < 2e-6, r["grads"]


# ---- pricing: the gather of an output only where whole outputs are asked for --------------------

def test_plan_prices_the_output_gather_only_for_whole_outputs():
    model, idx, _ = _gpt()
    pin = vocab_pins(model, idx, (4,))
    whole = autoshard.plan(model, (idx,), mesh=(4,), pin=pin, verbose=False)
    kept = autoshard.plan(model, (idx,), mesh=(4,), pin=pin, outputs="dtensor", verbose=False)
    assert whole.schedule["outputs"] == "whole" and kept.schedule["outputs"] == "dtensor"
    gathers = [c for c in whole.collectives if c.node == "output"]
    assert [(c.kind, c.phase) for c in gathers] == [("all_gather", "forward")]
    assert gathers[0].bytes == BATCH * SEQ * VOCAB // 4 * 4   # this rank's share of the float32 logits
    assert [c for c in kept.collectives if c.node == "output"] == []
    # the same layouts everywhere: the plans differ by the gather alone
    assert {n: c.outputs for n, c in whole.nodes.items()} == {n: c.outputs for n, c in kept.nodes.items()}
    assert math.isclose(whole.cost - kept.cost, gathers[0].seconds, rel_tol=1e-6)


def test_dtensor_outputs_let_the_planner_leave_logits_split():
    # unpinned, on the meta device: whole outputs gather the logits, kept ones need not
    with torch.device("meta"):
        model = GPT(vocab=4096, d=64, heads=4, layers=2, seq=128)
    model.head.weight = nn.Parameter(torch.empty(4096, 64, device="meta"))
    idx = torch.empty(8, 128, dtype=torch.long, device="meta")
    whole = autoshard.plan(model, (idx,), mesh=(8,), verbose=False)
    kept = autoshard.plan(model, (idx,), mesh=(8,), outputs="dtensor", verbose=False)
    assert kept.cost < whole.cost
    assert [c for c in kept.collectives if c.node == "output"] == []


def test_bad_outputs_say_what_to_pass():
    model, idx, _ = _gpt()
    with pytest.raises(ValueError, match="outputs is 'whole'.*or 'dtensor'"):
        autoshard.plan(model, (idx,), mesh=(2,), outputs="split")
    plan = autoshard.plan(model, (idx,), mesh=(2,), verbose=False)
    with pytest.raises(ValueError, match="plan was made for outputs='whole'"):
        autoshard.parallelize(model, (idx,), plan=plan, outputs="dtensor")


def test_command_line_plans_for_outputs_kept(tmp_path):
    from autoshard import cli
    factory = tmp_path / "outputs_factory.py"
    factory.write_text("import torch\nfrom models import GPT\n\n\ndef build():\n"
                       "    return GPT(vocab=4096, d=64, heads=4, layers=2, seq=128), (torch.zeros(8, 128, dtype=torch.long),)\n")
    js = tmp_path / "plan.json"
    assert cli.main(["plan", f"{factory}:build", "--mesh", "8", "--outputs", "dtensor", "--json", str(js), "--quiet"],
                    out=io.StringIO()) == 0
    plan = Plan.from_json(js.read_text())
    assert plan.schedule["outputs"] == "dtensor" and [c for c in plan.collectives if c.node == "output"] == []


def test_no_step_along_an_axis_of_one_device():
    """A conversion along a mesh axis of one device changes nothing and runs nothing (a
    pipeline's stage of one rank, mesh (k, 1), took an all-reduce of one rank per microbatch)."""
    from autoshard import placement as pl
    from autoshard.runtime.edges import _plan
    assert _plan((4, 8), (pl.P,), (pl.B,), (1,), (0,), None) == []
    assert [step[0] for step in _plan((4, 8), (pl.P,), (pl.B,), (2,), (0,), None)] == ["all_reduce"]
    assert {step[1] for step in _plan((4, 8), (pl.P, pl.P), (pl.B, pl.B), (1, 2), (0, 0), None)} == {1}
