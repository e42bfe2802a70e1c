"""torchtitan's own models (torchtitan 0.3.0's model code, from its wheel): Llama 3, Qwen3 dense and
MoE, and DeepSeek-V3 (MoE with multi-head latent attention), built from torchtitan's config
classes and layer builders as its debug models are, shrunk: dim 64, two layers, 8 experts routed
top-2, a vocabulary of 256, 32 tokens a row.

torchtitan is installed without its dependencies (``pip install --no-deps torchtitan``: it pins
a nightly torch); its model code imports with tyro, einops and spmd_types besides torch, and
with one module stood in for: ``torchtitan.distributed.minimal_async_ep.kernels``, the triton
kernels of an expert-parallel communication backend none of these models uses, imported at the
top of a package the models import. The stand-in is that module alone (``triton`` itself is
left absent: torch's inductor asks whether it is installed), and calling any of its kernels says
that it needs triton.

Weights are random, drawn in a fixed order from a fixed seed (torchtitan's own initializers,
then every parameter redrawn at a scale that keeps activations near 1, so that a wrong shard
shows as an error of the magnitude itself rather than of 0.02 of it), and the rotary caches are
torchtitan's. Attention runs on SDPA (causal) or on FlexAttention, torchtitan's default, with
its block-causal document mask built from each token's position in its document; on a CPU
FlexAttention runs forward only, so those models run in inference (``requires_grad_(False)``).

``Trained(model, flex)`` is what torchtitan's trainer computes on one batch: the logits, and
the cross-entropy of them against the labels (``torchtitan.components.loss.cross_entropy_loss``:
summed, divided by the tokens).
"""
import math
import sys
import types

import torch
import torch.nn as nn

VOCAB, SEQ, BATCH, DIM = 256, 32, 4, 64
EXPERTS, TOP_K = 8, 2

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _stand_in_for_triton_kernels():
    """The one torchtitan module that imports triton at its top, for what the models never
    call: each name it is asked for is a function that raises."""
    if _KERNELS in sys.modules:
        return
    module = types.ModuleType(_KERNELS)

    def lookup(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def needs_triton(*args, **kwargs):
            raise RuntimeError(f"{_KERNELS}.{name} needs triton, which this test does not install")
        return needs_triton
    module.__getattr__ = lookup
    sys.modules[_KERNELS] = module


_stand_in_for_triton_kernels()

from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.models import deepseek_v3 as titan_dsv3  # noqa: E402
from torchtitan.models import llama3 as titan_llama3  # noqa: E402
from torchtitan.models import qwen3 as titan_qwen3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402


def _sdpa(config):
    """Every layer's attention on SDPA (causal, no mask) instead of FlexAttention."""
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def llama3(backend):
    """Llama 3 as its debug model: fused q/k/v, grouped-query attention, complex rotary
    embeddings with Llama's frequency scaling, SwiGLU."""
    heads = 4
    config = titan_llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=titan_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=titan_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=titan_llama3._output_linear_init(DIM)),
        layers=titan_llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=heads, n_kv_heads=2, hidden_dim=128,
            rope=ComplexRoPE.Config(dim=DIM // heads, max_seq_len=SEQ, theta=500000, scaling="llama"),
            attn_backend="flex"))
    return config if backend == "flex" else _sdpa(config)


def _qwen3_rope(head_dim):
    return CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0)


def qwen3(backend):
    """Qwen3 dense: q/k RMSNorm, grouped-query attention, cos/sin rotary embeddings, the
    embedding tied to the output head."""
    config = titan_qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=titan_qwen3._qwen3_norm(DIM), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=titan_qwen3._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=titan_qwen3._LINEAR_INIT),
        layers=titan_qwen3._build_qwen3_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
            attn_backend="flex", rope=_qwen3_rope(16)))
    return config if backend == "flex" else _sdpa(config)


def qwen3_moe(backend):
    """Qwen3-MoE: every layer a mixture of 8 experts routed top-2 by softmax scores,
    renormalized; tokens sorted by expert (argsort), grouped matmuls, torchtitan's
    deterministic scatter-add back to the tokens."""
    config = titan_qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=titan_qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=titan_qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=titan_qwen3._LINEAR_INIT),
        layers=titan_qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
            num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex", rope=_qwen3_rope(16),
            moe_comm_backend="standard"))
    return config if backend == "flex" else _sdpa(config)


def deepseek_v3(backend):
    """DeepSeek-V3: multi-head latent attention (keys and values through a low-rank latent with a
    decoupled rotary part, YaRN-scaled), a dense first layer, then a mixture of 8 experts routed
    top-2 with a shared expert."""
    rope_dim = 8
    layers = titan_dsv3._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=EXPERTS, num_shared_experts=1, router_top_k=TOP_K,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=SEQ * 4, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=SEQ))
    config = titan_dsv3.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=titan_dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=titan_dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=titan_dsv3._output_linear_init(DIM)),
        layers=layers, mtp_layers=[])
    return config if backend == "flex" else _sdpa(config)


CONFIGS = {"llama3": llama3, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}
MOE = ("qwen3_moe", "deepseek_v3")


class Trained(nn.Module):
    """One step of torchtitan's trainer on a batch: the model's logits (given each token's
    position in its document, from which FlexAttention's block-causal document mask is built),
    and their cross-entropy against the labels, summed and divided by the tokens."""

    def __init__(self, model, flex):
        super().__init__()
        self.model, self.flex = model, flex

    def forward(self, tokens, positions, labels):
        if self.flex:
            logits = self.model(tokens, positions, self.model.get_attention_masks(positions))
        else:
            logits = self.model(tokens)
        return cross_entropy_loss(logits, labels) / labels.numel(), logits


def _positions():
    """Each row two or three documents packed end to end: a token's position counts from its
    document's start."""
    starts = [(0, 12), (0, 20), (0, 9, 25), (0, 16)]
    out = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, cuts in enumerate(starts):
        for a, b in zip(cuts, cuts[1:] + (SEQ,)):
            out[row, a:b] = torch.arange(b - a)
    return out


def build(name, backend="sdpa"):
    """Model ``name`` on ``backend`` ("sdpa" or "flex") in ``Trained``, and its inputs (tokens,
    positions, labels). FlexAttention's models need no gradient (CPU runs it forward only)."""
    torch.manual_seed(0)
    model = CONFIGS[name](backend).build()
    model.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    if backend == "flex":
        model.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return Trained(model, backend == "flex"), (tokens, _positions(), labels)
