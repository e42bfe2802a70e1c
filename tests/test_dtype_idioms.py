"""A bf16 MixedPrecisionPolicy on the dtype idioms real models write (issue 34): Meta's and
torchtitan's RMSNorm (``x.float() ... .type_as(x)``), HuggingFace's (``x.to(torch.float32) ...
weight * x.to(dt)``), attention scores upcast around the softmax (``.float() ... .to(q.dtype)``)
and rotary tables built in fp32 (a buffer, which the policy leaves fp32) applied through an
upcast; Qwen3's norm of the queries and keys, on a matmul's bf16 output; the probabilities cast
with ``.bfloat16()`` and ``.half()``. The same under the caller's ``torch.autocast``, where the
norm of a bf16 matmul output upcasts for real. Traced in fp32 each upcast is a no-op and each cast back binds to the fp32 value, so the
norm's output met a bf16 weight ("expected m1 and m2 to have the same dtype"); captured as FSDP2
runs the model (its parameters in param_dtype), the casts do what they say. Each model, split by
the solver on a slow-compute cluster, against one device under the policy's semantics (the
forward on bf16 copies of the parameters), within bf16's bound (test_precision), at world 2 and 4
on 1- and 2-axis meshes."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from test_precision import _err, _fp32_run, _grads, _noise, bf16_tol

BF16 = torch.bfloat16
POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
# compute this slow next to the links makes the solver split the work of a model this small
SLOW = autoshard.Cluster(name="slow-compute", peak_flops=2e9, peak_flops_fp32=1e9, memory_bandwidth=4e9)
# under autocast the model's parameters stay fp32 and their gradients move in fp32: slower still
SLOWER = SLOW.with_(name="slower-compute", peak_flops=2e8, peak_flops_fp32=1e8, memory_bandwidth=4e8)


class MetaRMSNorm(nn.Module):
    """Meta's Llama and torchtitan: normalize in fp32, cast back to the input's dtype."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return out.type_as(x) * self.weight


