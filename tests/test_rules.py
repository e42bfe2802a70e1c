"""Every SBP rule signature checked numerically (DESIGN.md section 7), on p=2 and p=4 ranks
simulated in one process by ``autoshard.check.validate``, plus literal rule outputs."""
from __future__ import annotations

import functools

import pytest
import torch

from autoshard.passes import rewrite
from autoshard.placement import B, P, S
from autoshard.rules import Sig
from autoshard.check.validate import (check_signature, default_cases, main, op_name, signatures,
                                      uncovered_families, validate)

aten = torch.ops.aten
WORLDS = (2, 4)
# observed with the built-in cases: 835 at p=2, 816 at p=4 (all-B included); floors ~80%
FLOOR = {2: 670, 4: 650}


@functools.lru_cache(maxsize=None)
def report(p):
    return validate(default_cases(), p=p)


CASE_OPS = sorted({op_name(c[0]) for c in default_cases()})


@pytest.mark.parametrize("op", CASE_OPS)
@pytest.mark.parametrize("p", WORLDS)
def test_every_signature_is_numerically_right(p, op):
    fails = [f for f in report(p).failures if f[0] == op]
    assert not fails, f"p={p}: wrong signatures for {op}:\n" + "\n".join(f"  {s}: {m}" for _, s, m in fails)


@pytest.mark.parametrize("p", WORLDS)
def test_report_totals(p):
    rep = report(p)
    assert rep.checked >= FLOOR[p], rep.format()
    assert rep.checked_nontrivial >= FLOOR[p] * 3 // 4
    assert len(rep.ops_covered) >= 85
    assert not rep.no_rule, f"cases for ops without a rule: {rep.no_rule}"
    assert uncovered_families(rep.ops_seen) == [], "every rule function needs a case"
    assert {op for op, _, _ in rep.skipped} == {"dropout.default", "cross_entropy_loss.default", "batch_norm.default",
                                                  "_grouped_mm.default", "index.Tensor",
                                                  "scaled_dot_product_attention.default"}   # ring attention
    assert rep.not_applicable > 0  # the divisibility filter is exercised


def test_report_counts_ops_without_rule():
    rep = validate([(aten.cumprod.default, (torch.randn(4, 4), 0), {})], p=2)
    assert rep.no_rule == {"cumprod.default"} and rep.checked == 0 and rep.ok


def test_command_line(capsys):
    assert main(["-p", "2"]) == (0 if report(2).ok else 1)
    out = capsys.readouterr().out
    assert "signatures checked" in out and "p=2" in out


# ---- literal rule outputs -------------------------------------------------------------------------

def sigs(op, *args, **kwargs):
    return [repr(s) for s in signatures(op, args, kwargs)]


def test_linear_signatures():
    got = sigs(aten.linear.default, torch.randn(8, 16), torch.randn(32, 16), torch.randn(32))
    for want in ("(S(0), B, B) -> S(0)", "(B, S(0), S(0)) -> S(1)", "(S(1), S(1), P) -> P",
                 "(P, B, P) -> P", "(B, P, P) -> P"):
        assert want in got, got
    got = sigs(aten.linear.default, torch.randn(4, 8, 16), torch.randn(32, 16))
    assert {"(S(0), B) -> S(0)", "(S(1), B) -> S(1)", "(B, S(0)) -> S(2)", "(S(2), S(1)) -> P"} <= set(got)


def test_mm_signatures_are_the_design_example():
    got = sigs(aten.mm.default, torch.randn(8, 12), torch.randn(12, 16))
    assert set(got) == {"(S(0), B) -> S(0)", "(B, S(1)) -> S(1)", "(S(1), S(0)) -> P",
                        "(P, B) -> P", "(B, P) -> P"}


def test_attention_splits_queries_on_the_sequence_keys_whole():
    q = torch.randn(2, 4, 8, 16)
    assert "(S(2), B, B) -> S(2)" in sigs(aten.scaled_dot_product_attention.default, q, q, q)
    # causal too: the lowering offsets the mask by the rank's first query (rewrite.lower_sdpa)
    causal = sigs(aten.scaled_dot_product_attention.default, q, q, q, is_causal=True)
    assert causal == ["(S(0), S(0), S(0)) -> S(0)", "(S(1), S(1), S(1)) -> S(1)", "(S(2), B, B) -> S(2)",
                      "(S(2), S(2), S(2)) -> S(2)"]   # and ring attention (runtime.ring_attention)
    # dropout draws the whole op's mask on every rank and keeps its part (runtime.attention_dropout):
    # every layout but the ring
    assert sigs(aten.scaled_dot_product_attention.default, q, q, q, None, 0.1, True) == causal[:-1]
    masked = sigs(aten.scaled_dot_product_attention.default, q, q, q, torch.randn(8, 8))
    assert "(S(1), S(1), S(1), B) -> S(1)" in masked and "(S(2), B, B, S(0)) -> S(2)" in masked
    # the ring with a mask: its rows split with the queries, its columns whole
    assert "(S(2), S(2), S(2), S(0)) -> S(2)" in masked
    assert "(S(2), S(2), S(2), B) -> S(2)" in sigs(aten.scaled_dot_product_attention.default, q, q, q,
                                                   torch.randn(2, 1, 1, 8))


