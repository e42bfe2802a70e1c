"""autoshard against what a PyTorch user would write by hand, measured on a local gloo group.

Each peer beside autoshard pinned to the same scheme (``autoshard.schemes``), and the best peer
beside autoshard's own plan:

  DDP        DistributedDataParallel, default buckets, each rank its share of the batch
             vs autoshard pinned ``schemes.data_parallel``
  FSDP2      ``fully_shard`` on each block, then on the root, each rank its share of the batch
             vs autoshard pinned ``schemes.fsdp`` (``--reshard`` sets both sides' reshard_after_forward)
  DTensor TP ``parallelize_module``: ColwiseParallel on q, k, v, fc; RowwiseParallel on o, fc2; every
             other parameter replicated (the embedding, head and loss run whole on every rank);
             the whole batch on every rank; with ``--tp-prepare 1`` (default) also
             PrepareModuleInput on the attention, as torchtitan writes it, so the gradient of
             its input is all-reduced once, not once per q, k and v
             vs autoshard pinned ``schemes.megatron``
  best peer  the peer with the lowest median vs ``autoshard.parallelize(model, batch)``; its
             median ratio is taken against that peer's step in the same round

Every autoshard contender plans for ``--cluster``: by default this machine, measured once per
world and model (``autoshard.measure``), where autoshard has it; a preset otherwise.

Two models: a GPT (separate q, k, v and o linears as in LLaMA, an fc -> gelu -> fc2 MLP, layer
norms, the head tied to the token embedding, cross-entropy inside forward) and a residual MLP
stack (layer norm, fc -> gelu -> fc2 per block, a classifier head, cross-entropy inside forward).
Every contender starts from the same weights and takes the same global batch; autoshard gets the
whole batch on every rank and cuts each rank's share itself. A training step is forward (loss),
backward, AdamW step, zero_grad.

Contenders are interleaved: round r runs one step of each, in an order shuffled anew (seeded by r, the same on every rank), so drift of
this shared machine hits all alike. A step's time is the slowest rank's, from a barrier to the
end of zero_grad; the first ``--warmup`` rounds are dropped. "ratio of medians" is autoshard's
median over the peer's; "median ratio" is the median over rounds of autoshard's step over the
peer's step in the same round (< 1: autoshard is faster).

Below each table: the loss at step 0 of every contender against the single-device model's (and
after the last step), the set-up seconds, the collectives one step issues on rank 0 (c10d calls
counted by torch.profiler, so peers and autoshard are counted alike), each autoshard plan in a
line (mesh, inputs, how its matmuls lay out their outputs), and the cost model's step beside the
measured one, with both rankings (DESIGN.md section 9).

    python benchmarks/vs_torch.py                      # both models, worlds 2 and 4 (a few minutes)
    python benchmarks/vs_torch.py --quick              # world 2, small sizes, few rounds (about 40 s)
    python benchmarks/vs_torch.py --model gpt --worlds 2 --rounds 30
    python benchmarks/vs_torch.py --program            # also print autoshard's per-rank programs
    python benchmarks/vs_torch.py --profile fsdp2      # where one contender's time goes (rank 0)
    python benchmarks/vs_torch.py --model mlp --worlds 4 --profile as-dp --program   # and its program
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import schemes
from autoshard.testing.launch import LocalWorld

# ---- the models ----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, h):
        b, t, _ = h.shape
        # -1 heads: under DTensor TP each rank holds only its own heads' features
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        for e in (self.emb, self.pos):
            nn.init.normal_(e.weight, std=0.02)     # GPT-2's: logits of a tied head start small

    def forward(self, idx, targets):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc(self.ln(x))))


class ResMLP(nn.Module):
    def __init__(self, inp, d, layers, classes):
        super().__init__()
        self.inp = nn.Linear(inp, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, labels):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return F.cross_entropy(self.head(self.ln(x)), labels)


def build(a, kind):
    """(model, whole global batch, {module name: "col" / "row" / "input"} for tensor parallelism (the
    last: a module whose input q, k and v share), a line)."""
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(a.vocab, a.d, a.heads, a.layers, a.seq)
        idx = torch.randint(0, a.vocab, (a.batch, a.seq))
        batch = (idx, torch.roll(idx, -1, dims=1))
        roles = {"attn": "input", "attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row",
                 "fc": "col", "fc2": "row"}
        what = (f"GPT: d={a.d}, {a.heads} heads, {a.layers} blocks (separate q, k, v, o), vocab {a.vocab} "
                f"(head tied to the embedding), batch {a.batch} x {a.seq} tokens")
    else:
        model = ResMLP(a.mlp_in, a.mlp_d, a.mlp_layers, a.mlp_classes)
        batch = (torch.randn(a.mlp_batch, a.mlp_in), torch.randint(0, a.mlp_classes, (a.mlp_batch,)))
        roles = {"fc": "col", "fc2": "row"}
        what = (f"residual MLP: {a.mlp_in} -> d={a.mlp_d}, {a.mlp_layers} blocks (ln, fc {a.mlp_d}->"
                f"{4 * a.mlp_d}, gelu, fc2), {a.mlp_classes} classes, batch {a.mlp_batch}")
    tp = {f"blocks.{i}.{name}": role for i in range(len(model.blocks)) for name, role in roles.items()}
    return model, batch, tp, what


# ---- the contenders ------------------------------------------------------------------------------

PEERS = {"ddp": "DDP", "fsdp2": "FSDP2", "tp": "DTensor TP"}
OURS = {"as-dp": "autoshard data_parallel", "as-fsdp": "autoshard fsdp", "as-megatron": "autoshard megatron",
        "as-default": "autoshard default plan"}
PAIRS = [("ddp", "as-dp"), ("fsdp2", "as-fsdp"), ("tp", "as-megatron"), ("best", "as-default")]
CONTENDERS = list(PEERS) + list(OURS)


class NotAvailable(Exception):
    """A contender that cannot run here; its row says why."""


@dataclass
class Contender:
    model: nn.Module
    inputs: tuple
    sharded_batch: bool        # the loss is this rank's share's mean, not the whole batch's
    opt: torch.optim.Optimizer = None

    def step(self):
        loss = self.model(*self.inputs)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def share(batch):
    r, w = dist.get_rank(), dist.get_world_size()
    n = batch[0].shape[0]
    if n % w:
        raise NotAvailable(f"batch {n} does not split over {w} ranks")
    return tuple(x[r * n // w:(r + 1) * n // w] for x in batch)


def default_cluster() -> str:
    return "measure" if hasattr(autoshard.Cluster, "measure") else autoshard.machine.cluster.DEFAULT_CLUSTER


def plan_cluster(a):
    """The cluster autoshard's contenders plan for: measured here (collective), or a preset."""
    return autoshard.measure() if a.cluster == "measure" else autoshard.Cluster.preset(a.cluster)


