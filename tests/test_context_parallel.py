"""Context parallelism: causal attention with the queries split along the sequence and the keys
and values either gathered whole, each rank's causal mask offset by its first query (Llama 3's
form), or passed round the ring and merged by log-sum-exp (rules.nn.sdpa,
passes.rewrite.lower_sdpa, runtime.ring_attention); ``schemes.context_parallel`` pins either. A
causal GQA decoder with rotary embeddings trains as one device does, in real gloo groups: fp32
exact, with the blocks recomputed, and under a bf16 policy within bf16's bound."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import schemes
from autoshard.passes.capture import capture
from cases import rel_err, run_each
from models import RopeLlama
from test_precision import BF16, POLICY, _err, _noise, bf16_tol


class GqaAttention(nn.Module):
    """Llama attention with grouped key/value heads and complex rotary embeddings."""

    def __init__(self, d=32, heads=4, kv_heads=2, seq=16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.norm = nn.RMSNorm(d)
        self.wq, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wk, self.wv = (nn.Linear(d, kv_heads * self.head_dim, bias=False) for _ in range(2))
        freqs = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def rope(self, z):
        zc = torch.view_as_complex(z.float().reshape(*z.shape[:-1], -1, 2))
        return torch.view_as_real(zc * self.freqs_cis.view(1, z.shape[1], 1, -1)).flatten(3).type_as(z)

    def forward(self, x, mask=None, causal=True, dropout=0.0):
        b, t, d = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim)
        k, v = (w(h).view(b, t, self.kv_heads, self.head_dim) for w in (self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=causal, dropout_p=dropout, enable_gqa=True)
        return x + self.wo(y.transpose(1, 2).reshape(b, t, -1))   # -1: tensor parallel holds a part of d

class GqaLlama(RopeLlama):
    """tests/models.py's Llama-style decoder (RMSNorm, SwiGLU, the loss) with GQA attention."""

    def __init__(self, vocab=64, d=32, heads=4, kv_heads=2, seq=16, layers=2, hidden=64):
        super().__init__(vocab, d, heads, seq, layers, hidden)
        self.attn = nn.ModuleList(GqaAttention(d, heads, kv_heads, seq) for _ in range(layers))


def _model(seq=16, batch=2, device=None):
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = GqaLlama(seq=seq)
    idx = torch.randint(0, 64, (batch, seq), device=device)
    return model, (idx, torch.randint(0, 64, (batch, seq), device=device))


def _attention_nodes(model, inputs) -> list:
    return [n.name for n in capture(model, inputs).nodes
            if n.kind == "op" and n.target == torch.ops.aten.scaled_dot_product_attention.default]


# (mesh, the attention's output placement): split on the sequence (dim 2 of (batch, heads, seq,
# head_dim)) on the context axis; on (2, 2) the batch on the data axis too, or the sequence over
# both axes (each rank's first query found axis by axis)
CASES = [((2,), ("S(2)",)), ((4,), ("S(2)",)), ((2, 2), ("S(0)", "S(2)")), ((2, 2), ("S(2)", "S(2)"))]


