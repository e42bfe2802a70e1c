"""Compile: the per-rank program compiled whole by ``torch.compile`` (inductor), for
``parallelize(..., compile=True)``.

Traced by dynamo, the runtime the program calls issues its collectives as c10d's functional
collectives (``autoshard._compat.functional_collective``): each a start and a ``wait_tensor`` in
the graph where the program starts and waits on it, each with its dual step as its autograd; its
parameter and gradient handling and its buckets become plain autograd (``autoshard.runtime``:
each function's traced branch). So the program compiles as one graph, with no break: forward and
backward (AOTAutograd), the collectives among the fused kernels. Inductor's comm passes
(``_compat.comm_overlap_options``) then sink each wait to the first use of its result and raise
each start, as the schedule pass does in the eager program (a backward's all-reduce waits after
the weight gradient that does not need it), never swapping two collectives. Every rank traces
the same program, so every rank issues the same collectives in the same order.

A program is lowered once per input shape (``ParallelModule._program_for``), so it is compiled
once, for static shapes (``dynamic=False``): a new shape makes a new program, compiled once.
``ParallelModule.compile(**kwargs)`` compiles the same programs with the user's arguments
(``compile=True`` is ``compile()`` with none), and so does a user's ``torch.compile(module)``,
with only its own (``ParallelModule.forward`` runs as Python there): what feeds each (the
parameters' shares, the batch's rows) stays eager, so the compiled graph takes plain tensors and
hands each gradient to its parameter as eager does, with no guard on a DTensor and no graph
break at a new shape.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard._compat import comm_overlap_options


def compile_regions(program: fx.GraphModule, **kwargs) -> torch.nn.Module:
    """``program`` compiled as one region by ``torch.compile(**kwargs)``: by default inductor,
    static shapes (a program is one input shape's), ``fullgraph`` (a graph break is an error, not
    a silent split) and, under inductor with neither ``mode`` nor ``options`` given, the comm
    reordering passes (``_compat.comm_overlap_options``). It reads as ``program`` does (``code``,
    ``meta``, with this pass added to ``meta["passes"]``) and is called as it is."""
    out = fx.GraphModule(program, program.graph)   # checkpointed blocks (passes.checkpoint) kept as submodules
    out.meta.update(program.meta)
    out.meta["passes"] = [*program.meta.get("passes", ()), "compile"]
    kw = {"backend": "inductor", "dynamic": False, "fullgraph": True, **kwargs}
    if kw["backend"] == "inductor" and kw.get("mode") is None and kw.get("options") is None:
        kw["options"] = comm_overlap_options()
    return torch.compile(out, **kw)
