"""Context parallelism with an attention mask and with attention dropout: a GQA decoder with
rotary embeddings whose attention takes a mask made in forward (a sliding window (L, S), a causal
padding mask (B, 1, L, S) from the tokens, a learned bias (1, H, L, S) that needs its
gradient), or draws dropout, against one device, loss and every gradient, in real gloo groups."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import schemes
from cases import rel_err, run_each
from test_context_parallel import GATHERED, GqaAttention, GqaLlama, _attention_nodes, _planned

PAD = 0


MaskedAttention = GqaAttention   # its forward takes a mask, causal and dropout


class MaskedLlama(GqaLlama):
    """``kind``: "window" (bool (L, S): causal, the last ``window`` keys), "padding" (bool (B, 1, L, S):
    causal, padded keys hidden; a query whose keys are all padding sees nothing), "bias"
    (additive (1, H, L, S): a learned bias per head, query and key, -inf above the diagonal), or
    "causal" (no mask, ``is_causal``); "causal+window", "causal+padding" (bool (B, 1, 1, S)),
    "causal+bias" (a fixed bias): the mask without its causal part, beside ``is_causal``.
    ``drop``: dropout on the attention's probabilities in training."""

    def __init__(self, kind, seq=16, heads=4, drop=0.0, window=5, vocab=64, d=32, kv_heads=2, layers=2, hidden=64):
        super().__init__(vocab, d, heads, kv_heads, seq, layers, hidden)
        self.kind, self.drop, self.window = kind, drop, window
        self.attn = nn.ModuleList(MaskedAttention(d, heads, kv_heads, seq) for _ in range(layers))
        if kind == "bias":
            self.bias = nn.Parameter(0.5 * torch.randn(heads, seq, seq))
        elif kind == "causal+bias":   # torch takes no mask that needs a gradient beside is_causal
            self.register_buffer("bias", 0.5 * torch.randn(heads, seq, seq), persistent=False)

    def mask(self, idx):
        t = idx.shape[1]
        i = torch.arange(t, device=idx.device)
        causal = i[None, :] <= i[:, None]
        if self.kind == "causal+window":
            return i[None, :] > i[:, None] - self.window
        if self.kind == "causal+padding":
            return (idx != PAD)[:, None, None, :]
        if self.kind == "causal+bias":
            return self.bias[None]
        if self.kind == "window":
            return causal & (i[None, :] > i[:, None] - self.window)
        if self.kind == "padding":
            return causal[None, None] & (idx != PAD)[:, None, None, :]
        if self.kind == "bias":
            return self.bias.masked_fill(~causal, float("-inf"))[None]
        return None

    def forward(self, idx, targets):
        h = self.emb(idx)
        mask = self.mask(idx)
        causal = self.kind.startswith("causal")
        drop = self.drop if self.training else 0.0
        for attn, norm, w1, w3, w2 in zip(self.attn, self.mlp_norm, self.w1, self.w3, self.w2):
            h = attn(h, mask, causal, drop)
            z = norm(h)
            h = h + w2(F.silu(w1(z)) * w3(z))
        logits = self.out(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model(kind, batch=2, seq=16, drop=0.0):
    torch.manual_seed(0)
    model = MaskedLlama(kind, seq=seq, drop=drop)
    idx = torch.randint(1, 64, (batch, seq))
    if kind.endswith("padding"):   # left padding: the first keys of the first sequence, one query sees none
        idx[0, :3] = PAD
    return model, (idx, torch.randint(0, 64, (batch, seq)))


def mask_case(kind, mesh, form, drop=0.0, balance=False):
    """``schemes.context_parallel`` (the last axis context, the first data) in ``form``, fp32,
    against one device (dropout from the same seed); ``form`` "heads": the attention's heads
    split instead, "both": the all-gather form over both axes of (2, 2), "solver": the
    solver's own plan. ``balance``: causal work balanced whatever
    the cost model says."""
    model, inputs = _model(kind, drop=drop)
    ref = copy.deepcopy(model)
    if form == "heads":
        pins = {n: "(S(1)), (S(1)), (S(1)) -> (S(1))" for n in _attention_nodes(model, inputs)}
    elif form == "both":   # the queries' sequence split over both axes of (2, 2)
        pins = {n: "(S(2), S(2)), (B, B), (B, B) -> (S(2), S(2))" for n in _attention_nodes(model, inputs)}
    else:
        pins = None if form == "solver" else schemes.context_parallel(model, inputs, mesh, form=form)
    if balance:
        pm = autoshard.parallelize(model, inputs, plan=_planned(model, inputs, mesh, pins, True))
    else:
        pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=pins)
    pm.manual_seed(7)
    loss = pm(*inputs)
    torch.manual_seed(7)
    ref_loss = ref(*inputs)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    nodes = _attention_nodes(model, inputs)
    with torch.no_grad():   # the loss without dropout: the dropout drew something
        undropped = ref.eval()(*inputs)
    return {"loss": rel_err(loss, ref_loss), "finite": bool(torch.isfinite(loss)),
            "dropped": rel_err(undropped, ref_loss),
            "grads": {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
            "attention": [(pm.plan.nodes[n].inputs, pm.plan.nodes[n].outputs) for n in nodes],
            "balanced": len(pm.plan.schedule["balanced_attention"]), "program": pm.program}


RING = "autoshard_runtime_ring_attention("
# (kind, mesh, form): world 2 on (2,); world 4 on (2, 2) (data x context), and (4,)
MASKS = ["window", "padding", "bias", "causal+window"]
CASES_2 = [(kind, (2,), form) for kind in MASKS for form in ("allgather", "ring")]
# world 4: (4,) in both forms, and each mask once on (2, 2), each form twice (world 2 runs every
# mask in both forms on (2,))
CASES_4 = [("window", (4,), "allgather"), ("window", (4,), "ring"), ("window", (2, 2), "allgather"),
           ("padding", (2, 2), "ring"), ("bias", (2, 2), "allgather"), ("causal+window", (2, 2), "ring")]


def _check(res, kind, mesh, form):
    assert "error" not in res, res.get("error")
    assert res["finite"]
    assert res["loss"] <= 1e-5, res["loss"]
    assert len(res["grads"]) == 21 + (kind == "bias")   # every parameter, the bias too
    bad = {n: e for n, e in res["grads"].items() if e > 1e-5}
    assert not bad, bad
    for ins, outs in res["attention"]:
        assert outs[0][-1] == "S(2)" and ins[0][-1] == "S(2)", (ins, outs)
        assert ins[1][-1] == ("S(2)" if form == "ring" else "B"), ins
        assert len(ins) == 4 and ins[3][-1] != "S(3)", ins   # the mask's columns whole
    assert res["program"].count(RING) == (2 if form == "ring" else 0)


# balanced causal work with a mask beside is_causal: its rows (where it has them) swapped as the
# queries are
BALANCED = ["causal+window", "causal+padding", "causal+bias"]
BALANCED_2 = [(kind, (2,), form, 0.0, True) for kind in BALANCED for form in ("allgather", "ring")]
BALANCED_4 = [(kind, mesh, form, 0.0, True)
              for kind, mesh, forms in [("causal+window", (4,), ("ring",)), ("causal+bias", (4,), ("allgather",)),
                                        ("causal+padding", (2, 2), ("allgather", "ring"))]
              for form in forms]


def _check_balanced(res, kind, mesh, form, drop, balance):
    _check(res, kind, mesh, form)
    assert res["balanced"] == 2
    if form == "allgather":
        assert res["program"].count(GATHERED) == 2


def test_balanced_with_masks_world2(world2):
    for per_rank in world2.run(run_each, mask_case, BALANCED_2):
        for res, case in zip(per_rank, BALANCED_2):
            _check_balanced(res, *case)


def test_masks_world2(world2):
    for per_rank in world2.run(run_each, mask_case, CASES_2):
        for res, case in zip(per_rank, CASES_2):
            _check(res, *case)


@pytest.fixture(scope="module")
def masks4(world4):
    return world4.run(run_each, mask_case, CASES_4)


@pytest.mark.parametrize("i", range(len(CASES_4)), ids=[f"{k}-{m}-{f}" for k, m, f in CASES_4])
def test_masks_world4(masks4, i):
    for per_rank in masks4:
        _check(per_rank[i], *CASES_4[i])


def test_balanced_with_masks_world4(world4):
    for per_rank in world4.run(run_each, mask_case, BALANCED_4):
        for res, case in zip(per_rank, BALANCED_4):
            _check_balanced(res, *case)


# ---- dropout ------------------------------------------------------------------------------------

DROP = "autoshard_runtime_attention_dropout("
# (kind, mesh, form, dropout): the sequence split (all-gather form), the heads split, the solver's
# plan (attention whole on each rank: before, its dropout drew from each rank's own generator)
DROP_2 = [("causal", (2,), "allgather", 0.3), ("padding", (2,), "allgather", 0.3), ("causal", (2,), "heads", 0.3),
          ("causal", (2,), "solver", 0.3)]
DROP_4 = [("causal", (4,), "allgather", 0.3), ("causal", (2, 2), "allgather", 0.3),
          ("window", (2, 2), "allgather", 0.3), ("causal", (2, 2), "both", 0.3)]


def _check_dropped(res, kind, mesh, form, drop):
    assert "error" not in res, res.get("error")
    assert res["loss"] <= 1e-5, res["loss"]
    assert res["dropped"] > 1e-5, res["dropped"]   # it drew: the loss is not the undropped one
    assert len(res["grads"]) == 21
    bad = {n: e for n, e in res["grads"].items() if e > 1e-5}
    assert not bad, bad
    assert res["program"].count(DROP) == 2
    for ins, outs in res["attention"]:
        if form in ("allgather", "both"):
            assert outs[0][-1] == "S(2)" and ins[1][-1] == "B", (ins, outs)
        if form == "both":
            assert outs[0] == ("S(2)", "S(2)"), outs
        if form == "heads":
            assert outs[0] == ("S(1)",), outs


def test_dropout_world2(world2):
    for per_rank in world2.run(run_each, mask_case, DROP_2):
        for res, case in zip(per_rank, DROP_2):
            _check_dropped(res, *case)


def test_dropout_world4(world4):
    for per_rank in world4.run(run_each, mask_case, DROP_4):
        for res, case in zip(per_rank, DROP_4):
            _check_dropped(res, *case)


def test_dropout_not_in_the_ring():
    """The ring form is not offered with dropout: the scheme says so, and a pin finds no such layout."""
    model, inputs = _model("causal", drop=0.3)
    with pytest.raises(ValueError, match="ring form takes no attention dropout"):
        schemes.context_parallel(model, inputs, (2,), form="ring")
    ring = {n: "(S(2)), (S(2)), (S(2)) -> (S(2))" for n in _attention_nodes(model, inputs)}
    with pytest.raises(ValueError, match="no legal layout"):
        autoshard.plan(model, inputs, mesh=(2,), pin=ring, verbose=False)


def test_balancing_weighs_the_ring_sends_it_exposes():
    """Balancing is applied where the op's whole price drops: the compute it saves against its
    swaps and the ring's sends that less compute leaves exposed (the compute alone would balance)."""
    from autoshard.cost.attention import balance_pays
    ring = lambda s: max(0.0, 2.9 - 3 * s)   # sends hidden by the blocks' compute at share s of it
    assert balance_pays(1.0, 2.0, 0.75, 0.1)               # no ring: 0.75 of 3.0 saved, 0.1 spent
    assert not balance_pays(1.0, 2.0, 0.75, 0.1, ring)     # 0.65 of the ring's sends exposed besides
    assert balance_pays(1.0, 2.0, 0.75, 0.1, lambda s: max(0.0, 2.5 - 3 * s))
    # a checkpointed region runs forward, its swaps and sends again: 0.75 of 4.0 saved, 0.2 spent
    assert balance_pays(1.0, 2.0, 0.75, 0.1, again=True)
    assert not balance_pays(1.0, 2.0, 0.75, 0.7, again=True) and balance_pays(1.0, 2.0, 0.75, 0.7)


def test_explain_speaks_of_balancing_only_where_it_could_be():
    """``explain`` speaks of balancing causal work (done, or why not) only of causal attention
    without dropout whose queries one axis splits: not of a mask without ``is_causal``, nor of dropout (a 32k
    sequence on mesh (8,), the meta device, the solver's plan)."""
    for kind, drop, said in [("causal", 0.0, True), ("window", 0.0, False), ("causal", 0.3, False)]:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = MaskedLlama(kind, seq=32768, drop=drop)
        idx = torch.empty(1, 32768, dtype=torch.long, device="meta")
        plan = autoshard.plan(model, (idx, idx), mesh=(8,), verbose=False)
        node = _attention_nodes(model, (idx, idx))[0]
        text = plan.explain(node)
        assert plan.nodes[node].outputs == [("S(2)",)], text
        assert "attention: the keys and values" in text, text
        assert ("causal work" in text) == said, (kind, drop, text)   # balanced, or why not