def test_losses_and_reductions():
    x, t = torch.randn(8, 12), torch.randint(0, 12, (8,))
    assert sigs(aten.cross_entropy_loss.default, x, t, None, 0, -100, 0.0) == ["(S(0), S(0)) -> S(0)"]
    assert sigs(aten.cross_entropy_loss.default, x, t, None, 2, -100, 0.0) == ["(S(0), S(0)) -> P"]
    assert sigs(aten.mean.dim, torch.randn(4, 8, 12), [1]) == [
        "(S(0)) -> S(0)", "(S(1)) -> P", "(S(2)) -> S(1)", "(P) -> P"]
    assert "(S(2)) -> S(2)" in sigs(aten.sum.dim_IntList, torch.randn(4, 8, 12), [1], True)  # keepdim


def test_pointwise_partial_only_where_linear():
    x = torch.randn(8, 12)
    assert "(P, P) -> P" in sigs(aten.add.Tensor, x, x)
    assert not any("P" in s for s in sigs(aten.add.Tensor, x, 2.0))  # a scalar would count p times
    assert "(P, B) -> P" in sigs(aten.div.Tensor, x, x) and "(B, P) -> P" not in sigs(aten.div.Tensor, x, x)
    assert not any("P" in s for s in sigs(aten.relu.default, x))
    assert sigs(aten.softmax.int, torch.randn(4, 8, 12), -1) == ["(S(0)) -> S(0)", "(S(1)) -> S(1)"]
    assert sigs(aten.zeros.default, [4, 8]) == []


def test_views_move_splits_with_their_dims():
    assert sigs(aten.view.default, torch.randn(4, 8, 12), [32, 12]) == ["(S(0)) -> S(0)", "(S(2)) -> S(1)", "(P) -> P"]
    assert sigs(aten.transpose.int, torch.randn(4, 8, 12), 1, 2) == [
        "(S(0)) -> S(0)", "(S(1)) -> S(2)", "(S(2)) -> S(1)", "(P) -> P"]
    assert sigs(aten.embedding.default, torch.randn(20, 16), torch.randint(0, 20, (4, 8))) == [
        "(B, S(0)) -> S(0)", "(B, S(1)) -> S(1)", "(S(1), B) -> S(2)", "(P, B) -> P"]


# ---- the validator is not vacuous -------------------------------------------------------------------

def check(op, args, sig, p=2, kwargs=None):
    return check_signature(op, tuple(args), dict(kwargs or {}), sig, p)[0]


def test_validator_rejects_wrong_signatures():
    x = torch.randn(8, 12, dtype=torch.float64)
    w, b = torch.randn(16, 12, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert check(aten.relu.default, [x], Sig((P,), (P,))) == "fail"                    # nonlinear
    assert check(aten.softmax.int, [x, -1], Sig((S(1),), (S(1),))) == "fail"           # softmax dim cut
    assert check(aten.linear.default, [x, w, b], Sig((S(1), S(1), B), (P,))) == "fail"  # bias p times
    assert check(aten.sum.dim_IntList, [x, [0]], Sig((S(0),), (S(0),))) == "fail"       # reduced dim
    assert check(aten.mm.default, [x, w.t()], Sig((S(0), S(0)), (S(0),))) == "fail"     # op raises
    assert check(aten.mm.default, [x, w.t()], Sig((S(0), B), (S(1),))) == "fail"        # wrong out dim
    q = torch.randn(2, 4, 8, 16, dtype=torch.float64)
    assert check(aten.scaled_dot_product_attention.default, [q, q, q], Sig((S(2), S(2), S(2)), (S(2),)),
                 kwargs={"is_causal": True}) == "skip"                                  # ring: needs ranks
    assert check(aten.scaled_dot_product_attention.default, [q, q, q], Sig((S(2), B, B), (S(2),)),
                 kwargs={"is_causal": True}) == "ok"                                    # mask offset
    assert check(aten.linear.default, [x, w, b], Sig((S(1), S(1), P), (P,))) == "ok"


def test_validator_not_applicable_and_skipped():
    x = torch.randn(6, 12, dtype=torch.float64)
    assert check(aten.relu.default, [x], Sig((S(0),), (S(0),)), p=4) == "n/a"     # 6 % 4
    assert check(aten.neg.default, [torch.arange(8)], Sig((P,), (P,))) == "n/a"   # P on an int
    assert check(aten.relu.default, [x], Sig((S(2),), (S(2),))) == "fail"         # no dim 2
    assert check(aten.relu.default, [x], Sig((S(0), B), (S(0),))) == "fail"       # arity
    assert check(aten.dropout.default, [x, 0.5, True], Sig((S(0),), (S(0),))) == "skip"
    ce = [x, torch.randint(0, 12, (6,)), None, 1, -100, 0.0]
    assert check(aten.cross_entropy_loss.default, ce, Sig((S(0), S(0)), (P,))) == "skip"
    assert check(aten.cross_entropy_loss.default, ce, Sig((B, B), (B,))) == "ok"


def test_validator_uses_the_rewriter_lowerings(monkeypatch):
    x = torch.randn(4, 8, 12, dtype=torch.float64)
    mean_p = Sig((S(1),), (P,))
    assert check(aten.mean.dim, [x, [1]], mean_p) == "ok"           # scaled by 1/p locally
    assert check(aten.view.default, [x, [32, 12]], Sig((S(0),), (S(0),))) == "ok"  # local size
    monkeypatch.delitem(rewrite.LOWERINGS, aten.mean.dim)
    monkeypatch.delitem(rewrite.LOWERINGS, aten.view.default)
    assert check(aten.mean.dim, [x, [1]], mean_p) == "fail"
    assert check(aten.view.default, [x, [32, 12]], Sig((S(0),), (S(0),))) == "fail"
