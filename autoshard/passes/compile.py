"""Compile: the per-rank program with each run of plain aten ops between two runtime calls
compiled by ``torch.compile`` (inductor), for ``parallelize(..., compile=True)``.

The program's collectives, its parameter and gradient handling and its random ops are calls into
``autoshard.runtime``: autograd functions that keep state from forward to backward (``Pending``
handles, started work, the rank's mesh), which dynamo does not trace without a graph break at
each. So the program is cut at every such call (and at every checkpointed block), each run of
aten ops between two cuts becomes a submodule compiled on its own (forward and backward, by
AOTAutograd and inductor), and the runtime calls run eagerly between them, in the program's
order: every collective starts and is waited on where the schedule put it, so nothing the
schedule overlapped is serialized, and every rank issues the same collectives in the same order.

A program is lowered once per input shape (``ParallelModule._program_for``), so each region is
compiled once, for static shapes (``dynamic=False``): a new shape makes a new program, compiled
once.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

# a run with fewer aten ops than this, or with views alone, runs eagerly: a lone view or add gains
# nothing from a kernel of its own, and every compiled region costs a call into its compiled graph
MIN_OPS = 2
# the aten ops that only look at their input differently: no kernel, nothing for inductor to fuse
_VIEWS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "t", "split", "slice",
          "select", "alias", "_unsafe_view", "unflatten", "flatten"}


def _is_aten(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)


def _runs(program: fx.GraphModule) -> list:
    """The program's nodes in order, as lists: each run of aten ops (with the getitems of their
    results that follow them) one list, every other node a list of its own."""
    runs, run = [], []
    for n in program.graph.nodes:
        inside = _is_aten(n) or (n.op == "call_function" and n.target is operator.getitem and n.args[0] in run)
        if inside:
            run.append(n)
            continue
        if run:
            runs.append(run)
            run = []
        runs.append([n])
    return runs + ([run] if run else [])


def _worth_compiling(run: list) -> bool:
    ops = [n for n in run if _is_aten(n)]
    return len(ops) >= MIN_OPS and any(n.target.overloadpacket.__name__ not in _VIEWS for n in ops)


def _region(program: fx.GraphModule, run: list):
    """``run`` as a graph module of its own: (module, the outside nodes it takes, the nodes of
    the run used after it)."""
    members = set(run)
    graph, env, takes = fx.Graph(), {}, []

    def arg(x):
        if x not in env:
            takes.append(x)
            env[x] = graph.placeholder(x.name)
        return env[x]

    for n in run:
        env[n] = graph.node_copy(n, arg)
    gives = [n for n in run if any(u not in members for u in n.users)]
    graph.output(tuple(env[n] for n in gives))
    return fx.GraphModule(program, graph), takes, gives


def compile_regions(program: fx.GraphModule, *, backend: str = "inductor", mode=None) -> fx.GraphModule:
    """A new program whose runs of aten ops between runtime calls are compiled submodules
    (``compiled_<i>``), every other node as it was, in the same order; its ``meta`` is
    ``program``'s, with this pass added to ``passes``."""
    graph, env, modules = fx.Graph(), {}, {}
    for run in _runs(program):
        if not _worth_compiling(run):
            for n in run:
                env[n] = graph.node_copy(n, lambda x: env[x])
            continue
        region, takes, gives = _region(program, run)
        name = f"compiled_{len(modules)}"
        modules[name] = torch.compile(region, backend=backend, mode=mode, dynamic=False, fullgraph=True)
        call = graph.call_module(name, tuple(env[x] for x in takes))
        for i, n in enumerate(gives):
            env[n] = graph.call_function(operator.getitem, (call, i))
    root = torch.nn.Module()
    for name, mod in program.named_children():   # checkpointed blocks (passes.checkpoint)
        root.add_module(name, mod)
    for name, mod in modules.items():
        root.add_module(name, mod)
    out = fx.GraphModule(root, graph)
    out.meta.update(program.meta)
    out.meta["passes"] = [*program.meta.get("passes", ()), "compile"]
    return out
