"""How long planning takes at scale, phase by phase, beside one torch.export of the same model.

    python benchmarks/plan_scale.py              # 96-layer GPT (d=2048) at world 1024, mesh search
    python benchmarks/plan_scale.py --tiny       # tiny HuggingFace models at world 8, mesh search
    python benchmarks/plan_scale.py --tiny --first-call   # and parallelize's first call on 8 gloo processes
    python benchmarks/plan_scale.py --llama      # Llama-3-style, dim 2048, 16 layers, fixed mesh (8, 8)
    python benchmarks/plan_scale.py --pipeline   # GPT-3 175B at 1024: search with pipelines and without;
                                                 # Megatron-LM's tensor 8 x pipeline 8 x data 16 priced
    python benchmarks/plan_scale.py --llama405b  # Llama 3 405B at 16,384 H100s: tensor 8 x pipeline 16 x data 128
                                                 # priced; search with pipelines and without (not --published; --search: it alone)

Everything runs on the meta device, with no process group. The phases are those of
``autoshard.planner.progress.CLOCK`` (capture, annotate, cost, build, solve, descend), each
exclusive of the phases inside it, summed over the processes the search shares its meshes
out to (``planner.fanout``: one per core, at most 8; ``--alone`` plans in one process first, for
comparison). torch.export runs once in the same process, before planning,
on the same model and inputs: the ratio is planning's time (without its own capture, which is
that export again) over export's. The estimated step is printed beside the one autoshard chose
before this benchmark existed (``BEFORE``, measured at commit 1dc2334 on the same 2-core machine),
with the model-FLOPs utilization it implies (``mfu``: the GPT's FLOPs per step, Megatron-LM's
count, over step time times world times the cluster's peak at the model's dtype).
"""
import argparse
import math
import os
import resource
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.planner import fanout
from autoshard.planner.progress import CLOCK, PHASES
from plan_gpt import GPT

CLUSTER = "a100-80gb-nvlink-ib"
# measured at 1dc2334 (before the planner reused annotation and costs): the chosen mesh, its
# estimated step and memory per rank, and planning's time beside export's in the same run
BEFORE = {"gpt96": dict(mesh=(128, 8), step=1.083995, memory=79.53e9, plan=98.8, export=4.23)}


def phases() -> str:
    return "  ".join(f"{k} {CLOCK.seconds[k]:.2f}" for k in PHASES)


def mfu(model, inputs, step: float, world: int, cluster) -> float:
    """Model FLOPs per step (Megatron-LM's count for a GPT: 72 B s l h^2 (1 + s/6h + V/12hl), no
    recomputation) over what ``world`` devices do in ``step`` seconds at the cluster's peak."""
    b, s = inputs[0].shape
    h, layers, vocab = model.emb.weight.shape[1], len(model.blocks), model.emb.weight.shape[0]
    flops = 72 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * h * layers))
    dtype = model.emb.weight.dtype
    peak = cluster.matmul_flops(dtype.itemsize)
    return flops / (step * world * peak)


def gpt(layers, d, heads, batch, seq=2048, vocab=50304):
    with torch.device("meta"):
        model = GPT(vocab, d, heads, layers, seq)
    idx = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (idx, idx)


def timed_export(model, inputs) -> float:
    start = time.perf_counter()
    torch.export.export(model, inputs, strict=False)
    return time.perf_counter() - start


