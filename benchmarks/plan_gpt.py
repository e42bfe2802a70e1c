"""autoshard's plans for GPT stacks against hand-written plans, priced by the same cost model.

For each GPT configuration, on the meta device (no GPUs, no process group):

  autoshard   the solver's own plan, nothing pinned
  data par.   inputs split on the batch ("S(0)"), every parameter replicated ("B")
  Megatron    1-D tensor parallel storage: qkv/fc weights and biases split by rows ("S(0)"),
              proj/fc2 weights split by columns ("S(1)"); everything else the solver's choice.
              Pinning where parameters live does not pin how they are used: the solver may
              all-gather the weights and compute on a split batch (ZeRO-3 style).
  Megatron+   the same, and the matmuls pinned to compute tensor parallel: qkv/fc outputs split
              on features ("S(2)"), proj/fc2 outputs partial sums ("P"), as Megatron-LM runs them

Each hand plan is a pinned autoshard.plan, so all three are estimated step times under one cost
model. The ratio hand / autoshard is >= 1.0 wherever autoshard's plan is no worse.

    python benchmarks/plan_gpt.py
    python benchmarks/plan_gpt.py --layers 24 --d 2048 --batch 512 --world 512 --cluster h100-80gb-nvlink-ib
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard


class Block(nn.Module):
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
        self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def data_parallel_pins(model):
    pins = {"idx": ("S(0)",), "targets": ("S(0)",)}
    pins.update({name: ("B",) for name, _ in model.named_parameters(remove_duplicate=False)})
    return pins


MEGATRON_BLOCK = {"qkv.weight": ("S(0)",), "qkv.bias": ("S(0)",), "proj.weight": ("S(1)",),
                  "fc.weight": ("S(0)",), "fc.bias": ("S(0)",), "fc2.weight": ("S(1)",)}


def megatron_pins(model):
    return {f"blocks.{i}.{name}": p for i in range(len(model.blocks)) for name, p in MEGATRON_BLOCK.items()}


def megatron_matmul_pins(plan, layers):
    """Pin the graph nodes of each block's four matmuls (qkv, proj, fc, fc2, in graph order)."""
    linears = [n.name for n in plan.nodes.values() if n.op == "linear.default"]
    assert len(linears) == 4 * layers + 1, f"expected 4 matmuls per block and the head, got {len(linears)}"
    pins = {}
    for i in range(layers):
        qkv, proj, fc, fc2 = linears[4 * i: 4 * i + 4]
        pins.update({qkv: ("S(2)",), proj: ("P",), fc: ("S(2)",), fc2: ("P",)})
    return pins


def timed_plan(model, inputs, args, pin=None):
    start = time.perf_counter()
    plan = autoshard.plan(model, inputs, world=args.world, cluster=args.cluster, pin=pin,
                          time_limit=args.time_limit)
    return plan, time.perf_counter() - start


def status(plan):
    s = plan.solver
    text = s["status"].lower()
    return text if not s["gap"] else f"{text} ({100 * s['gap']:.1f}% gap)"


def broadcast(values, n, flag):
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SystemExit(f"{flag} takes one value or {n} (one per configuration), got {len(values)}")
    return values


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24], help="blocks per configuration")
    ap.add_argument("--d", type=int, nargs="+", default=[1024, 1536, 2048], help="model width (one, or one per configuration)")
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 512, 512], help="sequences per step (one, or one per configuration)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--head-dim", type=int, default=64, help="width of one attention head")
    ap.add_argument("--world", type=int, default=256, help="devices to plan for")
    ap.add_argument("--cluster", default=None, help=f"cluster preset, one of {sorted(autoshard.PRESETS)} "
                                                     "(default: autoshard's default)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    args = ap.parse_args()

    n = len(args.layers)
    configs = list(zip(args.layers, broadcast(args.d, n, "--d"), broadcast(args.batch, n, "--batch")))
    cluster_name = args.cluster or autoshard.api.DEFAULT_CLUSTER
    print(f"GPT stacks planned for {args.world} devices on {cluster_name}; seq {args.seq}, vocab {args.vocab}, "
          f"training, estimated step times\n")

    header = ("layers", "d", "batch", "params", "autoshard", "comm", "data par.", "Megatron", "Megatron+",
              "DP/auto", "TP/auto", "TP+/auto", "plan time", "solver")
    rows = []
    notes = []
    for layers, d, batch in configs:
        with torch.device("meta"):
            model = GPT(args.vocab, d, d // args.head_dim, layers, args.seq)
            inputs = (torch.randint(0, args.vocab, (batch, args.seq)), torch.randint(0, args.vocab, (batch, args.seq)))
        nparams = sum(p.numel() for p in model.parameters())
        auto, seconds = timed_plan(model, inputs, args)
        dp, _ = timed_plan(model, inputs, args, data_parallel_pins(model))
        tp, _ = timed_plan(model, inputs, args, megatron_pins(model))
        tpx, _ = timed_plan(model, inputs, args, {**megatron_pins(model), **megatron_matmul_pins(auto, layers)})
        comm = sum(c.seconds for c in auto.collectives)
        for label, p in (("data parallel", dp), ("Megatron", tp), ("Megatron+", tpx)):
            if p.solver["status"] != "OPTIMAL":
                notes.append(f"{layers} layers, d={d}: the {label} plan's solve ended {status(p)}")
        rows.append((str(layers), str(d), str(batch), f"{nparams / 1e6:.0f}M",
                     f"{auto.cost:.3f} s", f"{100 * comm / auto.cost:.0f}%", f"{dp.cost:.3f} s",
                     f"{tp.cost:.3f} s", f"{tpx.cost:.3f} s", f"{dp.cost / auto.cost:.3f}x",
                     f"{tp.cost / auto.cost:.3f}x", f"{tpx.cost / auto.cost:.3f}x",
                     f"{seconds:.1f} s", status(auto)))
        print(f"  planned {layers} layers, d={d}, batch {batch} in {seconds:.1f} s", flush=True)

    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i < len(r) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    print()
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print("\ncomm: the share of autoshard's estimated step spent in collectives.\n"
          "DP/auto, TP/auto, TP+/auto: a hand plan's estimated step time over autoshard's (>= 1.000x: autoshard "
          "is no worse).\nplan time: wall time of autoshard.plan (capture, annotate, solve) for autoshard's own plan.")
    for note in notes:
        print("note: " + note)


if __name__ == "__main__":
    main()