def train_case(mesh, pin):
    """``pin``: the attention nodes' output placement, or a dict of pins."""
    model, inputs = _model()
    ref = copy.deepcopy(model)
    nodes = _attention_nodes(model, inputs)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=pin if isinstance(pin, dict) else {n: pin for n in nodes})
    loss, ref_loss = pm(*inputs), ref(*inputs)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    return {"loss": rel_err(loss, ref_loss),
            "grads": {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
            "attention": [(pm.plan.nodes[n].inputs, pm.plan.nodes[n].outputs) for n in nodes],
            "program": pm.program}


def _assert_exact(res, pin):
    assert "error" not in res, res.get("error")
    assert res["loss"] <= 1e-5, res["loss"]
    assert len(res["grads"]) == 21   # every parameter
    for n, e in res["grads"].items():
        assert e <= 1e-5, (n, e)
    kv = tuple("B" if p == "S(2)" else p for p in pin)   # keys and values gathered whole
    assert res["attention"] == [([pin, kv, kv], [pin])] * 2
    # the mask offset alone: on so small a model balancing's swaps cost more than they save
    assert res["program"].count(OFFSET) == 2


def test_world2_sequence_split_matches_single_device(world2):
    for res in world2.run(run_each, train_case, CASES[:1]):
        _assert_exact(res[0], CASES[0][1])


def test_world4_sequence_split_matches_single_device(world4):
    for per_rank in world4.run(run_each, train_case, CASES[1:]):
        for res, (_, pin) in zip(per_rank, CASES[1:]):
            _assert_exact(res, pin)


def test_planner_splits_a_long_sequence_on_its_own():
    """Batch 1, two key/value heads, a long sequence on 8 devices, on the meta device: the planner
    splits attention's queries along the sequence, keys and values gathered or passed round the
    ring (offered the ring, it chooses it here: mesh (8,), the keys' blocks sent while the blocks
    before them are computed)."""
    model, inputs = _model(seq=32768, batch=1, device="meta")
    plan = autoshard.plan(model, inputs, world=8, verbose=False)
    for n in _attention_nodes(model, inputs):
        (q, k, v), (out,) = plan.nodes[n].inputs, plan.nodes[n].outputs
        context = [a for a, p in enumerate(q) if p == "S(2)"]
        assert context and all(k[a] == v[a] in ("B", "S(2)") and out[a] == "S(2)" for a in context), plan.nodes[n]
    # and balances its causal work: the compute it saves the last rank outweighs the swaps
    assert plan.schedule["balanced_attention"] == _attention_nodes(model, inputs)


# ---- the scheme, both forms ---------------------------------------------------------------------

RING = "autoshard_runtime_ring_attention("
GATHERED = "autoshard_runtime_balanced_attention("   # causal work balanced
OFFSET = "autoshard_runtime_causal_attention("       # the mask offset alone


def _planned(model, inputs, mesh, pins, balance, **kw):
    """The plan of the pins, its attention balanced or not whatever the cost model says
    (``plan.schedule["balanced_attention"]``: on so small a model the swaps cost more than they save)."""
    plan = autoshard.plan(model, inputs, mesh=mesh, pin=pins, verbose=False, **kw)
    return dataclasses.replace(plan, schedule={**plan.schedule, "balanced_attention":
                                               _attention_nodes(model, inputs) if balance else []})


def scheme_case(mesh, form, fsdp=False, recompute="none", balance=True):
    """``schemes.context_parallel`` on the last axis (the first, if any, data parallel) in ``form``,
    causal work balanced or not, fp32, against one device."""
    model, inputs = _model()
    ref = copy.deepcopy(model)
    pins = schemes.context_parallel(model, inputs, mesh, form=form, fsdp=fsdp)
    pm = autoshard.parallelize(model, inputs, plan=_planned(model, inputs, mesh, pins, balance, recompute=recompute))
    loss, ref_loss = pm(*inputs), ref(*inputs)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    nodes = _attention_nodes(model, inputs)
    return {"loss": rel_err(loss, ref_loss),
            "grads": {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
            "attention": [(pm.plan.nodes[n].inputs, pm.plan.nodes[n].outputs) for n in nodes],
            "sharded": sum(any(q.is_shard() for q in p.placements) for p in pm.parameters()),
            "recomputed": len(pm.plan.recompute.get("blocks", [])), "regions": pm.program.count("self.recompute_"),
            "balanced": len(pm.plan.schedule["balanced_attention"]), "program": pm.program}


def bf16_case(mesh, form):
    """The scheme under MixedPrecisionPolicy(bf16, reduce fp32) against one device computing in
    bf16 from its fp32 parameters (the policy's semantics), within bf16's bound."""
    model, inputs = _model()
    ref, fp32 = copy.deepcopy(model), copy.deepcopy(model)
    fp32_loss = fp32(*inputs)
    fp32_loss.backward()
    pins = schemes.context_parallel(model, inputs, mesh, form=form)
    pm = autoshard.parallelize(model, inputs, plan=_planned(model, inputs, mesh, pins, True, mp_policy=POLICY))
    loss = pm(*inputs)
    loss.backward()
    copies = {n: p.to(BF16) for n, p in ref.named_parameters()}
    ref_loss = torch.func.functional_call(ref, copies, inputs, tie_weights=True)
    ref_loss.backward()
    refp = dict(ref.named_parameters())
    return {"loss": _err(loss, ref_loss), "noise": _noise(ref_loss, ref, fp32_loss, fp32),
            "grads": {n: _err(p.grad.full_tensor(), refp[n].grad) for n, p in pm.named_parameters()},
            "program": pm.program}


def _exact(res, form, mesh, n_attention=2):
    assert "error" not in res, res.get("error")
    assert res["loss"] <= 1e-5, res["loss"]
    assert len(res["grads"]) == 21
    bad = {n: e for n, e in res["grads"].items() if e > 1e-5}
    assert not bad, bad
    out = ("S(0)",) * (len(mesh) - 1) + ("S(2)",)
    kv = out if form == "ring" else out[:-1] + ("B",)
    assert res["attention"] == [([out, kv, kv], [out])] * n_attention
    if not res.get("recomputed"):   # a recomputed block's calls are in its own module, not in the program's text
        assert res["program"].count(RING if form == "ring" else
                                    GATHERED if res["balanced"] else OFFSET) == n_attention


# (mesh, form, fsdp, recompute, balanced)
SCHEME_2 = [((2,), "allgather", False, "none", True), ((2,), "ring", False, "none", True),
            ((2,), "allgather", False, "none", False), ((2,), "ring", False, "none", False)]
# (2, 2): data x context, parameters stored split over both (FSDP) in two cases, the blocks recomputed in two
# (the ring unbalanced at world 4 in the last; world 2 runs every form both ways)
SCHEME_4 = [((4,), "allgather", False, "none", True), ((4,), "ring", False, "none", True),
            ((2, 2), "allgather", True, "none", True), ((2, 2), "ring", True, "none", True),
            ((2, 2), "allgather", False, "blocks", True), ((2, 2), "ring", False, "blocks", False)]


@pytest.fixture(scope="module")
def scheme4(world4):
    return world4.run(run_each, scheme_case, SCHEME_4)


def test_scheme_world2_both_forms_exact(world2):
    for per_rank in world2.run(run_each, scheme_case, SCHEME_2):
        for res, (mesh, form, _, _, balance) in zip(per_rank, SCHEME_2):
            _exact(res, form, mesh)
            assert res["balanced"] == 2 * balance


@pytest.mark.parametrize("i", range(len(SCHEME_4)),
                         ids=[f"{m}-{f}-fsdp{s}-{r}-balanced{b}" for m, f, s, r, b in SCHEME_4])
def test_scheme_world4_exact(scheme4, i):
    mesh, form, fsdp, recompute, balance = SCHEME_4[i]
    for per_rank in scheme4:
        res = per_rank[i]
        _exact(res, form, mesh)
        assert (res["sharded"] > 0) == fsdp, res["sharded"]
        assert (res["recomputed"] > 0) == (res["regions"] > 0) == (recompute == "blocks"), res["recomputed"]
        assert res["balanced"] == 2 * balance


def test_ring_over_two_axes_exact(world4):
    """The sequence split over both axes of (2, 2), the keys passed round both (the ring's
    odometer: the inner axis a full round for each step of the outer)."""
    ring = "(S(2), S(2)), (S(2), S(2)), (S(2), S(2)) -> (S(2), S(2))"
    model, inputs = _model()
    pins = {n: ring for n in _attention_nodes(model, inputs)}
    for res in world4.run(train_case, (2, 2), pins):
        assert res["loss"] <= 1e-5 and max(res["grads"].values()) <= 1e-5, res
        assert res["program"].count(RING) == 2


def test_scheme_bf16_policy(world4):
    cases = [((2, 2), "allgather"), ((2, 2), "ring")]
    for per_rank in world4.run(run_each, bf16_case, cases):
        for res in per_rank:
            assert "error" not in res, res.get("error")
            assert res["loss"] <= bf16_tol(res), (res["loss"], res["noise"])
            bad = {n: e for n, e in res["grads"].items() if e > bf16_tol(res)}
            assert not bad, (bad, res["noise"])
            assert "torch.bfloat16" in res["program"]


def test_scheme_errors():
    model, inputs = _model()
    with pytest.raises(ValueError, match="form is one of"):
        schemes.context_parallel(model, inputs, (2,), form="zigzag")
    with pytest.raises(ValueError, match="not an axis"):
        schemes.context_parallel(model, inputs, (2,), axis=1)
    with pytest.raises(ValueError, match="cannot be split on dim 1"):
        schemes.context_parallel(model, inputs, (3,))


def test_explain_says_which_form_and_why():
    """``explain`` on an attention node names its form of context parallelism and prices the others
    (each as the plan with only that node changed), with the pin that forces each; ``formula``
    gives the plan's step."""
    model, inputs = _model(seq=32768, batch=1, device="meta")
    plan = autoshard.plan(model, inputs, mesh=(8,), verbose=False)
    node = _attention_nodes(model, inputs)[0]
    text = plan.explain(node)
    assert plan.nodes[node].inputs == [("S(2)",)] * 3, text   # the ring's sends hide behind its blocks here
    assert "attention: the keys and values passed round the ring" in text, text
    gathered = next(line for line in text.splitlines() if "(Llama 3's all-gather form): +" in line)
    assert "communication +" in gathered and "memory +" in gathered
    assert "'(S(2)), (B), (B) -> (S(2))'" in gathered
    assert "no split of the sequence: +" in text
    assert "causal work balanced: each rank swaps half its queries" in text
    # the plan's formula prices the ring and the balancing as the solver did
    expr, values = plan.formula()
    assert abs(float(expr.subs(values)) - plan.cost) <= 1e-9 * plan.cost
