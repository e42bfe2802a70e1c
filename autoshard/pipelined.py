"""``parallelize`` with a pipeline: each rank builds and runs its own stage.

model + whole batch
  -> plan      rank 0 cuts and plans every stage (planner.pipeline); every rank takes its plan
  -> cut       every rank cuts the model alike (passes.stages) and keeps its stage's program
  -> lower     the stage captured on its own, lowered for this rank's place on the other axes
  -> shard     the stage's parameters become this rank's DTensor shares on those axes
  -> run       torch.distributed.pipelining's PipelineStage and schedule (runtime.pipeline)
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard._compat import set_collective_timeout, tree_flatten, tree_map_only
from autoshard.inputs import crossing_layout
from autoshard.passes.lower import lower
from autoshard.planner.pipeline import PipelinePlan, capture_stage, cut, input_device, plan_pipeline, stage_policy
from autoshard.precision import reduce_dtype
from autoshard.runtime import agree, optim
from autoshard.placement import local_shape
from autoshard.runtime.mesh import RankMesh, dtensor_placements, make_joint_groups
from autoshard.arguments import SPLIT_BACKWARD
from autoshard.runtime.pipeline import Runner, Shares, StageProgram

AXIS_NAMES = ("pipeline", "axis1", "axis2", "axis3", "axis4")


def pipeline_mesh(world: int, options) -> tuple:
    """The mesh of a pipelined plan: ``options.mesh`` (its first axis the pipeline's), else the
    pipeline and one axis of the ranks each stage has."""
    k = options.pipeline
    if options.mesh is not None:
        if options.mesh[0] != k:
            raise ValueError(f"with pipeline={k} the mesh's first axis is the pipeline's: mesh {options.mesh} must "
                             f"start with {k}, as mesh=({k}, ...)")
        return tuple(options.mesh) if len(options.mesh) > 1 else (k, 1)
    if world % k:
        raise ValueError(f"pipeline={k} stages must divide the world, {world} devices: pass pipeline= a divisor of it")
    return (k, world // k)


def parallelize_pipeline(model: nn.Module, example_inputs, mesh_shape: tuple, plan: Optional[PipelinePlan],
                         options, plan_stage, overlap: bool = True, timeout: Optional[float] = None,
                         local: bool = False) -> "ParallelPipeline":
    """``local``: each rank passes its own rows (``inputs="local"``), the global batch being the
    ranks' rows in rank order, gathered whole at every call (``whole_batch``): the first stage
    takes the batch whole, and the last its targets."""
    if example_inputs is None:
        raise ValueError("parallelize with a pipeline needs example_inputs (the whole batch a step takes): the "
                         "stages are cut and captured from them")
    if local:
        example_inputs = whole_batch(example_inputs)
    if plan is None:   # rank 0 plans, every rank takes its plan
        plan = PipelinePlan.from_json(agree.from_first_rank(
            lambda: plan_pipeline(model, example_inputs, mesh_shape, options, plan_stage).to_json()))
    return ParallelPipeline(model, plan, example_inputs, options.outputs, overlap, timeout, local)


def whole_batch(inputs):
    """Every rank's own rows of each input of one dim or more (``inputs="local"``), gathered
    whole in rank order (ragged too); a tensor of no dim is the same on every rank. Collective."""
    def gather(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            return x
        rows = torch.tensor([x.shape[0]], device=x.device)
        counts = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, rows)
        counts = [int(c) for c in counts]
        most = max(counts)
        padded = torch.cat([x, x.new_zeros((most - x.shape[0],) + tuple(x.shape[1:]))]) if most > x.shape[0] else x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([part[:c] for part, c in zip(parts, counts)])
    return tree_map_only(torch.Tensor, gather, inputs)


_MESHES: dict = {}   # (rank, device type, shape) -> DeviceMesh with the pipeline axis named


def _device_mesh(device_type: str, shape: tuple):
    key = (dist.get_rank(), device_type, shape)
    world, mesh = _MESHES.get(key, (None, None))
    if world is not dist.group.WORLD:
        from torch.distributed.device_mesh import init_device_mesh
        world, mesh = dist.group.WORLD, init_device_mesh(device_type, shape, mesh_dim_names=AXIS_NAMES[:len(shape)])
        _MESHES[key] = (world, mesh)
    return mesh


class ParallelPipeline(nn.Module):
    """The model as one rank of a pipeline runs it: it holds its stage's parameters (their names
    in the model) and ``module(*batch)`` returns the whole batch's loss on every rank; that
    loss's ``backward()`` puts the step's gradients in ``param.grad`` (runtime.pipeline)."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, example_inputs, outputs: str, overlap: bool,
                 timeout: Optional[float] = None, local: bool = False):
        super().__init__()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        k, inner = plan.mesh_shape[0], tuple(plan.mesh_shape[1:])
        if math.prod(plan.mesh_shape) != dist.get_world_size():
            raise ValueError(f"the plan is for {math.prod(plan.mesh_shape)} devices but the process group has "
                             f"{dist.get_world_size()}")
        with torch.no_grad():   # every rank starts from rank 0's values, as parallelize promises
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        policy = stage_policy(plan)   # the plan's own: a saved plan runs under the policy it was made for
        n = len(plan.stages)          # k stages, or k v chunks where each rank holds v (interleaved)
        stages = cut(model, example_inputs, k, plan.microbatches, outputs, plan.starts, policy, plan.virtual)
        mesh = _device_mesh(device.type, tuple(plan.mesh_shape))
        sub = mesh[AXIS_NAMES[1:len(plan.mesh_shape)]]
        r = mesh.get_coordinate()[0]
        seed = [torch.initial_seed() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(seed, src=0)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed[0]) % (2 ** 63))
        at = input_device(example_inputs)
        joint: dict = {}
        made: dict = {}   # the model's parameters as sharded, by id: two chunks of a rank may hold one
        chunks, programs = [], []
        shares = Shares()   # the parameters' shares the rank's programs take, one per parameter
        # zero bubble runs each parameter group's weight pass on its own: no gradient bucket (the
        # schedule pass's) may span groups, and what a microbatch keeps unreduced hands on zeros
        split = plan.schedule in SPLIT_BACKWARD
        for st in plan.chunks(r):   # each with its own program and rank mesh (what a collective keeps is the program's)
            s, held = st.index, stages.modules[st.index]
            graph = capture_stage(stages, s, at, outputs, policy)
            rank_mesh = RankMesh(sub, gen, joint)
            rank_mesh.reduce_dtype = reduce_dtype(policy)   # the stage's gradients reduced in the policy's dtype
            rank_mesh.held_as_zeros = split
            program = lower(graph, st.plan, device=device, coords=rank_mesh.coords, overlap=overlap and not split)
            _shard(held, st.plan, sub, made)
            # what crosses between stages: a floating tensor carries a gradient back (torch's stage
            # reads which from these examples); the user's inputs a stage reads it takes from the
            # rank's own call (``StageProgram.reads``), never sent
            takes = _crossing(stages, s, at, inner)
            gives = _crossing(stages, s + 1, at, inner) if s + 1 < n else torch.zeros((), dtype=stages.loss_dtype, device=at)
            chunks.append((StageProgram(program, held, _slots(graph, held, device), rank_mesh, first=s == 0,
                                        last=s == n - 1, split_backward=split, reads=stages.reads[s], shares=shares),
                           s, takes, gives))
            programs.append(program)
        _joint_groups(mesh, {tuple(a) for prog in programs for a in prog.meta["joint_axes"]}, joint)
        holder = _holder([c[0].held for c in chunks])
        ties = _tie_groups(plan, [c[1] for c in chunks], sub.get_coordinate()[0] if sub.ndim == 1 else 0)
        last = plan.stages[n - 1].ranks[plan.stages[r].ranks.index(dist.get_rank())]
        runner = Runner(chunks, k, plan.microbatches, mesh.get_group("pipeline"), last, device, ties, stages.loss_dtype,
                        holder, plan.schedule)
        if timeout is not None:   # every collective and send of the pipeline's groups
            set_collective_timeout([*mesh.get_all_groups(), *joint.values(), *(g for _, g, _ in ties)], timeout)
        self._modules = holder._modules          # named_parameters and state_dict: the rank's, by their names
        self._parameters = holder._parameters
        self._buffers = holder._buffers
        self.__dict__.update(_model=model, _plan=plan, _runner=runner, _stage=r, device_mesh=mesh,
                             _programs=programs, _chunks=tuple(c[1] for c in chunks),
                             _shapes=[tuple(x) for x in plan.input_shapes], _local=local)

    @property
    def plan(self) -> PipelinePlan:
        return self._plan

    @property
    def stage(self) -> int:
        """The stage this rank runs: its coordinate on the pipeline axis."""
        return self._stage

    @property
    def chunks(self) -> tuple:
        """The indices in ``plan.stages`` of the stages this rank runs: ``(stage,)``, or under
        ``virtual=v`` its ``v`` chunks."""
        return self._chunks

    @property
    def program(self) -> str:
        """This rank's stage programs, as Python."""
        return "\n".join(f"# autoshard pipeline stage {c}, built by: {', '.join(p.meta['passes'])}\n" + p.code
                         for c, p in zip(self._chunks, self._programs))

    def no_sync(self):
        """Gradient accumulation, as ``ParallelModule.no_sync``: the steps run inside reduce no
        gradient over the stages' data axes; each rank keeps its unreduced sum, which the first
        step outside adds to what it reduces."""
        return self._runner.no_sync()

    def train(self, mode: bool = True):
        self._model.train(mode)
        return super().train(mode)

    def forward(self, *args, **kwargs):
        if self._local:   # each rank's own rows: the batch whole
            args, kwargs = whole_batch((args, kwargs))
        # in the order capture saw them: positional, then keywords by name (capture.normalize_inputs)
        leaves = [x for x in tree_flatten((args, dict(sorted(kwargs.items()))))[0] if isinstance(x, torch.Tensor)]
        shapes = [tuple(x.shape) for x in leaves]
        if shapes != self._shapes:
            raise ValueError(f"a pipeline runs the batch shapes it was cut for, {self._shapes}; got {shapes}. Pass "
                             "batches of that shape (drop or pad a ragged last one)")
        if self.training and torch.is_grad_enabled():
            return self._runner.step(leaves)
        return self._runner.evaluate(leaves)