def cpu_seconds() -> tuple:
    """CPU seconds of this process and of its children that have ended (the search's copies)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def plan_gpt(name, model, inputs, world, before=None, alone=False):
    """Plan with mesh search; print phases, export, ratio, step, MFU, memory. ``alone``: plan
    in one process too (``AUTOSHARD_PLAN_WORKERS=1``), first."""
    cluster = autoshard.Cluster.preset(CLUSTER)
    export = timed_export(model, inputs)
    print(f"\n== {name}: mesh search at world {world} ==")
    if alone:
        os.environ[fanout.ENV] = "1"
        CLOCK.reset()
        start = time.perf_counter()
        autoshard.plan(model, inputs, world=world, cluster=CLUSTER, verbose=False)
        planning = time.perf_counter() - start - CLOCK.seconds["capture"]
        print(f"in one process: phases (s): {phases()}; plan without capture {planning:.1f} s; "
              f"ratio {planning / export:.2f}")
        del os.environ[fanout.ENV]
    processes = fanout.available()
    CLOCK.reset()
    cpu = cpu_seconds()
    start = time.perf_counter()
    plan = autoshard.plan(model, inputs, world=world, cluster=CLUSTER)
    total = time.perf_counter() - start
    fanout.reap(wait=True)   # the copies, which the search told to end and did not wait for
    cpu = [b - a for a, b in zip(cpu, cpu_seconds())]
    planning = total - CLOCK.seconds["capture"]
    print(f"in up to {processes} processes (planner.fanout): phases (s, summed over the processes): {phases()}")
    print(f"plan {total:.1f} s (without capture {planning:.1f} s; CPU {cpu[0]:.1f} s here, {cpu[1]:.1f} s in the "
          f"search's copies); torch.export {export:.1f} s; ratio {planning / export:.2f} (with capture {total / export:.2f})")
    used = plan.memory["total"]
    print(f"chose {plan.mesh_shape}: estimated step {plan.cost:.4f} s, MFU {100 * mfu(model, inputs, plan.cost, world, cluster):.1f}%, "
          f"{used / 1e9:.2f} GB per rank (budget {plan.memory['budget'] / 1e9:.0f} GB); solver "
          f"{plan.solver['status'].lower()}; {plan.solver.get('mesh_choice', '')}")
    if before:
        print(f"before (1dc2334): {before['mesh']}: estimated step {before['step']:.4f} s, "
              f"MFU {100 * mfu(model, inputs, before['step'], world, cluster):.1f}%, {before['memory'] / 1e9:.2f} GB per rank; "
              f"plan {before['plan']:.1f} s beside export {before['export']:.1f} s (ratio {before['plan'] / before['export']:.1f}); "
              f"now / before: step {plan.cost / before['step']:.4f}")
    fates: dict = {}
    for c in plan.mesh_candidates:
        fate = c["status"].split(":")[0].split(" (")[0]
        fates[fate] = fates.get(fate, 0) + 1
    print(f"{len(plan.mesh_candidates)} meshes: " + ", ".join(f"{k} {v}" for k, v in sorted(fates.items(), key=lambda kv: -kv[1])))
    return plan


# ---- a Llama-3-style model (meta-pytorch/autoparallel's example shape), RoPE in real numbers ------

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    """Rotary position embedding in real numbers (no complex view), so attention can be split."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class LlamaLayer(nn.Module):
    def __init__(self, d, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv_heads, d // heads
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wk, self.wv = nn.Linear(d, kv_heads * self.hd, bias=False), nn.Linear(d, kv_heads * self.hd, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = rotate(self.wq(h).view(b, t, self.heads, self.hd).transpose(1, 2), cos, sin)
        k = rotate(self.wk(h).view(b, t, self.kv, self.hd).transpose(1, 2), cos, sin)
        v = self.wv(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        rep = self.heads // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, t, self.hd).reshape(b, self.heads, t, self.hd)
        v = v[:, :, None].expand(b, self.kv, rep, t, self.hd).reshape(b, self.heads, t, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, dim=2048, layers=16, heads=16, kv_heads=8, vocab=128256, seq=2048, multiple_of=256,
                 ffn_multiplier=1.0):
        super().__init__()
        hidden = multiple_of * math.ceil(int(ffn_multiplier * int(2 * 4 * dim / 3)) / multiple_of)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaLayer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        inv = 1.0 / 500000.0 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads))
        angles = torch.outer(torch.arange(seq).float(), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets=None):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def llama(args):
    with torch.device("meta"):
        model = Llama(layers=args.layers or 16)
    tokens = torch.empty(16, 2048, dtype=torch.long, device="meta")   # autoparallel's: 2 sequences per dp rank
    CLOCK.reset()
    start = time.perf_counter()
    plan = autoshard.plan(model, (tokens,), mesh=(8, 8), cluster=CLUSTER, time_limit=args.time_limit)
    s = plan.solver
    print(f"\n== Llama-3-style, dim 2048, {args.layers or 16} layers, seq 2048, batch 16, fixed mesh (8, 8) ==")
    print(f"phases (s): {phases()}")
    print(f"planned in {time.perf_counter() - start:.1f} s: solver {s['status'].lower()} in {s['seconds']:.1f} s, "
          f"gap {100 * (s['gap'] or 0):.2f}%; estimated step {plan.cost * 1e3:.2f} ms, "
          f"{plan.memory['total'] / 1e9:.2f} GB per rank")


# ---- tiny HuggingFace models (2 layers, hidden 32-64), none of them in the tests ---------------------

def tiny_models():
    import transformers
    vocab, seq, batch = 128, 8, 8

    def tokens(seed):
        return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    t5 = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                               num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    qwen2 = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    opt = transformers.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=seq, word_embed_proj_dim=32, dropout=0.0)
    vit = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=4, num_labels=10, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    whisper = transformers.WhisperConfig(vocab_size=vocab, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, d_model=32,
                                         encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                                         max_target_positions=seq, dropout=0.0, decoder_start_token_id=0, pad_token_id=0)
    return {
        "T5 (encoder-decoder)": lambda: (transformers.T5ForConditionalGeneration(t5),
                                         dict(input_ids=tokens(1), labels=tokens(2), use_cache=False)),
        "Qwen2 (decoder)": lambda: (transformers.Qwen2ForCausalLM(qwen2),
                                    dict(input_ids=tokens(3), labels=tokens(4), use_cache=False)),
        "OPT (decoder)": lambda: (transformers.OPTForCausalLM(opt),
                                  dict(input_ids=tokens(5), labels=tokens(6), use_cache=False)),
        "ViT (vision)": lambda: (transformers.ViTForImageClassification(vit),
                                 dict(pixel_values=torch.randn(batch, 3, 16, 16), labels=torch.randint(0, 10, (batch,)))),
        "Whisper (speech)": lambda: (transformers.WhisperForConditionalGeneration(whisper),
                                     dict(input_features=torch.randn(batch, 16, 32), labels=tokens(7), use_cache=False)),
    }


