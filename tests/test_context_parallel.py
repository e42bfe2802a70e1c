"""Context parallelism, Llama 3's all-gather form: causal attention with the queries split along
the sequence and the keys and values gathered whole, each rank's causal mask offset by its first
query (rules.nn.sdpa, passes.rewrite.lower_sdpa). A causal GQA decoder with rotary embeddings,
pinned so its attention splits the sequence, trains as one device does, in real gloo groups."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture import capture
from cases import rel_err, run_each
from models import RopeLlama


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

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim)
        k, v = (w(h).view(b, t, self.kv_heads, self.head_dim) for w in (self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        return x + self.wo(y.transpose(1, 2).reshape(b, t, d))

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
    model, inputs = _model()
    ref = copy.deepcopy(model)
    nodes = _attention_nodes(model, inputs)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, pin={n: pin for n in nodes})
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
    assert res["program"].count("autoshard_runtime_causal_attention(") == 2


def test_world2_sequence_split_matches_single_device(world2):
    for res in world2.run(run_each, train_case, CASES[:1]):
        _assert_exact(res[0], CASES[0][1])


def test_world4_sequence_split_matches_single_device(world4):
    for per_rank in world4.run(run_each, train_case, CASES[1:]):
        for res, (_, pin) in zip(per_rank, CASES[1:]):
            _assert_exact(res, pin)


def test_planner_splits_a_long_sequence_on_its_own():
    """Batch 1, two key/value heads, a long sequence on 8 devices, on the meta device: the planner
    splits attention's queries along the sequence, keys and values gathered (on this model it
    chose mesh (2, 2, 2), the sequence over two axes and the key/value heads over the third, for
    every sequence from 8k to 131k tokens)."""
    model, inputs = _model(seq=32768, batch=1, device="meta")
    plan = autoshard.plan(model, inputs, world=8, verbose=False)
    for n in _attention_nodes(model, inputs):
        (q, k, v), (out,) = plan.nodes[n].inputs, plan.nodes[n].outputs
        context = [a for a, p in enumerate(q) if p == "S(2)"]
        assert context and all(k[a] == v[a] == "B" and out[a] == "S(2)" for a in context), plan.nodes[n]