def _joint_groups(mesh, wanted: set, joint: dict) -> None:
    """The groups spanning several of the stages' axes at once that any rank's programs run a
    collective on (``wanted``: this rank's, as axes of the stage's mesh), into ``joint`` (the
    ``RankMesh``es' own). Collective: every rank makes every group, each stage's its own, since
    the stages' programs differ."""
    if not dist.is_initialized():
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(wanted))
    make_joint_groups(mesh.mesh, sorted({tuple(a) for got in every for a in got}), joint, first=1)


def _crossing(stages, s: int, at, inner: tuple) -> tuple:
    """Examples of what one rank of stage ``s`` receives from the stage before: its share of
    each tensor in its crossing layout on the stage's axes ``inner`` (``inputs.crossing_layout``,
    which splits evenly: every rank's share is of one shape)."""
    return tuple(torch.zeros(local_shape(shape, crossing_layout(shape, inner), inner), dtype=dtype, device=at)
                 .requires_grad_(dtype.is_floating_point) for shape, dtype in stages.crossing(s))


def _slots(graph, held: nn.Module, device) -> list:
    """Per parameter and buffer placeholder of a stage's program: (registry name, module,
    attribute), the program reading ``getattr(module, registry)[attribute]`` at each step, or the
    constant it takes."""
    slots = []
    buffers = dict(held.named_buffers())
    for n in graph.nodes:
        if n.kind not in ("param", "buffer"):
            continue
        prefix, _, name = n.fqn.rpartition(".")
        if n.kind == "param":
            slots.append(("_parameters", held.get_submodule(prefix), name))
        elif n.fqn in buffers:
            slots.append(("_buffers", held.get_submodule(prefix), name))
        else:
            slots.append(graph.exported.constants[n.fqn].to(device))
    return slots


