"""Pipeline stages: a captured model cut between its repeated blocks into ``k`` programs.

The model's stack of blocks (``blocks.0``, ``blocks.1``, ..., found from each op's module path as
``planner.repeat`` finds them) is cut into ``k`` runs of consecutive blocks; the ops before the
first block (the embedding) go with the first stage, the ops after the last (the head and the
loss) with the last, and an op between two blocks with the block before it. Each stage becomes
an ``fx.GraphModule`` of aten ops that holds the model's own parameters (by their names in the
model) and takes, in order, the values an earlier stage made and a later one reads, then the
user's inputs it reads itself: every rank has the whole batch (``module(*batch)``), so a user's
input is never sent between stages (the targets are read where the loss is, not carried there
through every stage); every stage hands on what a stage after it needs of what the stages made,
and the last returns the loss. Each stage is then captured and planned as a model of its own
(``autoshard.pipelined``).
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from autoshard.ir import Graph
from autoshard.planner.repeat import _block_of


@dataclass(frozen=True)
class Stages:
    """The cut: ``blocks[s]``, the block names stage ``s`` holds (``"blocks.0"``, ...);
    ``modules[s]``, its program; ``inputs[s]``, the metas (shape, dtype) of what it takes: what
    crosses to it from the stage before, then the user's inputs it reads, ``reads[s]`` (their
    indices among the model's tensor inputs); ``loss_dtype``, the dtype of the loss the last
    returns."""
    blocks: tuple
    modules: tuple
    inputs: tuple
    reads: tuple = ()
    loss_dtype: torch.dtype = torch.float32

    def crossing(self, s: int) -> tuple:
        """The metas of what crosses to stage ``s`` from the stage before (the first: nothing)."""
        return self.inputs[s][:len(self.inputs[s]) - len(self.reads[s])]


def block_stack(graph: Graph) -> tuple:
    """(container, sorted block indices) of the model's longest stack of numbered blocks with
    ops in them; raises where it has none of two blocks or more."""
    found: dict = {}
    for n in graph.nodes:
        if n.kind == "op":
            b = _block_of(n)
            if b is not None:
                found.setdefault(b[0], set()).add(b[1])
    stacks = sorted(((len(v), c) for c, v in found.items() if len(v) >= 2), reverse=True)
    if not stacks:
        raise ValueError("pipeline= cuts a model between its repeated blocks (an nn.ModuleList such as "
                         "blocks.0, blocks.1, ...), and this model has no stack of two or more: plan it without "
                         "pipeline=, or with pipeline=1")
    container = stacks[0][1]
    return container, tuple(sorted(found[container]))


@contextlib.contextmanager
def short_stack(model: torch.nn.Module, container: str, keep: int):
    """``model`` with its stack of blocks at ``container`` (an ``nn.ModuleList`` or
    ``nn.ModuleDict``) holding only its first ``keep`` blocks, for as long as the context lasts:
    the blocks are tied, so a model of a few prices each of them as the whole model would. Yields
    False, changing nothing, where the container is of another kind."""
    parent_path, _, attr = container.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
        stack = getattr(parent, attr)
    except AttributeError:
        yield False
        return
    if isinstance(stack, torch.nn.ModuleList):
        short = torch.nn.ModuleList(list(stack)[:keep])
    elif isinstance(stack, torch.nn.ModuleDict):
        short = torch.nn.ModuleDict(list(stack.items())[:keep])
    else:
        yield False
        return
    setattr(parent, attr, short)
    try:
        yield True
    finally:
        setattr(parent, attr, stack)


def even_cuts(n_blocks: int, k: int, virtual: int = 1) -> list:
    """The first block index of each of ``k`` stages (``k virtual`` chunks) holding ``n_blocks``
    blocks in runs as even as they go, the longer runs first."""
    if k * virtual > n_blocks and virtual > 1:
        raise ValueError(f"pipeline={k} by virtual={virtual} needs at least {k * virtual} repeated blocks, a chunk "
                         f"each, and the model has {n_blocks}: pass a smaller virtual=")
    if k > n_blocks:
        raise ValueError(f"pipeline={k} stages need at least {k} repeated blocks, and the model has {n_blocks}: "
                         f"pass pipeline= of at most {n_blocks}")
    k *= virtual
    return [s * (n_blocks // k) + min(s, n_blocks % k) for s in range(k)]


def split(graph: Graph, model: torch.nn.Module, starts: list) -> Stages:
    """The stages of ``graph`` (captured from ``model``) whose first blocks are ``starts``
    (indices into the model's stack of blocks, ``block_stack``), one per stage, the first 0."""
    container, indices = block_stack(graph)
    k = len(starts)
    if starts[0] != 0 or list(starts) != sorted(set(starts)) or starts[-1] >= len(indices):
        raise ValueError(f"stage cuts {list(starts)} must start at 0 and rise within the {len(indices)} blocks")
    stage_of_block = {}
    for s in range(k):
        end = starts[s + 1] if s + 1 < k else len(indices)
        for i in range(starts[s], end):
            stage_of_block[indices[i]] = s
    ep = graph.exported
    gm = ep.graph_module
    sig = ep.graph_signature
    if any(o.kind == OutputKind.BUFFER_MUTATION for o in sig.output_specs):
        raise ValueError("pipeline= does not yet run a model that writes its buffers in forward (BatchNorm's "
                         "running statistics, a cache): plan it without pipeline=")
    specs = {s.arg.name: s for s in sig.input_specs}
    by_fx = {n.fx_node: n for n in graph.nodes if n.kind in ("op", "param", "buffer", "input")}

    stage: dict = {}        # fx node -> the stage that computes it (user inputs: 0, and never sent)
    attrs: dict = {}        # fx placeholder of a parameter, buffer or constant -> its target name
    # a value made from parameters alone (a precision policy's bf16 copy of a weight, which the
    # policy writes at the top of the graph) is made again by each stage that reads it: sent, it
    # would carry a weight every microbatch, and a weight tied across stages would not be tied
    derived: set = set()
    current = 0
    for fxn in gm.graph.nodes:
        if fxn.op == "placeholder":
            spec = specs[fxn.name]
            if spec.kind == InputKind.USER_INPUT:
                stage[fxn] = 0
            else:
                attrs[fxn] = spec.target
        elif fxn.op == "call_function" and _from_parameters(fxn, attrs, derived):
            derived.add(fxn)
        elif fxn.op == "call_function":
            node = by_fx.get(fxn)
            b = _block_of(node) if node is not None else None
            if b is not None and b[0] == container:
                current = stage_of_block[b[1]]
            made = [stage[a] for a in fxn.all_input_nodes if a in stage]
            own = stage[fxn.args[0]] if fxn.target is operator.getitem else current
            stage[fxn] = max([own] + made)
        elif fxn.op == "get_attr":
            raise ValueError(f"pipeline= does not yet cut a model whose graph holds {fxn.format_node()} "
                             "(a higher-order op's subgraph): plan it without pipeline=")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    if len(outs) != 1 or not _scalar_loss(outs[0]):
        raise ValueError("pipeline= runs a model that returns its training loss, one floating-point scalar, as a "
                         "training step does (model(*batch) -> loss); this model returns "
                         f"{len(outs)} output(s). Compute the loss inside forward, or plan it without pipeline=")
    # the last stage a value is read in; the output is read by the last stage
    last_read = {n: stage[n] for n in stage}
    for fxn in gm.graph.nodes:
        if fxn.op == "call_function":
            for a in fxn.all_input_nodes:
                if a in stage:
                    last_read[a] = max(last_read[a], stage[fxn])
    last_read[outs[0]] = k - 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    user_inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n in stage]
    # what crosses from stage s to s + 1: made at s or before, read after s; a user's input is
    # read where it is needed, from the batch every rank has
    mine = set(user_inputs)
    crossing = [sorted((n for n in stage if n not in mine and stage[n] <= s < last_read[n]), key=order.__getitem__)
                for s in range(k - 1)]
    reads = [[i for i, x in enumerate(user_inputs) if any(stage.get(u) == s for u in x.users)] for s in range(k)]
    for s, values in enumerate(crossing):
        for n in values:
            if not isinstance(n.meta.get("val"), torch.Tensor):
                raise ValueError(f"pipeline= cut between stages {s} and {s + 1} would send {n.name}, which is not a "
                                 "tensor; plan it without pipeline=")
    takes = [[] if s == 0 else crossing[s - 1] for s in range(k)]
    takes = [values + [user_inputs[i] for i in reads[s]] for s, values in enumerate(takes)]
    constants = ep.constants
    modules, metas = [], []
    for s in range(k):
        g = fx.Graph()
        env: dict = {}
        for j, n in enumerate(takes[s]):   # what crosses named by its place: stages alike read alike (planner.alike)
            env[n] = g.placeholder(n.name if n in mine else f"crossing_{j}")
            env[n].meta["val"] = n.meta.get("val")
        roots: dict = {}

        def copy(fxn):   # fxn into the stage's graph, after what it reads from parameters alone
            for a in fxn.all_input_nodes:
                if a in env:
                    continue
                if a in attrs:
                    target = attrs[a]
                    roots[target] = _attribute(model, constants, target, graph.param_aliases)
                    env[a] = g.get_attr(target)
                elif a in derived:
                    copy(a)
            env[fxn] = g.node_copy(fxn, env.__getitem__)

        for fxn in gm.graph.nodes:
            if fxn.op == "call_function" and stage.get(fxn) == s:
                copy(fxn)
        if s == k - 1:
            g.output(env[outs[0]])
        else:
            g.output(tuple(env[n] for n in crossing[s]))
        modules.append(fx.GraphModule(roots, g, class_name=f"Stage{s}"))
        metas.append(tuple((tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in takes[s]))
    names = [[] for _ in range(k)]
    for i in indices:
        names[stage_of_block[i]].append(f"{container}.{i}")
    return Stages(tuple(tuple(b) for b in names), tuple(modules), tuple(metas), tuple(tuple(r) for r in reads),
                  outs[0].meta["val"].dtype)


def _from_parameters(fxn: fx.Node, attrs: dict, derived: set) -> bool:
    """Whether ``fxn`` computes, the same each time, from parameters, buffers and constants alone
    (or from values so made)."""
    inputs = fxn.all_input_nodes
    tags = getattr(fxn.target, "tags", ())
    return bool(inputs) and all(a in attrs or a in derived for a in inputs) and \
        torch.Tag.nondeterministic_seeded not in tags


def _scalar_loss(n) -> bool:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point


def _attribute(model, constants: dict, target: str, aliases: dict):
    """The model's own parameter or buffer named ``target`` (a tied one under the name the
    graph uses), or the constant the export lifted under it."""
    if target in constants:
        return constants[target]
    try:
        return model.get_parameter(target)
    except AttributeError:
        return model.get_buffer(target)
