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
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard._compat import comm_overlap_options, fixed_layout_guards


def compile_regions(program: fx.GraphModule, *, backend: str = "inductor", mode=None) -> torch.nn.Module:
    """``program`` compiled as one region (``fullgraph``: a graph break is an error, not a silent
    split); it reads as ``program`` does (``code``, ``meta``, with this pass added to
    ``meta["passes"]``) and is called as it is."""
    out = fx.GraphModule(program, program.graph)   # checkpointed blocks (passes.checkpoint) kept as submodules
    out.meta.update(program.meta)
    out.meta["passes"] = [*program.meta.get("passes", ()), "compile"]
    options = comm_overlap_options() if backend == "inductor" and mode is None else None
    return torch.compile(out, backend=backend, mode=mode, options=options, dynamic=False, fullgraph=True)


def users_compile_kwargs(kwargs: dict, module: torch.nn.Module) -> dict:
    """``torch.compile``'s arguments for ``ParallelModule.compile``: those given, with static
    shapes (each input shape is its own program), for inductor with neither ``mode`` nor
    ``options`` given the comm reordering passes ``compile=True`` runs, and, unless the options
    hold a ``guard_filter_fn`` of their own, ``fixed_layout_guards(module)`` (which travels in
    the options, so not with a ``mode``: torch.compile takes one or the other)."""
    out = {"dynamic": False, **kwargs}
    if out.get("mode") is not None:
        return out
    if out.get("backend", "inductor") == "inductor" and out.get("options") is None:
        out["options"] = comm_overlap_options()
    # a copy: torch.compile pops the filter from the dict it is given
    out["options"] = {"guard_filter_fn": fixed_layout_guards(module), **(out.get("options") or {})}
    return out