class HFRMSNorm(nn.Module):
    """HuggingFace's LlamaRMSNorm."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dt)


class Attention(nn.Module):
    """Causal attention written out, its scores upcast around the softmax and cast back; rotary
    tables in fp32 buffers, applied through an upcast."""

    def __init__(self, d, heads, seq, norm, cast="to"):
        super().__init__()
        self.heads, self.cast = heads, cast
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.q_norm, self.k_norm = norm(d // heads), norm(d // heads)   # Qwen3's: on a matmul's (bf16) output
        half = d // heads // 2
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(half) / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotate(self, x):
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat([a * self.cos - b * self.sin, a * self.sin + b * self.cos], dim=-1).type_as(x)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        q, k = self._rotate(self.q_norm(q)), self._rotate(self.k_norm(k))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        probs = scores.float().softmax(dim=-1)
        if self.cast == "to":
            out = probs.to(q.dtype) @ v
        elif self.cast == "bfloat16":
            out = (probs.bfloat16() @ v.bfloat16()).type_as(v)
        else:   # "half": fp16 probabilities and values
            out = (probs.half() @ v.half()).type_as(v)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class Decoder(nn.Module):
    def __init__(self, norm, d=32, heads=4, seq=16, vocab=64, layers=2, cast="to"):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(n1=norm(d), attn=Attention(d, heads, seq, norm, cast), n2=norm(d),
                                                       up=nn.Linear(d, 4 * d, bias=False),
                                                       down=nn.Linear(4 * d, d, bias=False)))
                                    for _ in range(layers))
        self.norm, self.head = norm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = x + blk["attn"](blk["n1"](x))
            x = x + blk["down"](F.silu(blk["up"](blk["n2"](x))))
        logits = self.head(self.norm(x)).float()   # the loss in fp32, as Llama's trainers take it
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


NORMS = {"meta_rmsnorm": MetaRMSNorm, "hf_rmsnorm": HFRMSNorm}


def idiom_case(norm, mesh, how="policy", cast="to"):
    """``how``: "policy" (MixedPrecisionPolicy) or "autocast" (the caller's torch.autocast)."""
    torch.manual_seed(0)
    model = Decoder(NORMS[norm], cast=cast)
    idx = torch.randint(0, 64, (8, 16))
    batch = (idx, torch.roll(idx, -1, dims=1))
    ref = copy.deepcopy(model)
    fp32_loss, fp32 = _fp32_run(model, batch)
    if how == "policy":
        pm = autoshard.parallelize(model, batch, mesh=mesh, mp_policy=POLICY, cluster=SLOW, verbose=False)
        loss = pm(*batch)
        copies = {n: p.to(BF16) for n, p in ref.named_parameters()}   # FSDP2's semantics on one device
        ref_loss = torch.func.functional_call(ref, copies, batch)
    else:
        pm = autoshard.parallelize(model, batch, mesh=mesh, cluster=SLOWER, verbose=False)
        with torch.autocast("cpu", dtype=BF16):
            loss, ref_loss = pm(*batch), ref(*batch)
    loss.backward()
    ref_loss.backward()
    return {"loss": _err(loss, ref_loss), "grads": _grads(pm, ref), "noise": _noise(ref_loss, ref, fp32_loss, fp32),
            "split": any(q.is_shard() for p in pm.parameters() for q in p.placements),
            "dtypes": {str(p.dtype) for p in pm.parameters()} | {str(p.grad.dtype) for p in pm.parameters()}}


MESHES = ((4,), (2, 2))
CASES = [(norm, mesh) for norm in NORMS for mesh in MESHES]
# the caller's autocast on the same idioms, each norm on one of the meshes (world 2 runs both norms
# under autocast on (2,)); the probabilities cast with .bfloat16() and .half(), each pair of mesh,
# policy or autocast, and cast once (world 2 runs all four on (2,))
AUTOCAST = [("meta_rmsnorm", (2, 2), "autocast"), ("hf_rmsnorm", (4,), "autocast")]
CASTS = [("meta_rmsnorm", (4,), "policy", "bfloat16"), ("meta_rmsnorm", (2, 2), "policy", "half"),
         ("meta_rmsnorm", (2, 2), "autocast", "bfloat16"), ("meta_rmsnorm", (4,), "autocast", "half")]
HOWS = [(how,) for how in ("policy", "autocast")] + [(how, cast) for how in ("policy", "autocast")
                                                     for cast in ("bfloat16", "half")]
# at world 2 on (2,): both norms under the policy and autocast, the casts on Meta's
WORLD2 = [(norm, *how) for norm in NORMS for how in HOWS if norm == "meta_rmsnorm" or len(how) == 1]


@pytest.fixture(scope="module")
def results(world4):
    return {case: world4.run(idiom_case, *case) for case in CASES + AUTOCAST + CASTS}


@pytest.fixture(scope="module")
def results2(world2):
    return {(norm, *how): world2.run(idiom_case, norm, (2,), *how) for norm, *how in WORLD2}


def _check(ranks):
    for res in ranks:
        assert res["split"], "a plan that splits no parameter proves nothing"
        assert res["dtypes"] == {"torch.float32"}, res["dtypes"]   # fp32 masters and gradients
        assert res["loss"] <= bf16_tol(res), (res["loss"], res["noise"])
        bad = {n: e for n, e in res["grads"].items() if e > bf16_tol(res)}
        assert not bad, (bad, res["noise"])


def _id(case) -> str:
    norm, mesh, *how = case
    return "-".join([norm, "x".join(map(str, mesh)), *how])


@pytest.mark.parametrize("case", CASES + AUTOCAST + CASTS, ids=_id)
def test_idiom_at_world_4(results, case):
    """The policy on each norm on (4,) and (2, 2); the caller's autocast; the .bfloat16() and
    .half() casts under both."""
    _check(results[case])


@pytest.mark.parametrize("case", WORLD2, ids="-".join)
def test_idiom_at_world_2(results2, case):
    _check(results2[case])
