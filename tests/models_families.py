"""The HuggingFace model families people bring, from tiny configs with random weights (nothing is
downloaded): each builder returns the model and its keyword inputs, with labels where the model
takes them, so that the model returns its loss beside its main output.

Every config is as small as still holds each kind of op its family has (hidden 32-64, one or two
layers, a vocabulary of 128, 8 tokens, a batch of 4); dropout is off so that numerics are
deterministic, and ``use_cache=False`` where a model would return a cache object.

``main_output(out)`` names what each output holds besides the loss: the logits, or for an
encoder with no head (CLIP's text tower) its last hidden state and pooled output.
"""
import torch
import transformers

VOCAB, SEQ, BATCH = 128, 8, 4
IMAGE = 16   # pixels per side of the vision models' images


def _tokens(seed, shape=(BATCH, SEQ), high=VOCAB):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _causal(cls, cfg, seed):
    torch.manual_seed(0)
    model = cls(cfg)
    return model, dict(input_ids=_tokens(seed), labels=_tokens(seed + 1), use_cache=False)


def _padding_mask():
    """Rows padded at the end by 0 to 3 tokens."""
    lengths = SEQ - torch.arange(BATCH) % 4
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).long()


def _masked_lm(cls, cfg, seed):
    """Masked-LM inputs: a padding mask, labels at about a sixth of the real tokens (-100 elsewhere)
    and at least one per row."""
    torch.manual_seed(0)
    model = cls(cfg)
    mask = _padding_mask()
    g = torch.Generator().manual_seed(seed)
    labels = torch.where((torch.rand(BATCH, SEQ, generator=g) < 0.17) & mask.bool(), _tokens(seed + 1), -100)
    labels[:, 0] = _tokens(seed + 2, (BATCH,))
    return model, dict(input_ids=_tokens(seed + 3) * mask, attention_mask=mask, labels=labels)


def gemma2():
    """Gemma 2: soft-capped attention scores and logits, sliding-window and global layers
    alternating, pre- and post-norms (RMSNorm of 1 + weight), GeGLU, the embedding scaled by
    sqrt(hidden)."""
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=SEQ, sliding_window=4, attention_dropout=0.0,
                                    pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return _causal(transformers.Gemma2ForCausalLM, cfg, 10)


def phi3():
    """Phi-3: fused q/k/v and fused gate/up projections (split by slicing), partial rotary off."""
    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                  original_max_position_embeddings=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    return _causal(transformers.Phi3ForCausalLM, cfg, 20)


def opt():
    """OPT: learned positions offset by 2 and computed from the attention mask's cumsum, a
    projection in and out of a smaller word-embedding dim, ReLU MLP."""
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                 num_attention_heads=4, word_embed_proj_dim=16, max_position_embeddings=SEQ,
                                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                                 pad_token_id=1, bos_token_id=2, eos_token_id=2, attn_implementation="sdpa")
    return _causal(transformers.OPTForCausalLM, cfg, 30)


def distilbert():
    """DistilBERT for masked-LM: learned positions, no token types, a padding mask, GELU."""
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=1, n_heads=4,
                                        max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
                                        pad_token_id=0, attn_implementation="sdpa")
    return _masked_lm(transformers.DistilBertForMaskedLM, cfg, 40)


def bart():
    """BART: an encoder and a decoder with cross-attention, decoder inputs shifted from the labels,
    the head tied to the shared embedding plus a final-logits bias buffer."""
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=SEQ, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                  forced_eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg)
    mask = _padding_mask()
    return model, dict(input_ids=_tokens(50, high=VOCAB - 3) + 3, attention_mask=mask,
                       labels=_tokens(51, high=VOCAB - 3) + 3, use_cache=False)


def falcon():
    """Falcon: multi-query attention (one key/value head, split from a fused projection by a list
    index), parallel attention and MLP off one layer norm, ALiBi off (rotary)."""
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                    alibi=False, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                                    max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0,
                                    eos_token_id=0, attn_implementation="sdpa")
    return _causal(transformers.FalconForCausalLM, cfg, 60)


