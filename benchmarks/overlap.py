"""What hiding activation communication gains, measured: the same plan run with the schedule pass
(``overlap=True``: every collective step started right after its input is made and waited on
right before its first use, in forward and, mirrored, in backward) and without it
(``overlap=False``: every step blocks where the rewriter put it), and with the schedule pass and
the linears before every all-reduce or reduce-scatter overdecomposed into ``--chunks`` chunks
(``chunked``: each chunk's collective started while the next chunk's matmul runs; the plan's
``schedule["chunks"]`` set to every conversion the cost model could chunk), and with the schedule
pass and the batch cut into ``--interleave`` chunks run segment by segment (``interleaved``:
``passes.interleave``, each chunk's collectives in flight while the next chunk computes; the
plan's ``schedule["interleave"]`` set to it), and with the schedule
pass but each linear's weight gradient made beside the last step before the linear only
(``dW last``: how the schedule placed them before it spread them over every bare step of that
run, so that a block's reduce-scatter into the residual stream flies beside one too), back to back on a
local gloo group, beside the bound the machine allows, measured in the same run:

  compute alone   the scheduled program with every collective replaced by one that returns at
                  once (its output buffer zeroed): the step if communication were free
  comm alone      the collectives one step issues (recorded on each rank, in order), replayed one
                  after another with nothing else running
  ideal           max(compute alone, comm alone): the step if every collective hid behind compute
  both at once    compute alone and comm alone run at the same time, in two threads, with no
                  dependency between them: what this machine gives when both share it (on a
                  CPU, gloo moves bytes with the same cores the ops compute on); no schedule
                  does better than this

Cases:
  megatron     a GPT pinned to ``schemes.megatron`` where only the split matmuls train, so every
               collective is an activation's (the case of issue 13: d=128, 4 blocks, batch
               16 x 256 tokens)
  seq-parallel the same GPT pinned to ``schemes.sequence_parallel``, only the split matmuls train
  default      the same GPT under the default plan, every parameter training

Rounds interleave the contenders (order rotated each round); a step is forward and backward of
the loss, timed on the slowest rank from a barrier; medians after the warm-up rounds. Prints ms
per step, on/off, chunked/off, interleaved/off and dW last/off; "comm share" is comm alone over the step without overlap; under
it, the forward's medians alone, and the step's less them (backward), off, on and compute alone. The
plan's own choice of chunks on the cluster it was made for (``--cluster``) is printed under each
case.

    python benchmarks/overlap.py [--world 2] [--rounds 12] [--chunks 4] [--interleave 2] [--cases megatron,seq-parallel,default]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard import runtime, schemes
from autoshard.testing.launch import LocalWorld
from vs_torch import GPT


class _Done:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True


# the collectives the emitted program calls: (module, attribute) and the index of its output
_COLLECTIVES = [(runtime, "_all_gather"), (runtime, "_reduce_scatter"), (dist, "all_reduce"),
                (dist, "all_to_all_single")]


_REAL = {name: getattr(mod, name) for mod, name in _COLLECTIVES}


@contextlib.contextmanager
def _patched(wrap, only_this_thread=False):
    """The program's collectives replaced by ``wrap(name, real)``; with ``only_this_thread``, other
    threads still get the real ones."""
    import threading
    me = threading.get_ident()

    def choose(name, real):
        fake = wrap(name, real)
        if not only_this_thread:
            return fake
        return lambda *a, **k: (fake if threading.get_ident() == me else real)(*a, **k)
    try:
        for mod, name in _COLLECTIVES:
            setattr(mod, name, choose(name, _REAL[name]))
        yield
    finally:
        for mod, name in _COLLECTIVES:
            setattr(mod, name, _REAL[name])


def _no_comm(name, fn):
    def call(*args, group=None, async_op=False, **kw):
        if name != "all_reduce":        # the output buffer: zeroed, as the collective writes it
            args[0].zero_()
        return _Done() if async_op else None
    return call


def _recording(log):
    def wrap(name, fn):
        def call(*args, group=None, async_op=False, **kw):
            log.append((name, [(a.shape, a.dtype) for a in args if isinstance(a, torch.Tensor)], group))
            return fn(*args, group=group, async_op=async_op, **kw)
        return call
    return wrap


def _replay(log, barrier=True):
    """The recorded collectives, one after another: the communication of one step alone."""
    bufs = [[torch.ones(s, dtype=d) for s, d in shapes] for _, shapes, _ in log]
    fns = {name: _REAL[name] for _, name in _COLLECTIVES}
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    for (name, _, group), b in zip(log, bufs):
        fns[name](*b, group=group)
    return time.perf_counter() - t0


def _build(case, a):
    torch.manual_seed(0)
    model = GPT(a.vocab, a.d, a.heads, a.layers, a.seq)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    batch = (idx, torch.roll(idx, -1, dims=1))
    mesh = (dist.get_world_size(),)
    pin = {"megatron": schemes.megatron, "seq-parallel": schemes.sequence_parallel}.get(case)
    kw = {"pin": pin(model, batch, mesh)} if pin else {}
    # a measured cluster is measured by every rank together (collectives), then planned on by rank 0
    cluster = autoshard.measure() if a.cluster == "measure" else a.cluster
    text = [autoshard.plan(model, batch, mesh=mesh, cluster=cluster, **kw).to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)     # one plan, rank 0's, on every rank
    plan = autoshard.Plan.from_json(text[0])
    if pin:   # only the split matmuls train: every collective left is an activation's
        for name, p in model.named_parameters():
            p.requires_grad_(any(s != "B" for s in plan.params[name]))
    return model, batch, plan


# a link with no latency or launch: the cost model chunks every conversion it can
_FREE_LINK = autoshard.Cluster(name="free-link", intra_latency=0, collective_overhead=0, intra_bandwidth=1e9)


def _chunked(model, batch, plan, k: int):
    """``plan`` with every conversion the schedule can overdecompose chunked into ``k``."""
    import copy
    pin = {n: tuple(c.outputs[0]) for n, c in plan.nodes.items() if c.kind == "op" and c.outputs}
    pin |= {n: tuple(v) for n, v in plan.params.items()}
    every = autoshard.plan(model, batch, mesh=plan.mesh_shape, cluster=_FREE_LINK, pin=pin)
    out = copy.copy(plan)
    out.schedule = dict(plan.schedule, chunks=[[p, c, k, d] for p, c, _, d in every.schedule["chunks"]])
    return out


def _step(pm, batch, barrier=True, forward=None):
    """Seconds of one forward and backward; ``forward``: a list the forward's seconds go onto."""
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    loss = pm(*batch)
    t1 = time.perf_counter()
    loss.backward()
    for p in pm.parameters():
        p.grad = None
    if forward is not None:
        forward.append(t1 - t0)
    return time.perf_counter() - t0