def make(name, base, batch, tp, a, cluster=None):
    """Contender ``name`` from a copy of ``base``; raises NotAvailable when it cannot run."""
    from torch.distributed.device_mesh import init_device_mesh
    model = copy.deepcopy(base)
    w = dist.get_world_size()
    if name == "ddp":
        c = Contender(nn.parallel.DistributedDataParallel(model), share(batch), True)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (w,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=a.reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=a.reshard)
        c = Contender(model, share(batch), True)
    elif name == "tp":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (w,))
        # with the attention's input made a DTensor once (torchtitan's form), the gradients q, k and v
        # send it add up as one partial sum and are all-reduced once, not once per linear
        style = dict(col=ColwiseParallel, row=RowwiseParallel,
                     input=lambda: PrepareModuleInput(input_layouts=(Replicate(),),
                                                      desired_input_layouts=(Replicate(),), use_local_output=False))
        plan = {m: style[role]() for m, role in tp.items() if role != "input" or a.tp_prepare}
        c = Contender(parallelize_module(model, mesh, plan), batch, False)
    else:
        kw = ours(name, model, batch, tp, a)
        c = Contender(autoshard.parallelize(model, batch, cluster=cluster, **kw), batch, False)
    c.opt = torch.optim.AdamW(c.model.parameters(), lr=a.lr)
    return c


