"""Checkpoint: the per-rank program with each block the plan recomputes (``plan.recompute``,
planner.recompute) run under ``torch.utils.checkpoint``: the block's program nodes move into a
submodule that keeps only its inputs for backward and runs its forward again there, its
collectives included.

The rewriter tags each program node with the captured node it serves (``meta["source"]``); a
block's region runs from its first such node to its last. What inside that span depends on
placeholders alone (a parameter's gradient sync, its gather before use) is hoisted before the
region, so the schedule pass still buckets and prefetches it and the gathered parameter is the
checkpoint's input, kept rather than gathered again; with ``reshard_after_forward`` it stays in
the region, gathered again with the forward it feeds, as the plan prices it. Every rank runs the
same regions in the same order, so the collectives run again in backward pair up across ranks.

Where the plan recomputes only the blocks' cheap ops (``plan.recompute["selective"]``, the
planner's ``recompute="selective"``), the region runs under torch's selective checkpoint policy:
the outputs of the kernels that do a block's arithmetic (matmuls, attention, convolutions) are
kept from forward, and only the rest (norms, activations, adds, the collectives between them)
runs again in backward, as Megatron-LM's selective recomputation does.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoshard import runtime
from autoshard.planner.repeat import stack_blocks


aten = torch.ops.aten
# the kernels whose outputs a selectively recomputed block keeps (planner.recompute.heavy: the
# ops that do a block's arithmetic, as the dispatcher sees them)
ARITHMETIC = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten._grouped_mm,
              aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_for_cpu,
              aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention}


def _keep_arithmetic(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in ARITHMETIC else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_random(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if torch.Tag.nondeterministic_seeded in op.tags else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_arithmetic_and_random(ctx, op, *args, **kwargs):
    keep = op.overloadpacket in ARITHMETIC or torch.Tag.nondeterministic_seeded in op.tags
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Recompute(torch.nn.Module):
    """One block of the program: its forward kept only as far as its inputs, run again in
    backward with the rank's mesh active and the generator all ranks share for random ops
    (dropout) as it was, so it draws the same masks. ``selective``: the outputs of its
    arithmetic (``ARITHMETIC``) kept too, and only the rest run again.

    Traced (torch.compile), the compiler's partitioner does the recomputing, and the block keeps
    the outputs of its random ops (a dropout's mask; attention kernels that may draw) rather
    than drawing them again: the generator's state cannot be read in a traced graph, and
    AOTAutograd's replay of random ops misplaces their saved states in a graph that also saves
    the parameters' device mesh (a user's compile, whose inputs are DTensors; torch 2.13)."""

    def __init__(self, block: fx.GraphModule, name: str, selective: bool = False):
        super().__init__()
        self.block, self.name, self.selective = block, name, selective

    def forward(self, *xs):
        if torch.compiler.is_compiling():
            keep = _keep_arithmetic_and_random if self.selective else _keep_random
            return checkpoint(self.block, *xs, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, keep))
        mesh = runtime._mesh()
        state = mesh.generator.get_state()
        runs = [0]

        def run(*args):
            runs[0] += 1
            if runs[0] == 1:
                return self.block(*args)
            now = mesh.generator.get_state()
            mesh.generator.set_state(state)
            try:
                with runtime.active(mesh):
                    return self.block(*args)
            finally:
                mesh.generator.set_state(now)

        if self.selective:
            return checkpoint(run, *xs, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_arithmetic))
        return checkpoint(run, *xs, use_reentrant=False)


def checkpoint_blocks(program: fx.GraphModule, graph, plan) -> fx.GraphModule:
    """A new program with every block ``plan.recompute`` names run under checkpoint, and every
    region the user's own ``torch.utils.checkpoint`` ran (``Node.region``); ``program`` is not
    changed."""
    chosen = (plan.recompute or {}).get("blocks") or []
    user = user_regions(graph)
    if not (chosen or user) or not plan.training:
        return program
    blocks = {**stack_blocks(graph), **user}   # the planner offers no block the user checkpoints
    chosen = list(chosen) + list(user)
    g = fx.Graph()
    g.output(g.graph_copy(program.graph, {}))
    root = torch.nn.Module()
    regather = plan.schedule.get("reshard_after_forward", False)
    selective = bool((plan.recompute or {}).get("selective"))
    weights = {n.name for n in graph.nodes if n.kind in ("param", "buffer")}
    for name in chosen:
        _region(g, root, name, set(blocks[name]), weights, regather, selective and name not in user)
    g.lint()
    gm = fx.GraphModule(root, g, class_name="RankProgram")
    gm.meta.update(program.meta)
    gm.meta["passes"] = list(program.meta.get("passes", [])) + ["checkpoint"]
    return gm


def user_regions(graph) -> dict:
    """``checkpoint<r>`` -> the op nodes of the user's r-th ``torch.utils.checkpoint`` call."""
    out: dict = {}
    for n in graph.nodes:
        if n.kind == "op" and n.region is not None:
            out.setdefault(f"checkpoint{n.region}", []).append(n.name)
    return out


def _from_weights(g: fx.Graph, weights: set) -> set:
    """The program's nodes made from parameters and buffers alone (``weights``: their names): their
    shares, gradient syncs, policy casts, gathers."""
    out: set = set()
    for n in g.nodes:
        if (n.op == "placeholder" and n.target in weights) or \
                (n.op == "call_function" and all(u in out for u in n.all_input_nodes)):
            out.add(n)
    return out


def _region(g: fx.Graph, root, name: str, sources: set, weights: set, regather: bool, selective: bool = False) -> None:
    # what the block makes from its weights alone is hoisted before the region and kept (unless
    # regathered): it bounds no region, wherever the program put it (a precision policy casts
    # every block's parameters at the program's start)
    kept = set() if regather else _from_weights(g, weights)
    nodes = list(g.nodes)
    at = [i for i, n in enumerate(nodes) if n.meta.get("source") in sources and n not in kept]
    if not at:
        return
    span = nodes[at[0]:at[-1] + 1]
    hoisted = [n for n in span if n in kept]
    members = [n for n in span if n not in kept]
    inside = set(members)
    first = members[0]
    for n in hoisted:
        first.prepend(n)
    ext = []
    for n in members:
        for u in n.all_input_nodes:
            if u not in inside and u not in ext:
                ext.append(u)
    outs = [n for n in members if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env = {u: sub.placeholder(f"in_{i}") for i, u in enumerate(ext)}
    for n in members:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in outs))
    attr = "recompute_" + name.replace(".", "_")
    root.add_module(attr, Recompute(fx.GraphModule(torch.nn.Module(), sub, class_name="Block"), name, selective))
    with g.inserting_before(first):
        call = g.call_module(attr, tuple(ext))
        got = {n: g.call_function(operator.getitem, (call, i)) for i, n in enumerate(outs)}
    for n, new in got.items():
        n.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for n in reversed(members):
        g.erase_node(n)