def _weight_grads_at_last_wait(program):
    """The scheduled ``program`` with every linear's weight gradient moved into the span of the
    last wait before the linear, as the schedule placed them before it spread them over the bare
    steps of that run of waits (``passes.schedule._weight_grads_later``)."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(program.graph, {}))
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    waits = [n for n in nodes if n.target is runtime.step_wait]
    for late in [n for n in nodes if n.target is runtime.weight_later]:
        linear = next(u for u in late.users if u.target is runtime.linear_dw_later)
        wait = max((w for w in waits if order[w] < order[linear]), key=order.get)
        wait.prepend(late.args[1])   # its pending handle, then the node
        wait.prepend(late)
    gm = torch.fx.GraphModule(program, g)
    gm.meta.update(program.meta)
    return gm


def _reprogrammed(pm, batch, change):
    """``pm`` running ``change(program)`` instead of the program it made for ``batch``."""
    _step(pm, batch)
    (key, (program, *rest)), = pm._programs.items()
    pm._programs[key] = (change(program), *rest)
    return pm


def rank_case(case, a):
    import copy
    model, batch, plan = _build(case, a)
    on = autoshard.parallelize(copy.deepcopy(model), plan=plan, overlap=True)
    last = _reprogrammed(autoshard.parallelize(copy.deepcopy(model), plan=plan, overlap=True), batch,
                         _weight_grads_at_last_wait)
    off = autoshard.parallelize(copy.deepcopy(model), plan=plan, overlap=False)
    text = [_chunked(model, batch, plan, a.chunks).to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)
    chunks = autoshard.Plan.from_json(text[0])
    chunked = autoshard.parallelize(copy.deepcopy(model), plan=chunks, overlap=True)
    batched = copy.copy(plan)
    batched.schedule = dict(plan.schedule, interleave=a.interleave)
    interleaved = autoshard.parallelize(copy.deepcopy(model), plan=batched, overlap=True)
    fwd = {"off": [], "on": [], "compute": []}   # each round's forward seconds, warm-up included
    contenders = {"off": lambda: _step(off, batch, forward=fwd["off"]), "on": lambda: _step(on, batch, forward=fwd["on"]),
                  "chunked": lambda: _step(chunked, batch), "last": lambda: _step(last, batch),
                  "interleaved": lambda: _step(interleaved, batch)}

    def compute_alone():
        with _patched(_no_comm):
            return _step(on, batch, forward=fwd["compute"])
    contenders["compute"] = compute_alone
    log = []
    with _patched(_recording(log)):
        _step(on, batch)
    contenders["comm"] = lambda: _replay(log)

    def both():
        import threading
        took = {}
        t = threading.Thread(target=lambda: took.setdefault("comm", _replay(log, barrier=False)))
        dist.barrier()
        t0 = time.perf_counter()
        t.start()
        with _patched(_no_comm, only_this_thread=True):
            _step(on, batch, barrier=False)
        t.join()
        return time.perf_counter() - t0
    contenders["both"] = both
    names, times = list(contenders), {k: [] for k in contenders}
    for r in range(a.warmup + a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = contenders[k]()
            if r >= a.warmup:
                times[k].append(t)
    kinds = {}
    for name, _, _ in log:
        kinds[name] = kinds.get(name, 0) + 1
    return {"times": times, "forward": {k: v[a.warmup:] for k, v in fwd.items()}, "collectives": kinds, "mesh": plan.mesh_shape, "chunked": len(chunks.schedule["chunks"]),
            "chosen": [k for _, _, k, _ in plan.schedule.get("chunks", [])], "interleave": plan.schedule.get("interleave", 1),
            "saved": plan.breakdown.get("interleave_saved", 0.0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default="megatron,seq-parallel,default")
    ap.add_argument("--chunks", type=int, default=4, help="k of the chunked contender")
    ap.add_argument("--interleave", type=int, default=2, help="k of the interleaved contender")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--cluster", default=None, help="a preset name, a saved cluster file, or \"measure\" (default: the A100 preset)")
    a = ap.parse_args()
    print(f"GPT d={a.d}, {a.heads} heads, {a.layers} blocks, vocab {a.vocab}, batch {a.batch} x {a.seq} "
          f"tokens; gloo world {a.world}; forward + backward; medians of {a.rounds} rounds after {a.warmup}")
    print()
    print(f"| case | off ms | on ms | chunked (k={a.chunks}) ms | interleaved (k={a.interleave}) ms | on/off | chunked/off "
          "| interleaved/off | dW last/off | compute alone ms "
          "| comm alone ms | ideal ms | ideal/off | both at once ms | both/off | comm share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    world = LocalWorld(a.world, timeout_s=900.0)   # a case's rounds take minutes on a loaded machine
    try:
        for case in a.cases.split(","):
            res = world.run(rank_case, case, a)
            # a step's time is the slowest rank's
            med = {k: statistics.median(max(r["times"][k][i] for r in res) for i in range(a.rounds)) * 1e3
                   for k in res[0]["times"]}
            ideal = max(med["compute"], med["comm"])
            print(f"| {case} | {med['off']:.1f} | {med['on']:.1f} | {med['chunked']:.1f} | {med['interleaved']:.1f} | "
                  f"{med['on'] / med['off']:.2f} | {med['chunked'] / med['off']:.2f} | "
                  f"{med['interleaved'] / med['off']:.2f} | {med['last'] / med['off']:.2f} | "
                  f"{med['compute']:.1f} | {med['comm']:.1f} | {ideal:.1f} | {ideal / med['off']:.2f} | "
                  f"{med['both']:.1f} | {med['both'] / med['off']:.2f} | {med['comm'] / med['off']:.2f} |")
            # the forward alone, and the rest of the step (backward), each the slowest rank's
            f = {k: statistics.median(max(r["forward"][k][i] for r in res) for i in range(a.rounds)) * 1e3
                 for k in res[0]["forward"]}
            print(f"|  | forward ms: off {f['off']:.1f}, on {f['on']:.1f}, compute alone {f['compute']:.1f}; "
                  f"backward (step less forward): off {med['off'] - f['off']:.1f}, on {med['on'] - f['on']:.1f}, "
                  f"compute alone {med['compute'] - f['compute']:.1f} |")
            counts = ", ".join(f"{k.strip('_')} x{v}" for k, v in sorted(res[0]["collectives"].items()))
            chosen = res[0]["chosen"]
            print(f"|  | collectives per step on rank 0 (not chunked): {counts}; chunked contender: "
                  f"{res[0]['chunked']} conversions in {a.chunks}; the plan's own choice: "
                  + (f"{len(chosen)} chunked (k = {sorted(set(chosen))})" if chosen else "none chunked (k = 1)")
                  + f", the batch in {res[0]['interleave']} interleaved chunks (priced to save "
                  f"{res[0]['saved'] * 1e3:.2f} ms) |")
    finally:
        world.close()


if __name__ == "__main__":
    main()
