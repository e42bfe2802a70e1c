"""autoshard quickstart: plan a GPT for 256 GPUs, then train a small one on 4 CPU processes.

    pip install -e .            # from the repository root
    python examples/quickstart.py

Part 1 needs no GPUs and no process group: the model lives on the meta device, so autoshard
only reads its shapes, prices every layout with its cost model and lets an integer program pick
the cheapest plan.

Part 2 starts 4 CPU processes (gloo), parallelizes a tiny GPT with autoshard in each, and trains
it beside an unsharded copy of the same model on the same data: the losses agree.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.launch import run_local


# ---- a small GPT --------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight          # tied to the embedding
        nn.init.normal_(self.emb.weight, std=0.02)  # GPT-2's init: first loss near log(vocab)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx, targets=None):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---- part 1: plan GPT-2 small for 256 GPUs, on the meta device ------------------------------------

def plan_for_256_gpus():
    vocab, seq, batch = 50304, 1024, 512
    with torch.device("meta"):                       # no memory, no compute: shapes only
        model = GPT(vocab=vocab, d=768, heads=12, layers=12, seq=seq)
        idx = torch.randint(0, vocab, (batch, seq))
        targets = torch.randint(0, vocab, (batch, seq))

    plan = autoshard.plan(model, (idx, targets), world=256)   # default cluster: A100 nodes of 8
    print(plan)                                      # at a glance; plan.table(): every op; plan.explain(name): why

    solver = plan.solver
    gap = "no bound: 3+ axes are solved one axis at a time" if solver["gap"] is None else f"gap {100 * solver['gap']:.2f}%"
    print(f"\nestimated step time {plan.cost:.3f} s on {plan.world} GPUs, mesh {plan.mesh_shape}; "
          f"solver {solver['status']} in {solver['seconds']:.2f} s ({gap})")
    for name in ("idx", "emb.weight", "blocks.0.qkv.weight", "blocks.0.fc2.weight", "ln.weight"):
        print(f"  {name:22s} {plan.placement(name)}")


# ---- part 2: train a tiny GPT on 4 processes, beside a single-device copy --------------------------

def train(steps):
    """Runs on every rank of the process group that run_local starts."""
    torch.manual_seed(0)                             # every rank builds the same model and data
    model = GPT(vocab=64, d=32, heads=4, layers=2, seq=16)
    reference = copy.deepcopy(model)                 # before parallelize: it takes the model over
    idx = torch.randint(0, 64, (8, 16))              # one batch; the task: predict token + 1
    targets = (idx + 1) % 64

    sharded = autoshard.parallelize(model, (idx, targets))   # plans, then shards the parameters
    opt = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)

    losses = []
    for _ in range(steps):
        loss = sharded(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()

        ref_loss = reference(idx, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        losses.append((loss.item(), ref_loss.item()))

    params = dict(sharded.named_parameters())       # DTensors: this rank holds its share
    shares = {name: (sharded.plan.placement(name), tuple(params[name].to_local().shape), tuple(params[name].shape))
              for name in ("emb.weight", "blocks.0.qkv.weight", "blocks.0.fc2.weight")}
    return losses, shares


def main():
    print("=" * 100)
    print("Part 1: autoshard.plan for a 12-layer GPT (d=768, batch 512 x 1024 tokens) on 256 GPUs")
    print("=" * 100)
    plan_for_256_gpus()

    print()
    print("=" * 100)
    print("Part 2: a tiny GPT trained on 4 CPU processes with autoshard, against one device")
    print("=" * 100)
    results = run_local(train, 4, 5)                 # one result per rank
    losses, shares = results[0]
    print("autoshard's layout for 4 processes (a few parameters):")
    for name, (placement, local, full) in shares.items():
        print(f"  {name:22s} {str(placement):10s} rank 0 holds {local} of {full}")
    print()
    print(f"{'step':>4}  {'autoshard loss':>16}  {'single-device loss':>18}  {'difference':>10}")
    for step, (loss, ref_loss) in enumerate(losses):
        print(f"{step:>4}  {loss:>16.8f}  {ref_loss:>18.8f}  {abs(loss - ref_loss):>10.2e}")


if __name__ == "__main__":
    main()
