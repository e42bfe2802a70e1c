"""Small models the tests train: an MLP with residuals and layer norm, a transformer block with
causal attention, and a GPT whose head is tied to its embedding."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d=32, hidden=64, depth=2):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(nn.ModuleDict(dict(ln=nn.LayerNorm(d), fc1=nn.Linear(d, hidden), fc2=nn.Linear(hidden, d))))
        self.out = nn.Linear(d, d)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["fc2"](F.gelu(layer["fc1"](layer["ln"](x))))
        return self.out(x)


class Block(nn.Module):
    def __init__(self, d=32, heads=4, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, seq=16, dropout=0.0):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets=None):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class TwoLayer(nn.Module):
    """Two linears that return their training loss, as a training step would."""

    def __init__(self, d, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.relu(self.fc1(x))), y)


MEGATRON_BLOCK = {"qkv.weight": ("S(0)",), "qkv.bias": ("S(0)",), "proj.weight": ("S(1)",),
                  "fc.weight": ("S(0)",), "fc.bias": ("S(0)",), "fc2.weight": ("S(1)",)}


def megatron_pins(prefixes):
    return {f"{p}{k}": v for p in prefixes for k, v in MEGATRON_BLOCK.items()}


class RopeAttention(nn.Module):
    """Llama-style attention as Meta and torchtitan write it: rotary embeddings applied through
    ``view_as_complex``, a complex multiply and ``view_as_real``; a residual and a loss-like mean."""

    def __init__(self, d=32, heads=4, seq=16):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.norm = nn.LayerNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        freqs = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def rope(self, z):
        zc = torch.view_as_complex(z.float().reshape(*z.shape[:-1], -1, 2))
        rotated = zc * self.freqs_cis.view(1, z.shape[1], 1, -1)
        return torch.view_as_real(rotated).flatten(3).type_as(z)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)
        q, k, v = (w(h).view(b, t, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return x + self.wo(y.transpose(1, 2).reshape(b, t, d))


class RopeLlama(nn.Module):
    """A Llama-style decoder as Meta and torchtitan write it: token embedding; blocks of RMSNorm,
    attention with complex rotary embeddings (``RopeAttention``), RMSNorm and a SwiGLU MLP, each
    with its residual; a final RMSNorm, the output head and the cross-entropy loss."""

    def __init__(self, vocab=64, d=32, heads=4, seq=16, layers=2, hidden=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList(RopeAttention(d, heads, seq) for _ in range(layers))
        for a in self.attn:
            a.norm = nn.RMSNorm(d)
        self.mlp_norm = nn.ModuleList(nn.RMSNorm(d) for _ in range(layers))
        self.w1, self.w3 = (nn.ModuleList(nn.Linear(d, hidden, bias=False) for _ in range(layers)) for _ in range(2))
        self.w2 = nn.ModuleList(nn.Linear(hidden, d, bias=False) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        h = self.emb(idx)
        for attn, norm, w1, w3, w2 in zip(self.attn, self.mlp_norm, self.w1, self.w3, self.w2):
            h = attn(h)
            z = norm(h)
            h = h + w2(F.silu(w1(z)) * w3(z))
        logits = self.out(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


ROPE_HEADS = {"wq.weight": ("S(0)",), "wk.weight": ("S(0)",), "wv.weight": ("S(0)",), "wo.weight": ("S(1)",)}