# each tiny model's plan with mesh search at a4a720d, before the coarse bound (planner.coarse): its
# estimated step (us) and the search's CPU seconds on the same 2-core machine, loaded by others
BEFORE_TINY = {"T5 (encoder-decoder)": (10.059416209895807, 6.71), "Qwen2 (decoder)": (10.66961178723957, 4.86),
               "OPT (decoder)": (3.595866651822915, 1.71), "ViT (vision)": (5.82892111903483, 1.54),
               "Whisper (speech)": (13.113750706249991, 4.99)}


def tiny(args):
    print(f"\n== tiny HuggingFace models, mesh search at world 8 beside the fixed mesh (8,) ==")
    print("times: wall (CPU) seconds of plan(), capture included")
    for name, build in tiny_models().items():
        torch.manual_seed(0)
        model, inputs = build()
        times = {}
        for label, kw in (("search", dict(world=8)), ("fixed (8,)", dict(mesh=(8,)))):
            CLOCK.reset()
            start, cpu = time.perf_counter(), time.process_time()
            plan = autoshard.plan(model, inputs, cluster=CLUSTER, verbose=False, **kw)
            times[label] = (time.perf_counter() - start, time.process_time() - cpu, phases(), plan)
        (ts, cs, ps, plan), (tf, cf, _, fixed) = times["search"], times["fixed (8,)"]
        step, cpu = BEFORE_TINY[name]
        fates = ", ".join(f"{tuple(c['mesh'])} {c['status'].split(':')[0]}" for c in plan.mesh_candidates)
        print(f"{name}: search {ts:.2f} s ({cs:.2f} CPU) -> {plan.mesh_shape} {plan.cost * 1e6:.4f} us; "
              f"fixed (8,) {tf:.2f} s ({cf:.2f} CPU) {fixed.cost * 1e6:.4f} us\n"
              f"    before (a4a720d): {step:.4f} us, search {cpu:.2f} s CPU; now / before: step {plan.cost * 1e6 / step:.6f}\n"
              f"    search phases (s): {ps}\n    meshes: {fates}")
    if args.first_call:
        first_calls()


def first_call(name):
    """On each rank: parallelize the tiny model (mesh search at the group's size) and time its
    first call, which captures, plans (rank 0, the others wait for its plan), shards, rewrites
    and runs forward; rank 0's wall and CPU seconds, and planning's part of them (its phases
    but capture)."""
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, inputs = tiny_models()[name]()
    pm = autoshard.parallelize(model, world=dist.get_world_size(), cluster=CLUSTER, verbose=False)
    CLOCK.reset()
    start, cpu = time.perf_counter(), time.process_time()
    pm(**inputs)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, sum(v for k, v in CLOCK.seconds.items() if k != "capture"), pm.plan.mesh_shape


