"""FlexAttention (issue 32): ``flex_attention`` with a BlockMask built inside forward, or passed in
as torchtitan passes its masks, captured; its rule (batch and heads split, each offered only
where the score and mask mods read the row and head index in a way a rank's own index is right
for), checked by the validator against the real op; priced; and a small model exact against one
device in a gloo group of 2 under the solver's plan, one that splits the batch and one that splits
the heads.

On a CPU torch runs FlexAttention forward only ("FlexAttention does not support backward on
CPU"), so the models here run in inference: parameters that need no gradient, planned with
``training=False``. Backward (on CUDA) is not exercised here."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import autoshard
from autoshard.check.cases import flex_case, flex_cases
from autoshard.check.validate import check_signature, signatures, validate
from autoshard.cost.compute import work
from autoshard.passes.annotate import UnknownOpWarning, annotate
from autoshard.passes.capture import CaptureError, capture
from autoshard.placement import B, Split
from autoshard.cost.price import Costs
from autoshard.rules.flex import FLEX, density
from autoshard.rules.registry import Sig
from cases import by_case, rel_err, run_each

aten = torch.ops.aten
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 4, 256, 4, 2, 8
DIM = HEADS * HEAD_DIM
SLOW = autoshard.Cluster(name="slow-compute", peak_flops=2e9, peak_flops_fp32=1e9, memory_bandwidth=4e9)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attention(nn.Module):
    """torchtitan's attention with FlexAttention: grouped key/value heads, the mask made in forward
    on the input's device, causal or, given each token's document id, causal within documents."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, document_ids=None):
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.wk(x).view(bs, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.wv(x).view(bs, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
        if isinstance(document_ids, BlockMask):   # made outside and passed in, as torchtitan does
            mask = document_ids
        elif document_ids is None:
            mask = create_block_mask(causal, None, None, seq, seq, device=x.device.type)
        else:
            def document(b, h, q_idx, kv_idx):
                return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)
            mask = create_block_mask(document, bs, None, seq, seq, device=x.device.type)
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, DIM))


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 96)


