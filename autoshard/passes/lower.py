"""Lowering: a planned graph to the program one rank runs, pass after pass.

The graph reaches here captured and functionalized (``passes.capture``, ``passes.functionalize``)
and planned (``planner``); ``lower`` lists what turns it and its plan into a per-rank program, in
the order the passes run. Each returns a new program whose ``meta["passes"]`` names it.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from autoshard.ir import Graph
from autoshard.passes.checkpoint import checkpoint_blocks
from autoshard.passes.compile import compile_regions
from autoshard.passes.rewrite import rewrite
from autoshard.passes.schedule import BUCKET_BYTES, batch_casts, fuse_cast_gathers, schedule
from autoshard.plan import Plan


def lower(graph: Graph, plan: Plan, *, device=None, coords=None, overlap: bool = True,
          compile: Optional[dict] = None) -> fx.GraphModule:
    """The per-rank program of ``graph`` under ``plan`` for the rank at mesh coordinate ``coords``;
    ``overlap=False`` leaves every collective where the rewriter put it (no schedule pass);
    ``compile``, ``torch.compile``'s arguments (``{}``: its defaults), compiles the program
    whole (passes.compile). Its ``meta["joint_axes"]`` lists the axis sets whose process groups the
    runtime must create."""
    # local shapes, parameters as their shares, the plan's conversions as explicit collectives
    program = rewrite(graph, plan, device=device, coords=coords)
    # the blocks the plan recomputes (and the user's own checkpointed regions) into checkpointed
    # submodules, before the schedule, which then moves nothing into or out of them
    program = checkpoint_blocks(program, graph, plan)
    if overlap:
        # the batch interleaved, gradients bucketed, gathers prefetched, the chosen conversions
        # overdecomposed, collectives started early and waited on late (passes.schedule). Compiled,
        # each linear keeps its weight gradient in its own backward: linear_dw_later and
        # weight_later are runtime calls whose traced form is a plain linear (passes.compile); the
        # weight gradient then no longer flies beside a dual step
        program = schedule(program, bucket_bytes=plan.schedule.get("bucket_bytes", BUCKET_BYTES),
                           chunks=plan.schedule.get("chunks", ()), interleave=plan.schedule.get("interleave", 1),
                           weights_later=compile is None)
    # after the schedule, which buckets the gathers of policy copies itself: those left gather in
    # the copy's bytes; then each run of parameter casts becomes one op
    program = batch_casts(fuse_cast_gathers(program))
    # last, on the program as it will run: compiled whole, its collectives traced in the schedule's order
    return program if compile is None else compile_regions(program, **compile)