def first_calls(world=8):
    from autoshard.testing.launch import LocalWorld
    print(f"\n== the first call of parallelize at world {world} (gloo, {world} processes on this machine): "
          "rank 0's seconds ==")
    with LocalWorld(world, timeout_s=600.0) as group:
        for name in tiny_models():
            wall, cpu, planning, mesh = group.run(first_call, name)[0]
            print(f"{name}: first call {wall:.2f} s ({cpu:.2f} CPU), of which planning {planning:.2f} s "
                  f"({100 * planning / wall:.0f}%); mesh {mesh}")


def timed_search(model, inputs, world, cluster):
    """The mesh search without pipelines (``pipeline=1``) and with (``pipeline=None``), each
    timed; the plans."""
    timings, plans = {}, {}
    for name, extra in (("without pipelines", dict(pipeline=1)), ("with pipelines", {})):
        start = time.perf_counter()
        plans[name] = autoshard.plan(model, inputs, world=world, cluster=cluster, verbose=False, **extra)
        timings[name] = time.perf_counter() - start
        fanout.reap(wait=True)
        p = plans[name]
        print(f"{name:<18} {timings[name]:>6.1f} s  {type(p).__name__} mesh {tuple(p.mesh_shape)}  "
              f"estimated step {p.cost:.3f} s")
    print(f"search with pipelines / without: {timings['with pipelines'] / timings['without pipelines']:.2f}x")
    return plans["with pipelines"]


# Megatron-LM's tensor parallel of a Llama layer on a stage's (data, tensor) axes: the projections
# in split by their output rows, those out by their input columns; the norms whole
LLAMA_MEGATRON = {**{f"{w}.weight": ("B", "S(0)") for w in ("wq", "wk", "wv", "w1", "w3")},
                  **{f"{w}.weight": ("B", "S(1)") for w in ("wo", "w2")}}


def llama_405b(args):
    """Llama 3 405B's published shape (126 layers, dim 16,384, 128 heads, 8 key/value heads, FFN
    53,248, vocabulary 128,256), 8,192-token sequences, 2,048 of them a step (16M tokens), on
    16,384 H100s: its published configuration (tensor 8 x pipeline 16 x data 128, 16 microbatches
    of one sequence per data rank, 1F1B; the layers Megatron-pinned) priced, with the stage plans
    solved and reused counted (stages alike are planned once: ``planner.alike``); then, unless
    ``--published``, the mesh search with pipelines and without, timed, the planner's own plan
    beside the published one (``--search``: the search alone)."""
    import autoshard.api as api
    layers = args.layers or 126
    with torch.device("meta"):
        model = Llama(dim=16384, layers=layers, heads=128, kv_heads=8, vocab=128256, seq=8192, multiple_of=4096,
                      ffn_multiplier=1.2)
    tokens = torch.empty(2048, 8192, dtype=torch.long, device="meta")
    cluster = "h100-80gb-nvlink-ib"
    print(f"== Llama 3 405B shape ({layers} layers, d=16384, FFN {model.layers[0].w1.out_features}), "
          f"batch 2048 x 8192, world 16384, {cluster} ==", flush=True)
    if args.search:
        timed_search(model, (tokens, tokens), 16384, cluster)
        return
    pins = {f"layers.{i}.{k}": v for i in range(layers) for k, v in LLAMA_MEGATRON.items()}
    solves, plan_graph = [], api.plan_graph

    def counted(graph, mesh_shape, options):   # the stage plans solved (the alike ones are not)
        solves.append(graph)
        return plan_graph(graph, mesh_shape, options)
    api.plan_graph = counted
    start = time.perf_counter()
    try:
        published = autoshard.plan(model, (tokens, tokens), world=16384, mesh=(16, 128, 8), pipeline=16,
                                   microbatches=16, pin=pins, cluster=cluster, verbose=False)
    finally:
        api.plan_graph = plan_graph
    fanout.reap(wait=True)
    print(f"published tensor 8 x pipeline 16 x data 128, 16 microbatches ({published.schedule}), pinned: estimated "
          f"step {published.cost:.3f} s, bubble {published.bubble:.3f}; priced in {time.perf_counter() - start:.1f} s, "
          f"{len(solves)} stage plans solved for {len(published.stages)} stages", flush=True)
    print(published, flush=True)
    if args.published:
        return
    own = timed_search(model, (tokens, tokens), 16384, cluster)
    print(f"autoshard's own plan / the published configuration's: {own.cost / published.cost:.3f}")