def deberta_v2():
    """DeBERTa-v2 for masked-LM: disentangled attention (content-to-position and position-to-content
    scores gathered from relative positions), log-bucketed relative positions, a padding mask."""
    cfg = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=SEQ, relative_attention=True,
                                       position_buckets=4, max_relative_positions=SEQ, pos_att_type=["p2c", "c2p"],
                                       position_biased_input=False, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, pad_token_id=0, type_vocab_size=0)
    return _masked_lm(transformers.DebertaV2ForMaskedLM, cfg, 70)


def mamba():
    """Mamba: a selective state-space scan (the slow path's sequential loop over time), a causal
    depthwise conv1d, a softplus-gated step size."""
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=1,
                                   expand=2, conv_kernel=4, time_step_rank=4, pad_token_id=0, bos_token_id=0,
                                   eos_token_id=0, use_mambapy=False)
    return _causal(transformers.MambaForCausalLM, cfg, 80)


def mamba2():
    """Mamba-2: the chunked state-space dual (segment sums, cumsum, repeat_interleave over head
    groups), a gated RMSNorm."""
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=1,
                                    expand=2, conv_kernel=4, num_heads=8, head_dim=8, n_groups=2, chunk_size=4,
                                    time_step_rank=4, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return _causal(transformers.Mamba2ForCausalLM, cfg, 90)


def _images(seed, channels=3):
    return torch.randn(BATCH, channels, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))


def resnet():
    """ResNet: convolutions, batch norm (training: batch statistics), max pool, residual
    downsampling shortcuts, global average pool, a classifier."""
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic", num_labels=10)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(cfg)
    return model, dict(pixel_values=_images(100), labels=_tokens(101, (BATCH,), high=10))


def convnext():
    """ConvNeXt: a patchify stem, depthwise 7x7 convolutions, channels-last layer norm, layer
    scale, a downsampling stage."""
    cfg = transformers.ConvNextConfig(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                      num_labels=10, drop_path_rate=0.0, layer_scale_init_value=0.5)
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(cfg)
    return model, dict(pixel_values=_images(110), labels=_tokens(111, (BATCH,), high=10))


def clip_text():
    """CLIP's text tower: a causal mask with a padding mask, quick-GELU, the pooled output
    gathered at each row's end-of-text token (the argmax of the ids)."""
    cfg = transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=SEQ, attention_dropout=0.0,
                                      pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.CLIPTextModel(cfg)
    return model, dict(input_ids=_tokens(120), attention_mask=_padding_mask())


def clip_vision():
    """CLIP's vision tower: a patch convolution, a class token, learned positions, pre-layernorm."""
    cfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, image_size=IMAGE, patch_size=4,
                                        attention_dropout=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(cfg)
    return model, dict(pixel_values=_images(130))


def qwen3_moe():
    """Qwen3-MoE: every layer a mixture of 4 experts, top-2 routing with renormalized weights,
    q/k RMSNorm, grouped-query attention; the router's load-balancing loss on."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=False,
                                      max_position_embeddings=SEQ, attention_dropout=0.0, pad_token_id=0,
                                      bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return _causal(transformers.Qwen3MoeForCausalLM, cfg, 140)


def deepseek_v3():
    """DeepSeek-V3: multi-head latent attention (low-rank q and kv with a decoupled rotary part),
    a dense first layer then a MoE layer of grouped top-k routing with a shared expert."""
    cfg = transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
                                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                        v_head_dim=8, max_position_embeddings=SEQ, attention_dropout=0.0,
                                        rope_interleave=True, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                        attn_implementation="sdpa")
    return _causal(transformers.DeepseekV3ForCausalLM, cfg, 150)


MODELS = {"gemma2": gemma2, "phi3": phi3, "opt": opt, "distilbert": distilbert, "bart": bart, "falcon": falcon,
          "deberta_v2": deberta_v2, "mamba": mamba, "mamba2": mamba2, "resnet": resnet, "convnext": convnext,
          "clip_text": clip_text, "clip_vision": clip_vision, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}


def main_output(out) -> dict:
    """The tensors an output holds besides its loss, by name: logits, or a tower's hidden states."""
    if getattr(out, "logits", None) is not None:
        return {"logits": out.logits}
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}