def ours(name, model, batch, tp, a) -> dict:
    """parallelize's keywords for autoshard contender ``name``."""
    w = dist.get_world_size()
    kw = dict(time_limit=a.time_limit)
    if name == "as-default":
        return kw
    scheme = {"as-dp": schemes.data_parallel, "as-fsdp": schemes.fsdp, "as-megatron": schemes.megatron}[name]
    try:
        pins = scheme(model, batch, (w,))
    except ValueError as e:
        raise NotAvailable(f"schemes cannot find the roles yet ({str(e)[:60]}...)") from None
    if name == "as-megatron":
        # the scheme may find only some roles (by module names qkv/proj/fc/fc2): then it is not Megatron
        want = {f"{m}.weight": ("S(0)",) if role == "col" else ("S(1)",) for m, role in tp.items()
                if role != "input"}
        missed = [p for p, place in want.items() if tuple(pins.get(p, ())) != place]
        if missed:
            raise NotAvailable(f"schemes cannot find the roles yet: {', '.join(missed[:3])}"
                               f"{', ...' if len(missed) > 3 else ''} not pinned as Megatron")
    if name == "as-fsdp":
        kw["reshard_after_forward"] = a.reshard
    return kw | dict(pin=pins)


# ---- one world -----------------------------------------------------------------------------------

def quiet_warnings():
    # DTensor warns on every CPU mesh that its random ops may be incomplete; no contender draws any
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