def pipelines(args):
    """GPT-3 175B (96 blocks, d=12288, 96 heads, batch 1536 x 2048, vocab 50304) on 1,024 A100s:
    the mesh search without pipelines (``pipeline=1``) and with (``pipeline=None``), timed; and
    Megatron-LM's published configuration (pipeline 8, data 16, tensor 8 within a node, 96
    microbatches of 16 sequences, its blocks Megatron-pinned) priced by the same model, under 1F1B
    and interleaved as Megatron ran it (``--virtual`` chunks of blocks per rank, ``virtual=``)."""
    from plan_gpt import MEGATRON_BLOCK
    layers = args.layers or 96
    model, inputs = gpt(layers, 12288, 96, 1536)
    print(f"== GPT-3 175B shape ({layers} blocks, d=12288), batch 1536 x 2048, world 1024, {CLUSTER} ==")
    own = timed_search(model, inputs, 1024, CLUSTER)
    pins = {f"blocks.{i}.{k}": ("B",) + v for i in range(layers) for k, v in MEGATRON_BLOCK.items()}
    start = time.perf_counter()
    one_f_one_b = autoshard.plan(model, inputs, world=1024, mesh=(8, 16, 8), pipeline=8, microbatches=96,
                                 pin=pins, cluster=CLUSTER, verbose=False)
    print(f"Megatron-LM tensor 8 x pipeline 8 x data 16, 96 microbatches (1F1B), pinned: estimated step "
          f"{one_f_one_b.cost:.3f} s ({time.perf_counter() - start:.1f} s to price)")
    start = time.perf_counter()
    megatron = autoshard.plan(model, inputs, world=1024, mesh=(8, 16, 8), pipeline=8, microbatches=96, pin=pins,
                              virtual=args.virtual, cluster=CLUSTER, verbose=False)
    print(f"Megatron-LM tensor 8 x pipeline 8 x data 16, 96 microbatches ({megatron.schedule}, {args.virtual} "
          f"chunks of blocks per rank), pinned: estimated step {megatron.cost:.3f} s "
          f"({time.perf_counter() - start:.1f} s to price)")
    print(f"autoshard's own plan / Megatron-LM's: {own.cost / megatron.cost:.3f} interleaved, "
          f"{own.cost / one_f_one_b.cost:.3f} under 1F1B")
    print()
    print(megatron)
    print()
    print(own)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny HuggingFace models at world 8")
    ap.add_argument("--first-call", action="store_true",
                    help="with --tiny: also time parallelize's first call on 8 local gloo processes")
    ap.add_argument("--llama", action="store_true", help="the Llama-3-style model on the fixed mesh (8, 8)")
    ap.add_argument("--pipeline", action="store_true", help="GPT-3 175B at 1024 with pipelines and without")
    ap.add_argument("--llama405b", action="store_true",
                    help="Llama 3 405B at 16,384 H100s: its published configuration priced, and the search with "
                         "pipelines and without")
    ap.add_argument("--published", action="store_true", help="with --llama405b: price the published configuration only")
    ap.add_argument("--search", action="store_true", help="with --llama405b: the search with pipelines and without only")
    ap.add_argument("--layers", type=int, default=None, help="blocks of the default GPT (96) or the Llama (16)")
    ap.add_argument("--virtual", type=int, default=2,
                    help="with --pipeline: chunks of blocks per rank of Megatron-LM's interleaved schedule")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--alone", action="store_true", help="plan the GPT in one process too, first, for comparison")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.tiny:
        return tiny(args)
    if args.llama:
        return llama(args)
    if args.pipeline:
        return pipelines(args)
    if args.llama405b:
        return llama_405b(args)
    layers = args.layers or 96
    plan_gpt(f"GPT {layers} layers, d=2048, 16 heads, batch 1024 x 2048, vocab 50304", *gpt(layers, 2048, 16, 1024),
             1024, before=BEFORE["gpt96"] if layers == 96 else None, alone=args.alone)


if __name__ == "__main__":
    sys.exit(main())
