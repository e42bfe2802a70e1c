"""Train a small Llama-style decoder with autoshard under torchrun: the loop to copy.

    torchrun --standalone --nproc-per-node 4 examples/train.py
    torchrun --standalone --nproc-per-node 4 examples/train.py --steps 6 --save ckpt --save-every 3
    torchrun --standalone --nproc-per-node 4 examples/train.py --steps 12 --resume ckpt/step-3
    python examples/train.py --single --world 4         # the same training on one device

What it shows, each where it happens below:

- the model (RMSNorm written as Meta's Llama writes it, rotary embeddings, SwiGLU) is plain
  PyTorch, defined here and built the same on every rank;
- each rank loads its own rows through a ``DistributedSampler`` and passes them to the module
  (``parallelize(..., inputs="local")``): the global batch is the ranks' rows in rank order, and
  ``module.data_shards`` and ``module.data_rank`` are what the sampler needs;
- bf16 compute with fp32 master weights and fp32 gradient reduction (FSDP2's
  ``MixedPrecisionPolicy``); AdamW built after ``parallelize`` from the module's parameters;
- a ragged last batch: the dataset is no multiple of the global batch, so each epoch's last
  batch is smaller, and autoshard plans that shape once when it first arrives (that step's time
  includes the planning);
- checkpoints with ``torch.distributed.checkpoint`` (model, optimizer and step), resumable in a
  fresh launch, at another world size too (the data then goes on in that world's order);
- the loss and tokens/s of every step, printed by rank 0.

``--single --world N`` trains the same model on one device on the same global batches, in the
same order, under the same bf16 semantics (the forward on bf16 copies of fp32 parameters), to
compare losses with a launch of N ranks (``tests/test_train_example.py`` does).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import autoshard

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# ---- the model: a small Llama ------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Meta's Llama: normalize in fp32, cast back to the input's dtype, then scale."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rotate(x, cos, sin):
    """Rotary embedding, in fp32 (the tables are fp32 buffers, which the policy leaves fp32)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, d, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(d), Attention(d, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(d), FeedForward(d, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=128, d=64, layers=2, heads=4, seq=32, theta=10000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, hidden=4 * d) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        half = d // heads // 2
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), theta ** -(torch.arange(half) / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos[:t], self.sin[:t])
        logits = self.output(self.norm(h)).float()   # the loss in fp32, as Llama's trainers take it
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---- the data ----------------------------------------------------------------------------------

def dataset(size, seq, vocab, seed=0):
    """Sequences counting up from a random start by a random stride (mod vocab): learnable from
    two tokens of context, so the loss falls within a few steps. Inputs and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 8, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loader(data, batch, shards, rank, seed):
    """This rank's batches. drop_last=False: the sampler pads the epoch to a multiple of the
    shards, every rank gets as many rows, and the last batch is short when the rows per rank are
    no multiple of ``batch``."""
    sampler = DistributedSampler(data, num_replicas=shards, rank=rank, shuffle=True, seed=seed, drop_last=False)
    return sampler, DataLoader(data, batch_size=batch, sampler=sampler, drop_last=False)


def batches(data, batch, shards, rank, seed, start=0):
    """Step ``start`` onwards: (step, tokens, targets), epoch after epoch."""
    sampler, rows = loader(data, batch, shards, rank, seed)
    per_epoch = len(rows)
    step = start
    while True:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for i, (tokens, targets) in enumerate(rows):
            if i >= skip:
                yield step, tokens, targets
                step += 1


# ---- training ----------------------------------------------------------------------------------

def build(args, device):
    torch.manual_seed(args.seed)   # the same initial weights on every rank (parallelize takes rank 0's)
    with torch.device(device):
        return Llama(vocab=args.vocab, d=args.dim, layers=args.layers, heads=args.heads, seq=args.seq)


def report(step, loss, seconds, tokens):
    print(f"step {step:4d} | loss {loss:.6f} | {1e3 * seconds:7.1f} ms | {tokens / seconds:9.0f} tok/s | "
          f"{tokens} tokens", flush=True)


def train(args):
    if torch.cuda.is_available():
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = dataset(args.samples, args.seq, args.vocab)

    model = build(args, device)
    example = (torch.zeros(args.batch, args.seq, dtype=torch.long, device=device),) * 2   # one rank's batch
    cluster = args.cluster or ("measure" if device.type == "cpu" else None)   # on CPUs: price this machine
    begin = time.perf_counter()
    module = autoshard.parallelize(model, example, inputs="local", mp_policy=POLICY, cluster=cluster)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.1)   # fp32 masters: DTensors now
    if rank == 0:
        plan = str(module.plan)   # mesh, estimated step, memory, then every module's layout
        print(plan if args.show_plan else "\n".join(plan.splitlines()[:3]), flush=True)
        print(f"parallelized in {time.perf_counter() - begin:.1f} s", flush=True)

    step = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(module, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.zeros((), dtype=torch.long)}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)

    times = []
    for step, tokens, targets in batches(data, args.batch, module.data_shards, module.data_rank, args.seed, step):
        if step >= args.steps:
            break
        begin = time.perf_counter()
        loss = module(tokens.to(device), targets.to(device))   # this rank's rows; the loss is the global batch's
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.item()
        seconds = time.perf_counter() - begin
        if rank == 0:
            report(step + 1, loss, seconds, tokens.numel() * module.data_shards)
            if tokens.shape[0] == args.batch:
                times.append(seconds)
        if args.save and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
            model_sd, optim_sd = get_state_dict(module, opt)
            path = os.path.join(args.save, f"step-{step + 1}")
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step + 1)}, checkpoint_id=path)
            if rank == 0:
                print(f"saved {path}", flush=True)
    if rank == 0 and times:
        median = sorted(times)[len(times) // 2]
        tokens = args.batch * args.seq * module.data_shards
        print(f"full batches: median {1e3 * median:.1f} ms a step, {tokens / median:.0f} tok/s "
              f"({module.data_shards} ranks x {args.batch} rows x {args.seq} tokens)", flush=True)
    dist.destroy_process_group()


def single(args, verbose=True):
    """The same training on one device: each step's global batch is what the ranks of a launch at
    ``args.world`` would pass, concatenated in rank order, and the forward runs on bf16 copies of
    the fp32 parameters (FSDP2's semantics). Returns the losses."""
    model = build(args, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = dataset(args.samples, args.seq, args.vocab)
    ranks = [batches(data, args.batch, args.world, r, args.seed) for r in range(args.world)]
    losses = []
    for parts in zip(*ranks):
        step = parts[0][0]
        if step >= args.steps:
            break
        tokens, targets = (torch.cat([p[i] for p in parts]) for i in (1, 2))
        begin = time.perf_counter()
        copies = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, copies, (tokens, targets))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if verbose:
            report(step + 1, losses[-1], time.perf_counter() - begin, tokens.numel())
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="train until this many steps in all")
    p.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    p.add_argument("--samples", type=int, default=100, help="dataset rows: no multiple of the global batch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", default=None,
                   help="autoshard cluster preset; default: measure this machine on CPUs, the A100 preset on GPUs")
    p.add_argument("--save", default=None, help="directory for checkpoints (DIR/step-N)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps too (default: at the end only)")
    p.add_argument("--show-plan", action="store_true", help="print the whole plan, not only its first line")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from, e.g. DIR/step-N")
    p.add_argument("--single", action="store_true", help="train on one device, no process group, as a reference")
    p.add_argument("--world", type=int, default=4, help="with --single: the launch whose global batches to take")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    single(args) if args.single else train(args)