@contextlib.contextmanager
def quiet_stderr():
    """The profiler's native side writes two lines to fd 2 whenever it starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def collectives_per_step(c: Contender) -> dict:
    """{kind: count} of the c10d collectives one step of ``c`` issues on this rank, by the profiler:
    the same count for every contender, whoever issues them."""
    from torch.profiler import ProfilerActivity, profile
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        c.step()
    counts = {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            kind = e.name[len("c10d::"):].strip("_").replace("_base", "")
            kind = {"allreduce": "all_reduce", "allgather": "all_gather"}.get(kind, kind)
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def plan_summary(plan) -> str:
    """The mesh, the inputs' placements, and how the plan's matmuls lay out their outputs."""
    fmt = lambda p: p[0] if len(p) == 1 else f"({', '.join(p)})"
    inputs = [f"{n.name} {fmt(n.outputs[0])}" for n in plan.nodes.values() if n.kind == "input" and n.outputs]
    mm = {}
    for n in plan.nodes.values():
        if n.kind == "op" and n.op.split(".")[0] in ("linear", "addmm", "mm", "matmul", "bmm") and n.outputs:
            mm[fmt(n.outputs[0])] = mm.get(fmt(n.outputs[0]), 0) + 1
    return (f"mesh {tuple(plan.mesh_shape)}, inputs {', '.join(inputs)}, matmul outputs "
            + ", ".join(f"{p} x{c}" for p, c in sorted(mm.items())))


def interleaved(built: dict, warmup: int, rounds: int) -> tuple:
    """Round r runs one step of each contender of ``built``, in an order shuffled by r, each from a
    barrier: (the slowest rank's seconds per step after ``warmup`` rounds, per contender; its
    first and its last loss on this rank)."""
    names = list(built)
    times = {n: [] for n in names}
    first, last = {}, {}
    for r in range(warmup + rounds):
        # a fresh order each round, the same on every rank: a rotation keeps each contender
        # behind the same one every round (GPT world 2: data parallelism pinned ran 2% slower
        # than the same plan found by the search, behind DTensor TP's step every time)
        for n in random.Random(r).sample(names, len(names)):
            dist.barrier()
            t0 = time.perf_counter()
            loss = built[n].step()
            times[n].append(time.perf_counter() - t0)
            first.setdefault(n, loss)
            last[n] = loss
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {n: [max(t[n][s] for t in gathered) for s in range(warmup, warmup + rounds)] for n in names}, first, last


def run_world(a, kind):
    """On every rank: build the contenders, run the interleaved rounds; rank 0 returns the results."""
    torch.set_num_threads(a.threads)
    quiet_warnings()
    w, rank = dist.get_world_size(), dist.get_rank()
    base, batch, tp, what = build(a, kind)
    with torch.no_grad():
        ref = base(*batch).item()
    t0 = time.perf_counter()
    cluster = plan_cluster(a)
    phases = {"cluster": time.perf_counter() - t0}
    built, skipped, setup, programs = {}, {}, {}, {}
    for name in a.contenders:
        t0 = time.perf_counter()
        try:
            built[name] = make(name, base, batch, tp, a, cluster)
        except NotAvailable as e:
            skipped[name] = str(e)
            continue
        setup[name] = time.perf_counter() - t0
        if name in OURS:
            pm = built[name].model
            programs[name] = (pm.program, plan_summary(pm.plan), pm.plan.cost)
    phases["set-up"] = sum(setup.values())
    names = list(built)
    t1 = time.perf_counter()
    times, first, last = interleaved(built, a.warmup, a.rounds)
    phases["rounds"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    collectives = {n: collectives_per_step(built[n]) for n in names}
    phases["counting"] = time.perf_counter() - t1
    # the whole batch's loss (a DDP or FSDP2 rank has its share's mean)
    losses = {}
    for n in names:
        pair = torch.stack([first[n], last[n]]).float()
        if built[n].sharded_batch:
            dist.all_reduce(pair)
            pair /= w
        losses[n] = pair.tolist()
    if rank != 0:
        return None
    return dict(what=what, world=w, ref=ref, times=times, skipped=skipped, setup=setup, losses=losses,
                programs=programs, collectives=collectives, cluster=cluster.name, phases=phases)


def profile_world(a, kind):
    """Warm up one contender, then profile a few of its steps on rank 0."""
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(a.threads)
    quiet_warnings()
    base, batch, tp, what = build(a, kind)
    c = make(a.profile, base, batch, tp, a, plan_cluster(a) if a.profile in OURS else None)
    for _ in range(a.warmup):
        c.step()
    dist.barrier()
    if dist.get_rank() != 0:
        for _ in range(a.profile_steps):
            c.step()
        return None
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.profile_steps):
            c.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile_rows)
    if a.trace:
        prof.export_chrome_trace(a.trace)
    program = c.model.program if a.profile in OURS else None
    return dict(what=what, table=table, program=program)


# ---- printing ------------------------------------------------------------------------------------

def median(xs):
    return statistics.median(xs)


def report(a, res):
    times, skipped = res["times"], res["skipped"]
    ms = {n: median(t) * 1e3 for n, t in times.items()}
    print(f"\n## {res['what']}; world {res['world']}")
    print(f"{len(next(iter(times.values()), []))} rounds after {a.warmup} warm-up rounds; ms per step "
          "(median; the slowest rank's)\n")
    peers = [n for n in PEERS if n in ms]
    best = min(peers, key=ms.get) if peers else None

    def cell(n):
        if n in ms:
            return f"{ms[n]:.1f}"
        return f"n/a ({skipped[n]})" if n in skipped else "not run"

    print("| contender | ms/step | autoshard / peer: ms (ratio of medians, median ratio) |")
    print("|---|---|---|")
    for peer, mine in PAIRS:
        p = best if peer == "best" else peer
        label = f"best peer ({PEERS[best]})" if peer == "best" and best else PEERS.get(peer, "best peer")
        left = cell(p) if p else "n/a"
        if mine in ms and p in ms:
            per_round = median([x / y for x, y in zip(times[mine], times[p])])
            right = f"{OURS[mine]}: {ms[mine]:.1f} ms ({ms[mine] / ms[p]:.2f}, {per_round:.2f})"
        else:
            right = f"{OURS[mine]}: {cell(mine)}"
        print(f"| {label} | {left} | {right} |")
    ref = res["ref"]
    first = {n: l[0] for n, l in res["losses"].items()}
    worst = max(first, key=lambda n: abs(first[n] - ref))
    ok = "ok" if abs(first[worst] - ref) <= 1e-5 * max(1.0, abs(ref)) else "MISMATCH"
    print(f"\nloss at step 0: single-device {ref:.6f}; largest difference {abs(first[worst] - ref):.1e} "
          f"({worst}): {ok}")
    last = {n: l[1] for n, l in res["losses"].items()}
    spread = max(last.values()) - min(last.values())
    print(f"loss after {a.warmup + a.rounds} steps: " + ", ".join(f"{n} {v:.6f}" for n, v in last.items())
          + f" (spread {spread:.1e})")
    print("set-up seconds (autoshard: capture, plan, shard; the first one built pays torch's one-time costs): "
          + ", ".join(f"{n} {s:.1f}" for n, s in res["setup"].items()))
    print("collectives per step on rank 0 (c10d calls, by the profiler; gloo runs a reduce_scatter as an "
          "all_reduce):")
    for n, counts in res["collectives"].items():
        print(f"  {n}: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"))
    for n, (_, summary, _) in res["programs"].items():
        print(f"{n}'s plan: {summary}")
    if res["programs"]:
        predicted = {n: cost * 1e3 for n, (_, _, cost) in res["programs"].items()}
        print(f"autoshard's cost model ({res['cluster']}) against the measured step, ms: "
              + ", ".join(f"{n} {predicted[n]:.1f} / {ms[n]:.1f}" for n in predicted if n in ms))
        print("  ranked by the model: " + " < ".join(sorted(predicted, key=predicted.get))
              + "; measured: " + " < ".join(sorted((n for n in predicted if n in ms), key=ms.get)))
    if a.program:
        for n, (program, _, _) in res["programs"].items():
            print(f"\n### {n}: the per-rank program\n{program}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt", "mlp", "both"), default="both")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10; --quick 4)")
    ap.add_argument("--warmup", type=int, default=2, help="rounds dropped first (default 2)")
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    g = ap.add_argument_group("GPT")
    g.add_argument("--d", type=int, default=256)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--seq", type=int, default=128)
    g = ap.add_argument_group("residual MLP")
    g.add_argument("--mlp-in", type=int, default=256)
    g.add_argument("--mlp-d", type=int, default=512)
    g.add_argument("--mlp-layers", type=int, default=4)
    g.add_argument("--mlp-classes", type=int, default=64)
    g.add_argument("--mlp-batch", type=int, default=128)
    g = ap.add_argument_group("training and planning")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--tp-prepare", type=int, choices=(0, 1), default=1,
                   help="DTensor TP: PrepareModuleInput on the attention, so its input's gradient is all-reduced "
                        "once rather than once per q, k, v (torchtitan's form; default 1)")
    g.add_argument("--reshard", type=int, choices=(0, 1), default=1,
                   help="reshard_after_forward of FSDP2 and of autoshard's fsdp (default 1, FSDP2's own default)")
    g.add_argument("--cluster", default=None,
                   help=f"what autoshard plans for: a preset ({', '.join(autoshard.PRESETS)}) or 'measure' "
                        f"where autoshard has it (default: {default_cluster()})")
    g.add_argument("--time-limit", type=float, default=60.0, help="autoshard's solver time limit, seconds")
    g = ap.add_argument_group("looking closer")
    g.add_argument("--program", action="store_true", help="print autoshard's per-rank programs (rank 0)")
    g.add_argument("--profile", choices=CONTENDERS, help="profile this contender on rank 0 instead of timing")
    g.add_argument("--profile-steps", type=int, default=3)
    g.add_argument("--profile-rows", type=int, default=25)
    g.add_argument("--trace", help="with --profile: also write a chrome trace here")
    ap.add_argument("--quick", action="store_true", help="world 2, small sizes, few rounds: about a minute")
    a = ap.parse_args()
    if a.quick:
        for k, v in dict(worlds=[2], d=64, heads=4, layers=2, vocab=512, seq=32, mlp_in=64, mlp_d=128,
                         mlp_layers=2, mlp_batch=64, rounds=4, time_limit=10.0).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    a.reshard = bool(a.reshard)
    a.cluster = a.cluster or default_cluster()
    models = ["gpt", "mlp"] if a.model == "both" else [a.model]

    print(f"torch {torch.__version__}, autoshard {autoshard.__version__}; gloo on CPU, {a.threads} thread(s) "
          f"per rank ({os.cpu_count()} cores here); worlds {a.worlds}; {a.rounds} rounds after "
          f"{a.warmup} warm-up; AdamW lr {a.lr}; FSDP reshard_after_forward={a.reshard}; DTensor TP "
          f"{'with' if a.tp_prepare else 'without'} PrepareModuleInput on the attention; "
          f"autoshard plans for: {a.cluster}")
    start = time.perf_counter()
    for world in a.worlds:
        with LocalWorld(world, timeout_s=600.0) as group:
            for kind in models:
                if a.profile:
                    res = group.run(profile_world, a, kind)[0]
                    print(f"\n## {res['what']}; world {world}; {a.profile}: {a.profile_steps} steps on rank 0, "
                          "by self CPU time\n")
                    print(res["table"])
                    if a.program and res["program"]:
                        print(res["program"])
                else:
                    t0 = time.perf_counter()
                    res = group.run(run_world, a, kind)[0]
                    report(a, res)
                    print(f"seconds: {time.perf_counter() - t0:.0f} in all; "
                          + ", ".join(f"{k} {v:.0f}" for k, v in res["phases"].items()))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
