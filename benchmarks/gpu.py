"""What one GPU shows: the emitted program on CUDA tensors, and the compute side of the cost model
measured there, beside the preset a plan for that GPU is priced on.

    python benchmarks/gpu.py --out DIR        # on a machine with one NVIDIA GPU: about 2 minutes
    python benchmarks/gpu.py --device cpu     # the same steps on the CPU, a dry run of the script

Three parts, each printed as it ends, so a run cut short still shows what it reached:

1. ``autoshard.measure`` inside a process group of one rank (NCCL on a GPU): the cost model's own
   figures (matmul FLOP/s at fp32 and bf16 on its small timed shapes, memory bandwidth, the launch
   overhead per op in forward and per autograd node in backward), then square matmuls of growing
   size timed directly, and each figure over the preset's (``--preset``): the efficiency the preset
   should assume. ``DIR/cluster.json`` holds the measured cluster.
2. The emitted program on CUDA tensors: a GPT parallelized on the mesh (1,) against the same
   model, unparallelized, and against DDP and FSDP2 on the same group of one: the loss's and gradients' largest differences after one step (fp32,
   then a bf16 policy with fp32 masters, against the same model under bf16 autocast), and ms per
   training step of each, taking turns, medians.
3. Two processes on one GPU in an NCCL group: NCCL does not put two ranks on one device; the
   script tries with a deadline and prints what the group said, so a machine that allows it
   (more than one GPU) runs a Megatron-pinned GPT step across them.

Nothing in the test suite depends on this script.
"""
import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autoshard  # noqa: E402
from plan_gpt import GPT  # noqa: E402

SIZES = (1024, 2048, 4096, 8192)     # square matmuls timed directly
DTYPES = (torch.float32, torch.bfloat16)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, calls: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _init_group(device, port: int):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120),
                            **({"device_id": device} if device.type == "cuda" else {}))
    return backend


def measure_compute(device, preset: str, out: str) -> dict:
    """Part 1: the measured cluster beside the preset, and large matmuls timed directly."""
    base = autoshard.Cluster.preset(preset)
    start = time.perf_counter()
    cluster = autoshard.measure(base, name=f"measured-{device.type}")
    took = time.perf_counter() - start
    if out:
        cluster.save(os.path.join(out, "cluster.json"))
    fig = {"measure_s": took, "fp32": cluster.peak_flops_fp32, "bf16": cluster.peak_flops,
           "memory": cluster.memory_bandwidth, "launch_fwd": cluster.op_overhead,
           "launch_bwd": cluster.backward_overhead}
    print(f"\n== 1. autoshard.measure on {device} ({took:.1f} s), beside the {preset} preset ==")
    print(f"matmul fp32 {fig['fp32'] / 1e12:.2f} TFLOP/s ({fig['fp32'] / base.peak_flops_fp32:.2f} of the preset's "
          f"{base.peak_flops_fp32 / 1e12:.0f}); bf16 {fig['bf16'] / 1e12:.2f} TFLOP/s "
          f"({fig['bf16'] / base.peak_flops:.2f} of {base.peak_flops / 1e12:.0f}); the cost model's small timed shapes")
    print(f"memory {fig['memory'] / 1e9:.0f} GB/s ({fig['memory'] / base.memory_bandwidth:.2f} of the preset's "
          f"{base.memory_bandwidth / 1e9:.0f}); launch {1e6 * fig['launch_fwd']:.1f} us per op forward, "
          f"{1e6 * fig['launch_bwd']:.1f} us per autograd node backward (the preset prices none)")
    for family, fwd, bwd in cluster.kernels:
        print(f"  kernel family {family}: forward {fwd:.3g}, backward {bwd:.3g} (FLOP/s or bytes/s)")
    print("square matmuls, timed directly (n x n times n x n):")
    print("| n | " + " | ".join(f"{str(d).split('.')[-1]} TFLOP/s | of preset" for d in DTYPES) + " |")
    print("|---|" + "---|---|" * len(DTYPES))
    rows = {}
    for n in SIZES if device.type == "cuda" else SIZES[:2]:
        cells = []
        for dtype in DTYPES:
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            ms = _median_ms(lambda: a @ b, device, calls=20 if device.type == "cuda" else 3)
            rate = 2 * n ** 3 / (ms / 1e3)
            rows[(n, str(dtype))] = rate
            cells.append(f"{rate / 1e12:.1f} | {rate / base.matmul_flops(dtype.itemsize):.2f}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    fig["matmuls"] = {f"{n} {d}": r for (n, d), r in rows.items()}
    return fig, cluster


def _gpt(device, sizes, seed=0):
    torch.manual_seed(seed)
    model = GPT(sizes["vocab"], sizes["d"], sizes["heads"], sizes["layers"], sizes["seq"]).to(device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    idx = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g).to(device)
    tgt = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g).to(device)
    return model, (idx, tgt)