def _holder(helds: list) -> nn.Module:
    """One module holding, under their names in the model, the parameters and buffers of every
    stage a rank runs (the same objects: the stages' programs read them there)."""
    if len(helds) == 1:
        return helds[0]
    holder = nn.Module()
    for held in helds:
        for kind, named in (("parameter", held.named_parameters()), ("buffer", held.named_buffers())):
            for name, t in named:
                prefix, _, leaf = name.rpartition(".")
                into = holder
                for part in prefix.split(".") if prefix else ():
                    if part not in into._modules:
                        into.add_module(part, nn.Module())
                    into = into._modules[part]
                table = into._parameters if kind == "parameter" else into._buffers
                if leaf in table and table[leaf] is not t:
                    raise ValueError(f"two chunks of one rank hold {name}: pass a smaller virtual=, or pipeline= that "
                                     "keeps the stages that share it on other ranks")
                table[leaf] = t
    return holder


def _shard(held: nn.Module, splan, sub, made: dict) -> None:
    """The stage's parameters as this rank's DTensor shares on ``sub``, the mesh of the other
    axes (every rank has rank 0's values: each takes its share where it is). ``made``: the model's
    parameters already sharded for another chunk of this rank, which this one takes as they are
    (an embedding tied to the head, both ends of ZBV's V on the first rank)."""
    from torch.distributed.tensor import distribute_tensor
    for fqn, p in list(held.named_parameters()):
        placements = tuple(splan.params.get(fqn, ("B",) * sub.ndim))
        prefix, _, name = fqn.rpartition(".")
        if id(p) in made:
            new, before = made[id(p)]
            if before != placements:
                raise ValueError(f"two chunks of one rank hold {fqn}, laid out {before} and {placements}: pin it "
                                 "(pin={...}) to one layout")
            held.get_submodule(prefix)._parameters[name] = new
            continue
        dt = dtensor_placements(placements, fqn)
        new = nn.Parameter(distribute_tensor(p.detach(), sub, dt, src_data_rank=None), requires_grad=p.requires_grad)
        held.get_submodule(prefix)._parameters[name] = new
        made[id(p)] = (new, placements)
        optim.adopt([new])
        optim.retire(p, fqn, new)


def _tie_groups(plan: PipelinePlan, mine: list, coord: int) -> list:
    """[(name, group, same placements)] for every parameter this rank's stages ``mine`` share
    with another rank's. Collective: every rank makes every group, in one order."""
    holders: dict = {}
    for st in plan.stages:
        for name in st.plan.params:
            holders.setdefault(name, []).append(st.index)
    # held by chunks of one rank alone: one parameter there (``_shard``), nothing to sum across ranks
    shared = {name: tuple(h) for name, h in holders.items() if len({plan.stages[i].ranks for i in h}) > 1}
    groups = {}
    for hs in sorted(set(shared.values())):
        lists = [sorted({plan.stages[h].ranks[c] for h in hs}) for c in range(len(plan.stages[0].ranks))]
        if len(lists[0]) < len(hs):
            raise ValueError(f"stages {list(hs)} share a parameter, two of them on one rank and one on another: pass "
                             "another virtual= or schedule=")
        groups[hs], _ = dist.new_subgroups_by_enumeration(lists)
    out = []
    for name, hs in sorted(shared.items()):
        if set(mine) & set(hs):
            same = len({tuple(plan.stages[h].plan.params[name]) for h in hs}) == 1
            out.append((name, groups[hs], same))
    return out

