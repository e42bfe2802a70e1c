"""HuggingFace transformers models the tests train, built from tiny configs with random weights
(nothing is downloaded): GPT-2, LLaMA with grouped-query attention, and BERT for masked-LM. Each
builder returns the model and its keyword inputs, labels included, so the model returns its loss
beside its logits.

``layers=`` sets the depth (2 by default; one block already holds every kind of op).

``megatron_pins`` pins Megatron-LM's tensor parallelism on a model's attention and MLP
projections: ``autoshard.schemes.megatron``, which finds them in the captured graph, since
HuggingFace names them differently per model.
"""
import torch
import transformers

from autoshard import schemes

VOCAB, SEQ, BATCH = 128, 8, 8


def _tokens(seed, shape=(BATCH, SEQ)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def gpt2(attn="eager", layers=2):
    """GPT-2: Conv1D projections (``addmm`` with (in, out) weights), fused q/k/v, learned
    positions, the head tied to the token embedding. Dropout off, so numerics are deterministic."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    model = transformers.GPT2LMHeadModel(cfg)
    # use_cache=False: the key/value cache object is not a tensor the graph can return
    return model, dict(input_ids=_tokens(1), labels=_tokens(2), use_cache=False)


def llama(attn="sdpa", layers=2):
    """LLaMA: grouped-query attention (8 query heads share 4 key/value heads), rotary position
    embeddings (a table computed under torch.no_grad), RMSNorm, a SwiGLU MLP, an untied head."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=SEQ, attention_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   attn_implementation=attn)
    model = transformers.LlamaForCausalLM(cfg)
    return model, dict(input_ids=_tokens(3), labels=_tokens(4), use_cache=False)


def bert(attn="sdpa", layers=2):
    """BERT for masked-LM: a padding attention mask (rows padded by 0 to 3 tokens), two token
    types, labels only at about a sixth of the positions (-100, ignored, elsewhere)."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=SEQ,
                                  type_vocab_size=2, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0,
                                  attn_implementation=attn)
    model = transformers.BertForMaskedLM(cfg)
    g = torch.Generator().manual_seed(5)
    lengths = SEQ - torch.arange(BATCH) % 4
    attention_mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    token_type_ids = (torch.arange(SEQ)[None, :] >= lengths[:, None] // 2).long().expand(BATCH, SEQ).contiguous()
    labels = torch.where((torch.rand(BATCH, SEQ, generator=g) < 0.17) & attention_mask.bool(), _tokens(6), -100)
    labels[:, 0] = _tokens(7, (BATCH,))   # at least one counted target per row
    return model, dict(input_ids=_tokens(8) * attention_mask, attention_mask=attention_mask,
                       token_type_ids=token_type_ids, labels=labels)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}

def megatron_pins(model, inputs, mesh, tp=-1, graph=None):
    """Megatron-LM 1-D tensor parallelism on mesh axis ``tp``, data parallelism on the others:
    ``autoshard.schemes.megatron``, which finds the attention and MLP projections in the graph
    (column-parallel q, k, v and the MLP's up projections, row-parallel the attention output and
    the MLP's down projection) and places each weight by its orientation (GPT-2's Conv1D holds
    it (in, out)). ``graph=`` reuses one ``capture(model, inputs)`` for several meshes."""
    return schemes.megatron(model, inputs, mesh, tp=tp, graph=graph)
