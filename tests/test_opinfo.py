"""Every SBP rule signature checked on PyTorch's OpInfo sample inputs (issue 4), on p=2 and p=4
ranks simulated in one process by ``autoshard.check.opinfo``."""
from __future__ import annotations

import functools

import pytest
import torch

from autoshard.check import opinfo
from autoshard.check.validate import op_name, validate

pytestmark = pytest.mark.long("every rule signature checked on OpInfo's sample inputs: 12 s on 2 cores")

aten = torch.ops.aten
WORLDS = (2, 4)
# observed (torch 2.13, 16 cases per op): 144 ops covered; 2519 signatures checked at p=2 (1302
# besides all-B), 2068 at p=4 (851 besides all-B); floors ~80% so coverage cannot quietly collapse
OPS_FLOOR = 115
CHECKED_FLOOR = {2: 2000, 4: 1650}
NONTRIVIAL_FLOOR = {2: 1040, 4: 680}



@functools.cache
def collection():
    return opinfo.collect()


@functools.cache
def report(p):
    return validate(collection().cases, p=p)


@pytest.mark.parametrize("p", WORLDS)
def test_every_signature_is_numerically_right(p):
    fails = report(p).failures
    assert not fails, f"p={p}: wrong signatures on OpInfo samples:\n" + "\n".join(
        f"  {op} {sig}: {msg[:400]}" for op, sig, msg in fails)


@pytest.mark.parametrize("p", WORLDS)
def test_coverage_floor(p):
    rep = report(p)
    text = opinfo.format_report(collection(), rep)
    assert len(rep.ops_covered) >= OPS_FLOOR, text
    assert rep.checked >= CHECKED_FLOOR[p], text
    assert rep.checked_nontrivial >= NONTRIVIAL_FLOOR[p], text
    assert not rep.no_rule  # cases come only from overloads with a rule


def test_every_source_gives_cases():
    col = collection()
    assert all(col.sources[s] > 0 for s in ("direct", "adapted", "dispatched")), col.sources
    names = {op_name(c[0]) for c in col.cases}
    # composite ops reached directly, ops reached only through dispatch, and adapted calls
    assert {"linear.default", "matmul.default", "softmax.int", "reshape.default"} <= names
    assert {"_softmax.default", "_unsafe_view.default", "_to_copy.default", "embedding.default"} <= names
    assert {"where.self", "einsum.default", "cross_entropy_loss.default", "broadcast_tensors.default"} <= names
    per_op = {}
    for c in col.cases:
        per_op[c[0]] = per_op.get(c[0], 0) + 1
    assert max(per_op.values()) <= opinfo.MAX_PER_OP
    assert not any(op_name(c[0]).split(".")[0] in opinfo.UNCOMPARABLE for c in col.cases)
    assert not torch.backends.flags_frozen()  # importing op_db freezes them; collect undoes it


def test_a_tensor_binds_only_to_a_tensor_parameter():
    x = torch.randn(5, 5)
    # the binding layer would read tensor(3) as indices=[3]; that call is tensor_split.tensor_indices_or_sections
    assert not opinfo._binds(aten.tensor_split.indices, (x, torch.tensor([3])), {})
    assert opinfo._binds(aten.tensor_split.indices, (x, [3]), {})
    assert not opinfo._binds(aten.add.Scalar, (x, torch.tensor(2.0)), {})
    assert opinfo._binds(aten.add.Tensor, (x, x), {"alpha": 2})
    assert not opinfo._binds(aten.add.Tensor, (x, x), {"beta": 2})


def test_adapters_rewrite_to_the_aten_call():
    x, y, cond = torch.randn(4, 4), torch.randn(4, 4), torch.rand(4, 4) > 0.5
    op, args, kwargs = opinfo.ADAPTERS["where"](x, cond, y)
    assert op == aten.where.self and torch.equal(op(*args, **kwargs), torch.where(cond, x, y))
    op, args, _ = opinfo.ADAPTERS["nn.functional.huber_loss"](x, y, reduction="sum", delta=0.5)
    assert op == aten.huber_loss.default and args[2:] == (2, 0.5)
    assert opinfo.ADAPTERS["nn.functional.mse_loss"](x, y, reduction="bogus") is None


def test_command_line(capsys, monkeypatch):
    monkeypatch.setattr(opinfo, "collect", lambda *a, **k: collection())
    monkeypatch.setattr(opinfo, "validate", lambda cases, p, seed: report(p))
    assert opinfo.main(["-p", "2"]) == (0 if report(2).ok else 1)
    out = capsys.readouterr().out
    for line in ("ops with a rule:", "ops with samples:", "signatures checked:", "not applicable:",
                 "failures:", "rule ops with no OpInfo sample"):
        assert line in out, out
