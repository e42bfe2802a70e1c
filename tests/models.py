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