def _largest_grad_gap(pm, ref) -> float:
    ref_params = dict(ref.named_parameters())
    gaps = []
    for n, p in pm.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref_params[n].grad
        gaps.append(((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item())
    return max(gaps)


def _phases_ms(pm, opt, inputs, device) -> tuple:
    """One step of ``pm`` timed phase by phase: (forward, backward, optimizer) ms."""
    opt.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    loss = pm(*inputs)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    opt.step()
    _sync(device)
    t3 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)


def emitted_program(device, sizes, steps: int, cluster=None) -> dict:
    """Part 2: the parallel GPT on mesh (1,) against the plain one, exactness then speed; with a
    measured ``cluster``, the plan's predicted phases beside the program's measured ones."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    print(f"\n== 2. the emitted program on {device}: GPT d={sizes['d']}, {sizes['layers']} blocks, "
          f"batch {sizes['batch']} x {sizes['seq']}, mesh (1,) ==")
    fig = {}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for label, policy in (("fp32", None), ("bf16 policy", bf16)):
        model, inputs = _gpt(device, sizes)
        ref = copy.deepcopy(model)
        peers = _peers(model, policy, device)
        pm = autoshard.parallelize(model, inputs, mesh=(1,), **({"mp_policy": policy} if policy else {}))
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=policy is not None)
        loss = pm(*inputs)
        loss.backward()
        with autocast:
            ref_loss = ref(*inputs)
        ref_loss.backward()
        loss_gap = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        grad_gap = _largest_grad_gap(pm, ref)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)

        def step(m, o, ac):
            o.zero_grad(set_to_none=True)
            with ac:
                out = m(*inputs)
            out.backward()
            o.step()

        off = torch.autocast(device.type, enabled=False)
        contenders = [("autoshard", pm, opt, off),
                      ("plain", ref, ref_opt, torch.autocast(device.type, dtype=torch.bfloat16,
                                                             enabled=policy is not None))]
        contenders += [(name, m, torch.optim.AdamW(m.parameters(), lr=1e-4), ac) for name, m, ac in peers]
        times = {name: [] for name, *_ in contenders}
        for i in range(steps + 2):   # two warm-up rounds, then they take turns
            for name, m, o, ac in contenders:
                _sync(device)
                start = time.perf_counter()
                step(m, o, ac)
                _sync(device)
                if i >= 2:
                    times[name].append(1e3 * (time.perf_counter() - start))
        ms = {k: statistics.median(v) for k, v in times.items()}
        fig[label] = dict(loss_gap=loss_gap, grad_gap=grad_gap, **{f"{k}_ms": v for k, v in ms.items()})
        if cluster is not None:
            phases = [_phases_ms(pm, opt, inputs, device) for _ in range(steps)]
            measured = [statistics.median(p[i] for p in phases) for i in range(3)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=policy is not None):
                plain = [_phases_ms(ref, ref_opt, inputs, device) for _ in range(steps)]
            plain = [statistics.median(p[i] for p in plain) for i in range(3)]
            fig[label]["phases_plain_ms"] = plain
            priced = autoshard.plan(_gpt(torch.device("meta"), sizes)[0], inputs, mesh=(1,), cluster=cluster,
                                    verbose=False, **({"mp_policy": policy} if policy else {}))
            b = priced.breakdown
            predicted = [1e3 * b["compute_fwd"], 1e3 * b["compute_bwd"], 1e3 * b.get("optimizer", 0.0)]
            fig[label]["phases_measured_ms"], fig[label]["phases_predicted_ms"] = measured, predicted
            fig[label]["step_predicted_ms"] = 1e3 * priced.cost
            print(f"  on the measured cluster, predicted / measured ms: step {1e3 * priced.cost:.2f} / "
                  f"{sum(measured):.2f}; " + ", ".join(f"{name} {p:.2f} / {m:.2f}" for name, p, m in
                                                      zip(("forward", "backward", "optimizer"), predicted, measured))
                  + "; the plain model's measured: " + ", ".join(f"{m:.2f}" for m in plain), flush=True)
        print(f"{label}: loss {loss.item():.5f} vs {ref_loss.item():.5f} (relative gap {loss_gap:.1e}); largest "
              f"gradient gap {grad_gap:.1e} of its tensor's largest; ms/step autoshard {ms['autoshard']:.2f}, "
              + ", ".join(f"{k} {v:.2f} ({ms['autoshard'] / v:.2f})" for k, v in ms.items() if k != "autoshard")
              + f"; medians of {steps}", flush=True)
    return fig


def _peers(model, policy, device) -> list:
    """(name, module, autocast) of what a user would run instead on one GPU of a group of one,
    each from ``model``'s weights: DDP (under autocast where a policy is asked for: DDP has
    none) and FSDP2 with the policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(copy.deepcopy(model), device_ids=[device.index] if device.type == "cuda" else None)
    fsdp = copy.deepcopy(model)
    kw = {"mp_policy": policy or MixedPrecisionPolicy()}
    for block in fsdp.blocks:
        fully_shard(block, **kw)
    fully_shard(fsdp, **kw)
    auto = torch.autocast(device.type, dtype=torch.bfloat16, enabled=policy is not None)
    return [("DDP", ddp, auto), ("FSDP2", fsdp, torch.autocast(device.type, enabled=False))]