def model_inputs(mask: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    if mask == "causal":
        return (x,)
    if mask == "given":   # a sliding window's BlockMask, passed in
        return x, create_block_mask(window, None, None, SEQ, SEQ, device="cpu")
    ends = torch.randint(1, SEQ, (BATCH, 3), generator=g).sort(1).values   # each row its own documents
    ids = (torch.arange(SEQ).view(1, SEQ, 1) >= ends.unsqueeze(1)).sum(-1)
    return x, ids


def inference_model():
    torch.manual_seed(0)
    return Attention().requires_grad_(False).eval()


# ---- capture --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask", ["causal", "document"])
def test_capture(mask):
    """The mask's making traced to aten ops (torch.vmap's calls gone), the flex node taking the
    block mask's tensors (and the document ids) after q, k and v, and every op with a rule."""
    graph = capture(inference_model(), model_inputs(mask))
    ops = [n for n in graph.nodes if n.kind == "op"]
    flex = [n for n in ops if n.target is FLEX]
    assert len(flex) == 1
    node = flex[0]
    assert [m.shape for m in node.outputs] == [(BATCH, HEADS, SEQ, HEAD_DIM), (BATCH, HEADS, SEQ), (BATCH, HEADS, SEQ)]
    rows = 1 if mask == "causal" else BATCH   # create_block_mask(causal, None, ...): one mask for every row
    blocks = [graph.meta(v).shape for v in node.inputs[3:11]]
    assert blocks[:2] == [(rows, 1, 2), (rows, 1, 2, 2)], blocks
    assert len(node.inputs) == 11 + (mask == "document")
    if mask == "document":
        assert node.inputs[11][0] == "document_ids"
    assert not [n for n in ops if "functorch" in str(getattr(n.target, "__module__", ""))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOpWarning)
        autoshard.plan(inference_model(), model_inputs(mask), world=2, training=False, verbose=False)


def test_capture_says_what_to_change():
    """A BlockMask handed in whose mod closes over a tensor (torch.export makes it a constant and
    then refuses it), and gradients on a CPU."""
    class Given(nn.Module):
        def forward(self, q, block_mask):
            return flex_attention(q, q, q, block_mask=block_mask)

    def document_mask(ids):
        return create_block_mask(lambda b, h, i, j: ids[b, i] == ids[b, j], 2, None, 128, 128, device="cpu")

    q = torch.randn(2, 2, 128, 8)
    with pytest.raises(CaptureError, match="inside forward"):
        capture(Given(), (q, document_mask(torch.arange(128).repeat(2, 1) // 50)))
    with pytest.raises(CaptureError, match=r"requires_grad_\(False\)"):
        capture(Attention(), model_inputs("causal"))


def test_a_block_mask_passed_in_is_captured():
    """Its tensors become inputs of the program (after x), its mod a subgraph the op calls."""
    graph = capture(inference_model(), model_inputs("given"))
    assert graph.user_inputs[0] == "x" and len(graph.user_inputs) == 1 + BLOCKS, graph.user_inputs
    node = next(n for n in graph.nodes if n.kind == "op" and n.target is FLEX)
    assert [v[0] for v in node.inputs[3:3 + BLOCKS]] == graph.user_inputs[1:]


# ---- the rule, literally, and against the real op -------------------------------------------------

CASES = flex_cases(lambda *s: torch.randn(s, dtype=torch.float64))
BLOCKS = 8   # the block mask's tensors: kv and q, partial and full, counts and indices
LITERAL = {   # the case's name -> the signatures offered
    "causal": ["(S(0), S(0), S(0), B, B, B, B, B, B, B, B) -> S(0), S(0), S(0)",
               "(S(1), S(1), S(1), B, B, B, B, B, B, B, B) -> S(1), S(1), S(1)"],
    # the document ids read at the row b: split with the rows; at no head
    "document": ["(S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0)) -> S(0), S(0), S(0)",
                 "(S(1), S(1), S(1), B, B, B, B, B, B, B, B, B) -> S(1), S(1), S(1)"],
    # grouped heads (4 queries, 2 keys) and a window per head, read at h
    "window": ["(S(0), S(0), S(0), B, B, B, B, B, B, B, B, B) -> S(0), S(0), S(0)",
               "(S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(0)) -> S(1), S(1), S(1)"],
    # a mask for every row and head, and an ALiBi score_mod whose slopes are read at h
    "alibi": ["(S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), B) -> S(0), S(0), S(0)",
              "(S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(0)) -> S(1), S(1), S(1)"],
}


@pytest.mark.parametrize("name", LITERAL)
def test_signatures(name):
    op, args, kwargs = CASES[list(LITERAL).index(name)]
    assert [repr(s) for s in signatures(op, args, kwargs)] == LITERAL[name]


def _qkv():
    return [torch.randn(2, 2, 128, 8, dtype=torch.float64) for _ in range(3)]


def test_a_mod_that_reads_the_index_otherwise_keeps_that_dim_whole():
    """A rank's b and h count its own rows and heads: a mod that computes with them (not only
    picks a buffer's entries by them) would see the wrong ones, so that split is not offered."""
    def every_other_row(b, h, i, j):
        return (i >= j) | (b % 2 == 1)

    def head_bias(score, b, h, i, j):
        return score - h * (i - j)

    op, args, kwargs = flex_case(*_qkv(), every_other_row, mask_b=2)
    assert [repr(s) for s in signatures(op, args, kwargs)] == [
        "(S(1), S(1), S(1), B, B, B, B, B, B, B, B) -> S(1), S(1), S(1)"]
    op, args, kwargs = flex_case(*_qkv(), causal, score_mod=head_bias)
    assert [repr(s) for s in signatures(op, args, kwargs)] == [
        "(S(0), S(0), S(0), B, B, B, B, B, B, B, B) -> S(0), S(0), S(0)"]
    # a buffer read at b and also otherwise: not split with the rows, so no batch split
    ids = torch.tensor([[0] * 64 + [1] * 64, [0] * 100 + [1] * 28])

    def mixed(b, h, i, j, d):
        return (i >= j) & (aten.index.Tensor(d, [b, i]) <= d.amax())
    op, args, kwargs = flex_case(*_qkv(), mixed, (ids,), mask_b=2)
    assert not [s for s in signatures(op, args, kwargs) if s.inputs[0] == Split(0)]


@pytest.mark.parametrize("p", (2, 4))
def test_validator_passes_every_signature(p):
    rep = validate(CASES, p=p)
    assert rep.ok, rep.format()
    # at p=4 the grouped case's 2 key heads do not split: its heads signature is not applicable
    assert rep.per_op["flex_attention"] == 12 - (p == 4), rep.per_op


def test_a_wrong_signature_fails_the_validator():
    """The document ids kept whole while the rows split, the slopes kept whole while the heads
    split: each rank reads the first rows' ids, the first heads' slopes."""
    op, args, kwargs = CASES[1]
    rows_only = Sig((Split(0),) * (3 + BLOCKS) + (B,), (Split(0),) * 3)
    assert check_signature(op, args, kwargs, rows_only, 2)[0] == "fail"
    op, args, kwargs = CASES[3]
    heads_only = Sig((Split(1),) * (3 + BLOCKS) + (B,), (Split(1),) * 3)
    assert check_signature(op, args, kwargs, heads_only, 2)[0] == "fail"


def test_priced_as_attention():
    """Counted dense, as scaled_dot_product_attention: two matmuls of (L, E) by (E, S) per head."""
    q, k = (BATCH, HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM)
    flops, _ = work(FLEX, [q, k, k], [q, q[:3], q[:3]], 4)
    assert flops == 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM
    assert flops == work(aten.scaled_dot_product_attention.default, [q, k, k], [q], 4)[0]


class Masked(nn.Module):
    """One flex call on given q, k, v under a mask made in forward from ``mod``."""

    def __init__(self, mod):
        super().__init__()
        self.mod = mod

    def forward(self, q, k, v):
        bs, heads, seq, _ = q.shape
        return flex_attention(q, k, v, block_mask=create_block_mask(self.mod, None, None, seq, seq, device="cpu"))


def flex_density(mod, seq: int) -> float:
    graph = capture(Masked(mod), tuple(torch.randn(1, 2, seq, 8) for _ in range(3)))
    return density(next(n.fx_node for n in graph.nodes if n.kind == "op" and n.target is FLEX))


def test_the_blocks_a_mask_keeps():
    """Of n x n blocks of 128, causal keeps n(n + 1)/2; a window of one block keeps the diagonal
    and the one below it; a mask that reads a buffer (the document ids) counts whole."""
    assert flex_density(causal, 256) == 3 / 4
    assert flex_density(causal, 1024) == 36 / 64
    assert flex_density(lambda b, h, i, j: (i >= j) & (i - j < 128), 1024) == 15 / 64
    assert flex_density(lambda b, h, i, j: i >= 0, 512) == 1.0
    graph = capture(inference_model(), model_inputs("document"))
    assert density(next(n.fx_node for n in graph.nodes if n.kind == "op" and n.target is FLEX)) == 1.0


def test_a_block_sparse_kernel_is_charged_the_blocks_kept():
    """On a cluster whose kernel skips the masked blocks (a GPU's) causal attention of 8 x 8
    blocks costs 36/64 of the dense op, forward and backward; on one that computes every score
    (a CPU's, as ``autoshard.measure`` marks it) all of it."""
    model = Masked(causal)
    inputs = tuple(torch.randn(1, 4, 1024, 64, requires_grad=True) for _ in range(3))
    graph = capture(model, inputs)
    node = next(n for n in graph.nodes if n.kind == "op" and n.target is FLEX)
    strat = annotate(graph, (1,))[node.name][0]
    prices = {sparse: Costs(graph, (1,), SLOW.with_(block_sparse=sparse), True).node(node, strat)
              for sparse in (True, False)}
    assert prices[True].compute_fwd == pytest.approx(36 / 64 * prices[False].compute_fwd, rel=1e-6)
    assert prices[True].compute_bwd == pytest.approx(36 / 64 * prices[False].compute_bwd, rel=1e-6)


# ---- exact against one device in a gloo group of 2 --------------------------------------------------

PLANS = {"solver": None, "batch": {"flex_attention": "S(0)"}, "heads": {"flex_attention": "S(1)"}}
MASKS = ("causal", "document", "given")


def eval_case(mask, pin, mesh=None):
    model = inference_model()
    ref = copy.deepcopy(model)
    inputs = model_inputs(mask)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, training=False, pin=pin, cluster=SLOW, verbose=False)
    with torch.no_grad():
        got, want = pm(*inputs), ref(*inputs)
    node = pm.plan.nodes["flex_attention"]
    return {"err": rel_err(got, want), "placements": ([tuple(q) for q in node.inputs], [tuple(q) for q in node.outputs]),
            "flex_in_program": "flex_attention(" in pm.program}


@pytest.fixture(scope="module")
def evaluated(world2):
    keys = [(mask, plan) for mask in MASKS for plan in PLANS]
    per_rank = world2.run(run_each, eval_case, [(mask, PLANS[plan]) for mask, plan in keys])
    return by_case(keys, per_rank)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mask", MASKS)
def test_exact_against_one_device(evaluated, mask, plan):
    for r, res in enumerate(evaluated[mask, plan]):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["err"] < 1e-5, res
        assert res["flex_in_program"]
    ins, outs = evaluated[mask, plan][0]["placements"]
    if plan == "batch":   # the document ids split with the rows; a causal mask for every row stays whole
        assert ins == [("S(0)",)] * 3 + [("S(0)" if mask == "document" else "B",)] * (BLOCKS + (mask == "document"))
    if plan == "heads":
        assert ins == [("S(1)",)] * 3 + [("B",)] * (BLOCKS + (mask == "document"))
    if plan != "solver":
        assert outs == [(PLANS[plan]["flex_attention"],)] * 3


# on two axes: the batch over both, and the batch on one axis with the heads on the other
PLANS_2D = {"solver": None, "batch-batch": {"flex_attention": ("S(0)", "S(0)")},
            "batch-heads": {"flex_attention": ("S(0)", "S(1)")}}


@pytest.fixture(scope="module")
def evaluated_2d(world4):
    keys = [(mask, plan) for mask in MASKS for plan in PLANS_2D]
    per_rank = world4.run(run_each, eval_case, [(mask, PLANS_2D[plan], (2, 2)) for mask, plan in keys])
    return by_case(keys, per_rank)


@pytest.mark.parametrize("plan", PLANS_2D)
@pytest.mark.parametrize("mask", MASKS)
def test_exact_against_one_device_on_two_axes(evaluated_2d, mask, plan):
    for r, res in enumerate(evaluated_2d[mask, plan]):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["err"] < 1e-5, res
        assert res["flex_in_program"]
    if plan != "solver":
        assert evaluated_2d[mask, plan][0]["placements"][1] == [PLANS_2D[plan]["flex_attention"]] * 3


# ---- not replicated in a coverage report ----------------------------------------------------------

@pytest.mark.parametrize("mask", MASKS)
def test_coverage_does_not_list_it_replicated(mask):
    cov = autoshard.coverage(inference_model(), model_inputs(mask), world=2, training=False)
    assert "flex_attention" in {o.op for o in cov.ops}, [o.op for o in cov.ops]
    assert "flex_attention" not in {o.op for o in cov.fallbacks}, str(cov)
    assert not cov.without_rules, str(cov)


def test_layers_with_other_mods_are_annotated_each_by_its_own():
    """Two calls alike in every tensor but their mask, one computing with h, the other with b:
    each keeps that dim whole and splits the other (annotate asks the rule once per kind of node,
    and a node's kind includes its mods' code)."""
    class TwoMasks(nn.Module):
        def forward(self, q, k, v):   # three tensors: dynamo's guard on q, k and v aliased fails to explain itself
            bs, heads, seq, _ = q.shape
            odd = create_block_mask(lambda b, h, i, j: (i >= j) | (b % 2 == 1), bs, None, seq, seq, device="cpu")
            plain = create_block_mask(lambda b, h, i, j: (i >= j) | (h < 0), bs, None, seq, seq, device="cpu")
            return flex_attention(q, k, v, block_mask=plain) + flex_attention(q, k, v, block_mask=odd)

    graph = capture(TwoMasks(), tuple(torch.randn(2, 2, 128, 8) for _ in range(3)))
    strategies = annotate(graph, (2,))
    flex = [n.name for n in graph.nodes if n.kind == "op" and n.target is FLEX]
    batch = [any(s.outputs[0] == (Split(0),) for s in strategies[name]) for name in flex]
    assert batch == [True, False], {name: strategies[name] for name in flex}