def profile(device, sizes, out: str) -> None:
    """Part 2b: three fp32 steps of each, under torch.profiler: the ops that take the most host
    time (where the emitted program's time goes beyond its kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled
    model, inputs = _gpt(device, sizes)
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, mesh=(1,))
    print(f"\n== 2b. torch.profiler, 3 fp32 steps each, d={sizes['d']} ==")
    for name, m in (("autoshard", pm), ("plain", ref)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        for _ in range(3):
            _phases_ms(m, opt, inputs, device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profiled(activities=activities) as prof:
            for _ in range(3):
                _phases_ms(m, opt, inputs, device)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        if out:
            with open(os.path.join(out, f"profile_{name}.txt"), "w") as f:
                f.write(table)
        print(f"{name}:\n" + "\n".join(table.splitlines()[:14]), flush=True)


def _two_ranks(sizes):
    """On each rank of the 2-process NCCL group: one Megatron-pinned step, its loss."""
    from autoshard import schemes
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    model, inputs = _gpt(device, sizes)
    pm = autoshard.parallelize(model, inputs, mesh=(2,), pin=schemes.megatron(model, inputs, (2,)))
    loss = pm(*inputs)
    loss.backward()
    return loss.item()


def two_processes(sizes) -> str:
    """Part 3: an NCCL group of two processes on this machine's GPUs."""
    from autoshard.testing.launch import LocalWorld
    print(f"\n== 3. two processes in an NCCL group on {torch.cuda.device_count()} GPU(s) ==")
    world = LocalWorld(2, backend="nccl", timeout_s=60)
    try:
        losses = world.run(_two_ranks, sizes)
        said = f"ran: Megatron (2,) losses {losses}"
    except Exception as e:   # what the group said is the finding
        said = "refused: " + str(e).strip().splitlines()[-1][:300]
    finally:
        world.close()
    print(said, flush=True)
    return said


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for cluster.json and figures.json")
    ap.add_argument("--preset", default="h100-80gb-nvlink-ib")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender in part 2")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of both programs")
    ap.add_argument("--large", action="store_true", help="part 2 again at twice the width and batch")
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True   # fp32 matmuls in TF32 throughout: the preset's fp32 peak is TF32's
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    sizes = dict(d=args.d, heads=args.heads, layers=args.layers, vocab=args.vocab, batch=args.batch, seq=args.seq)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    figures = {"device": str(device)}
    backend = _init_group(device, args.port)
    print(f"process group: {backend}, world 1")
    try:
        figures["measure"], cluster = measure_compute(device, args.preset, args.out)
        figures["program"] = emitted_program(device, sizes, args.steps, cluster)
        if args.profile:
            profile(device, sizes, args.out)
        if args.large:
            big = dict(sizes, d=2 * sizes["d"], batch=2 * sizes["batch"])
            figures["program_large"] = emitted_program(device, big, args.steps, cluster)
    finally:
        dist.destroy_process_group()
    if device.type == "cuda":
        figures["two_processes"] = two_processes(sizes)
    if args.out:
        with open(os.path.join(args.out, "figures.json"), "w") as f:
            json.dump(figures, f, indent=1, default=str)


if __name__ == "__main__":
    main()
