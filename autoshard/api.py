"""The public entry points: ``plan`` and ``parallelize``.

model -> capture (torch.export) -> annotate (SBP rules) -> solve (ILP) -> Plan
      -> rewrite (per-rank fx program) -> run on torch.distributed
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard import placement as pl
from autoshard.runtime import agree, optim
from autoshard.runtime.mesh import dtensor_placements
from autoshard import runtime
from autoshard._compat import compiled_within, set_collective_timeout, tree_flatten, tree_map_only, tree_unflatten
from autoshard.arguments import MAX_AXES, check_bool, check_mesh, check_module, check_number, check_options
from autoshard import cache
from autoshard import inputs as inputs_mod
from autoshard.machine.cluster import DEFAULT_CLUSTER, Cluster
from autoshard.machine.measure import MEASURE, kept_measure, resolve_cluster
from autoshard.options import PLAN_OPTIONS, PlanOptions
from autoshard.outputs import WHOLE
from autoshard.feed import Feed, Program
from autoshard.passes.annotate import annotate
from autoshard.ir import Graph
from autoshard.passes.capture import capture, normalize_inputs
from autoshard.passes.lower import lower
from autoshard.planner.axonn_start import axonn_start
from autoshard.planner.search import search
from autoshard.planner.descend import lifted_starts, solve_mesh
from autoshard.planner.progress import shown
from autoshard.planner.recompute import AUTO
from autoshard.planner.reuse import Reuse, reuse
from autoshard.cost.price import Costs
from autoshard.plan import Plan
from autoshard.planner.make import make_plan
from autoshard.planner.pipeline import PipelinePlan, plan_pipeline
from autoshard.planner.pipeline_search import search_pipeline
from autoshard.pipelined import parallelize_pipeline, pipeline_mesh
from autoshard.precision import ambient_autocast, policy_from_record, reduce_dtype



def resolve_mesh(world, mesh) -> tuple:
    if world is not None and (not isinstance(world, int) or isinstance(world, bool)):
        raise TypeError(f"world is a number of devices (an int), got {world!r}")
    if world is not None and world < 1:
        raise ValueError(f"world must be at least 1 device, got {world}")
    if mesh is None:
        if world is None:
            raise ValueError("say how many devices to plan for: world=N, or mesh=(a, b, ...)")
        return (world,)
    mesh = check_mesh(mesh, MAX_AXES)
    if world is not None and math.prod(mesh) != world:
        raise ValueError(f"mesh {mesh} holds {math.prod(mesh)} devices but world={world}; make the "
                         "product of the axis sizes equal world")
    return mesh


class PresetWarning(UserWarning):
    """A program run on CPUs planned for the default cluster, a GPU one (``parallelize``)."""


_PRESET_WARNED = [False]


def _warn_preset_on_cpu(cluster, device: torch.device) -> None:
    """Once a process: the default cluster describes A100 GPUs; a CPU group planned for it gets
    a plan and an estimated step priced for them, which nothing on this machine says."""
    if cluster is not None or device.type != "cpu" or _PRESET_WARNED[0]:
        return
    _PRESET_WARNED[0] = True
    warnings.warn(f"autoshard plans for the default cluster, {DEFAULT_CLUSTER!r} (A100 GPUs), but this group runs "
                  "on CPUs: the plan and its estimated step are priced for those GPUs. Pass cluster=\"measure\" to "
                  "plan for this machine (measured once, on every rank), or a Cluster that describes it",
                  PresetWarning, stacklevel=4)


def resolve_pins(graph: Graph, pin: Optional[dict], naxes: int) -> dict:
    if not pin:
        return {}
    if not isinstance(pin, dict):
        raise TypeError("pin is a dict {name: placements}, e.g. {'fc1.weight': ('S(0)',)}")
    param_node = {n.fqn: n.name for n in graph.nodes if n.kind == "param"}
    out = {}
    for name, value in pin.items():
        if name in graph.param_aliases:
            node = param_node.get(graph.param_aliases[name])
        elif name in graph.by_name and graph.by_name[name].kind != "output":
            node = name
        else:
            node = None
        if node is None:
            known = list(graph.param_aliases) + [n.name for n in graph.nodes if n.kind == "op"]
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"cannot pin {name!r}: it is neither a parameter of the model nor a node of "
                             f"its graph.{hint}")
        if isinstance(value, str) and "->" in value:   # the node's whole strategy: inputs too
            ins, outs = pl.parse_strategy(value)
            if len(outs[0]) != naxes:
                raise ValueError(f"pin {name!r}: strategy {value!r} names {len(outs[0])} mesh axes, but the mesh "
                                 f"has {naxes}: give one placement per axis")
            out[node] = (ins, outs)
        else:
            out[node] = pl.parse_nd(value, naxes)
    return out


def _budget(options: PlanOptions, cluster: Cluster) -> float:
    return cluster.memory if options.memory_budget is None else options.memory_budget


def plan_graph(graph: Graph, mesh_shape, options: PlanOptions = PlanOptions()) -> Plan:
    """The plan of ``graph`` on a mesh of ``mesh_shape`` (its options checked when made)."""
    cluster = resolve_cluster(options.cluster)
    budget = _budget(options, cluster)
    pins = resolve_pins(graph, options.pin, len(mesh_shape))
    strategies = annotate(graph, mesh_shape, pins)
    costs = Costs(graph, mesh_shape, cluster, options.training, options.bucket_bytes, options.reshard_after_forward,
                  recompute=options.recompute, inputs=options.inputs)
    time_limit = options.time_limit
    starts = (lambda: []) if pins else (lambda: lifted_starts(graph, strategies, costs, time_limit, budget))
    with shown(options.verbose):   # a long solve's progress on stderr
        solution = solve_mesh(graph, strategies, costs, time_limit, budget, starts)   # 3+ axes: planner.descend
    return make_plan(graph, strategies, solution, costs, budget=budget)


def plan(model: nn.Module, example_inputs, *, world=None, mesh=None, cluster=None, pin=None,
         training: bool = True, time_limit: float = 60.0, bucket_bytes: Optional[int] = None,
         memory_budget: Optional[float] = None, reshard_after_forward: bool = False, outputs: str = WHOLE,
         inputs: str = "whole", verbose: bool = True, recompute: str = AUTO,
         mp_policy=None, pipeline: Optional[int] = None, microbatches: Optional[int] = None, virtual: int = 1,
         schedule: Optional[str] = None):
    """Plan the layout of every tensor of ``model`` for ``world`` devices (or a ``mesh``).

    Needs no process group; the model and inputs may live on the meta device. Every rank's
    parameters, gradients, Adam state and activations stay within ``memory_budget`` bytes
    (default: the cluster's device memory). ``bucket_bytes`` is the size of the gradient
    all-reduce buckets the schedule pass forms, and the cost model prices; by default the
    smallest whose latency is a small part of its all-reduce on the cluster's links
    (``cost.buckets.bucket_bytes_for``).

    ``reshard_after_forward=True`` frees every parameter gathered (or otherwise converted) for
    an op once the forward has used it, and gathers it again when the op's backward needs it,
    as PyTorch's FSDP does: a parameter stored split then holds only its share between uses, at
    the price of the gathers run again in backward. By default the converted parameter is kept
    from forward to backward (faster, and counted in the activations). A mesh search or solve
    that runs more than a couple of seconds reports its progress on stderr; ``verbose=False``
    keeps it quiet.

    ``mp_policy`` (``torch.distributed.fsdp.MixedPrecisionPolicy``): parameters kept in their own
    dtype (fp32 masters, stepped by the optimizer), computed in ``param_dtype``, gradients reduced
    in ``reduce_dtype``, outputs cast to ``output_dtype``, as FSDP2 does; a caller's enabled
    ``torch.autocast`` around the call is planned too. Both are priced at the dtypes that run
    (``autoshard.precision``).

    ``outputs="dtensor"`` hands each user output back as a DTensor in its planned layout (logits
    split over the vocabulary, say, for ``loss_parallel``), and the plan prices no conversion for
    it; by default (``"whole"``) every output is made whole on every rank, and that is priced.

    ``inputs="local"``: ``example_inputs`` are the global batch, but each rank will pass its own
    rows of it (``parallelize(..., inputs="local")``), rank r chunk r along dim 0, which is
    ``S(0)`` on every mesh axis; each input's conversion from there to its planned layout is
    priced (nothing for a data-parallel layout, a gather where an axis needs the batch whole)
    and the plan records the arrival (``plan.arrival``, ``autoshard.inputs``).

    ``pipeline=k`` (k > 1) cuts the model between its repeated blocks into ``k`` stages along one
    more mesh axis, the first, each stage planned on the other axes (``mesh=(k, ...)``, or
    ``(k, world // k)``), its batch cut into ``microbatches`` (by default up to ``2 k``), and
    returns an ``autoshard.planner.pipeline.PipelinePlan`` (``plan.stages``). ``virtual=v`` (v > 1)
    cuts it into ``k v`` chunks instead, rank coordinate ``r`` on the pipeline axis holding chunks
    ``r, r + k, ...``, run by the interleaved 1F1B schedule (a bubble ``v`` times smaller, ``v``
    times the sends). ``schedule=`` names torch's schedule to run: ``"1F1B"``, ``"GPipe"``,
    ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"`` (input and weight gradients apart, the
    weights' filling the bubble) or ``"ZBVZeroBubble"`` (two chunks per rank in a V: ``r`` and
    ``2k - 1 - r``; it does not evaluate); by default 1F1B (GPipe with fewer
    microbatches than stages), interleaved where ``virtual > 1``. ``pipeline=1`` plans without a
    pipeline; ``None`` (with the mesh searched) plans one where a pipeline across the nodes'
    network beats the best plan without (``planner.pipeline_search.search_pipeline``).

    ``recompute``: whether repeated blocks (``blocks.0``, ``blocks.1``, ...) keep their
    activations for backward or only their inputs, running their forward again in backward
    (``torch.utils.checkpoint``): ``"auto"`` lets the solver choose per block, against the memory
    budget, ``"blocks"`` recomputes every one, ``"none"`` none (``plan.recompute`` and
    ``str(plan)`` say which blocks and what it costs).

    The options travel on as one ``autoshard.options.PlanOptions``, checked here."""
    check_module("model", model)
    normalize_inputs(example_inputs)
    options = PlanOptions(mesh=mesh, cluster=cluster, pin=pin, training=training, time_limit=time_limit,
                          bucket_bytes=bucket_bytes, memory_budget=memory_budget,
                          reshard_after_forward=reshard_after_forward, outputs=outputs, verbose=verbose,
                          recompute=recompute, mp_policy=mp_policy, inputs=inputs, pipeline=pipeline,
                          microbatches=microbatches, virtual=virtual, schedule=schedule)
    if options.pipelined:   # stages on a first mesh axis, each planned as a model of its own
        mesh_shape = resolve_mesh(world, options.mesh)
        return plan_pipeline(model, example_inputs, pipeline_mesh(math.prod(mesh_shape), options), options, plan_graph)
    mesh_shape = resolve_mesh(world, options.mesh)
    graph = capture(model, example_inputs, outputs=options.outputs, mp_policy=options.mp_policy,
                    autocast=ambient_autocast(_device_type(model)))
    if options.mesh is None and world > 1:
        best = search_mesh(graph, world, options)
        if options.pipeline is None:   # where a pipeline across the nodes' network beats it (planner.pipeline)
            return search_pipeline(model, example_inputs, graph, world, options, best, plan_graph)
        return best
    return plan_graph(graph, mesh_shape, options)


def _axonn_start(graph: Graph, world: int, cluster: Cluster, budget: float):
    """(mesh, pins by node) of AxoNN's best-ranked grid, for the mesh search to descend from
    (``planner.axonn_start``); None where it has none."""
    got = axonn_start(graph, world, cluster, budget)
    return None if got is None else (got[0], resolve_pins(graph, got[1], len(got[0])))


def search_mesh(graph: Graph, world: int, options: PlanOptions = PlanOptions()) -> Plan:
    """The best plan over the mesh shapes ``world`` factors into (planner.search)."""
    cluster = resolve_cluster(options.cluster)
    budget = _budget(options, cluster)
    pin = options.pin
    arity = {len(pl.parse_strategy(v)[1][0]) if isinstance(v, str) and "->" in v else 1 if isinstance(v, str)
             else len(tuple(v)) for v in (pin or {}).values()}
    if len(arity) > 1:
        raise ValueError(f"the pins name different numbers of mesh axes ({sorted(arity)}); give every pin "
                         "one placement per axis of one mesh, or pass mesh=")
    resolve_pins(graph, pin, next(iter(arity), 1))  # an unknown name fails here, whatever the mesh

    def pins_for(mesh_shape):
        if arity and arity != {len(mesh_shape)}:
            return None
        return resolve_pins(graph, pin, len(mesh_shape))

    with shown(options.verbose):   # the search's progress on stderr
        plan = search(graph, world, cluster, pins_for, options.training, options.time_limit, options.bucket_bytes,
                      budget, reshard=options.reshard_after_forward, recompute=options.recompute,
                      inputs=options.inputs, seed=None if pin else lambda: _axonn_start(graph, world, cluster, budget))
    return plan


def _device_type(model: nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")


# ---- running ------------------------------------------------------------------------------------

def parallelize(model: nn.Module, example_inputs=None, *, world=None, plan: Optional[Plan] = None,
                overlap: bool = True, timeout: Optional[float] = None, inputs: str = "whole",
                compile: bool = False, **plan_kwargs) -> "ParallelModule":
    """``model`` for the current rank of an initialized process group.

    With ``example_inputs`` (or a ``plan``) it plans and shards the parameters now; without, at
    its first call, from the real inputs. Like FSDP, it takes the model over: its parameters are
    replaced, in place, by this rank's DTensor shares; an optimizer built before is handed them, its
    state cut to their layouts, at its first step (``runtime.optim``). ``overlap=False`` skips the schedule pass:
    every collective then runs where the rewriter put it, one gradient at a time (for debugging
    and for measuring what the schedule gains). ``timeout`` (seconds) bounds every collective on
    the module's process groups (the mesh's, and those spanning several axes), which otherwise
    wait as long as torch's default for each (gloo: the default group's ``init_process_group``
    timeout, its subgroups 30 minutes); a rank that never arrives then makes the others raise. The
    ranks' agreement on the plan runs under it too (rank 0 plans while the others wait): give at
    least the time planning takes. ``inputs``: ``"whole"``, every rank passes the same whole batch; ``"local"``, each rank passes
    its own (as with DDP and a DistributedSampler): the global batch is the ranks' batches
    concatenated in rank order along dim 0, which arrives split on dim 0 over every mesh axis;
    the plan prices each input's conversion from there to its layout and the program runs it
    (nothing on a data-parallel layout, a gather on an axis that needs the batch whole:
    ``autoshard.inputs``). Every output with that batch dim comes back as this rank's rows
    (``ParallelModule.data_shards``, ``data_rank``).
    ``compile=True`` compiles each rank's program whole with ``torch.compile`` (inductor),
    forward and backward, its collectives traced as functional collectives in the schedule's
    order (``passes.compile``); each new input shape compiles once."""
    check_module("model", model)
    inputs_mod.check_inputs(inputs)
    if example_inputs is not None:
        normalize_inputs(example_inputs)
    if isinstance(plan, PipelinePlan) or (plan is None and plan_kwargs.get("pipeline") not in (None, 1)):
        if compile:
            raise ValueError("a pipeline does not yet take compile=True: leave it out, or parallelize without pipeline=")
        if timeout is not None:
            timeout = check_number("timeout", timeout, positive=True, hint="seconds a collective may wait")
        return _parallelize_pipeline(model, example_inputs, world, plan, overlap, plan_kwargs, timeout,
                                     inputs == inputs_mod.LOCAL)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan is an autoshard.Plan (Plan.from_json(text) reads one back), got {type(plan).__name__}")
    check_bool("overlap", overlap)
    check_bool("compile", compile)
    if timeout is not None:
        timeout = check_number("timeout", timeout, positive=True, hint="seconds a collective may wait")
    check_options("parallelize", plan_kwargs, PLAN_OPTIONS)
    options = dataclasses.replace(_options_of(plan, plan_kwargs), inputs=inputs)
    if plan is not None and plan.arrival and inputs != inputs_mod.LOCAL:
        raise ValueError("the plan was made for inputs=\"local\" (each rank its own rows), which it priced; pass "
                         "inputs=\"local\", or plan again without it")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("autoshard.parallelize needs a process group: launch with torchrun and call "
                           "torch.distributed.init_process_group() first (gloo on CPU, nccl on GPU)")
    size = dist.get_world_size()
    if world is None:
        world = plan.world if plan is not None else size
    mesh_shape = resolve_mesh(world, options.mesh)
    if math.prod(mesh_shape) != size:
        raise ValueError(f"planned for {math.prod(mesh_shape)} devices but the process group has {size}; "
                         f"pass world={size} or launch {math.prod(mesh_shape)} processes")
    if plan is not None and tuple(plan.mesh_shape) != mesh_shape and "mesh" in plan_kwargs:
        raise ValueError(f"plan was made for mesh {plan.mesh_shape}, not {mesh_shape}")
    if plan is not None:
        mesh_shape = tuple(plan.mesh_shape)
    given = {k: v for k, v in plan_kwargs.items() if k != "mesh"}
    agree.check_call(model, plan, mesh_shape, overlap, given, timeout, inputs)   # before any collective
    pm = ParallelModule(model, mesh_shape, plan, options, overlap=overlap, training_given="training" in plan_kwargs,
                        local=inputs == "local", timeout=timeout, compile=compile)
    if example_inputs is not None:
        pm.prepare(example_inputs)
    return pm


def _parallelize_pipeline(model, example_inputs, world, plan, overlap: bool, plan_kwargs: dict, timeout=None,
                          local: bool = False):
    """``parallelize`` with pipeline stages (``autoshard.pipelined``)."""
    check_options("parallelize", plan_kwargs, PLAN_OPTIONS)
    options = PlanOptions(**plan_kwargs)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("autoshard.parallelize needs a process group: launch with torchrun and call "
                           "torch.distributed.init_process_group() first (gloo on CPU, nccl on GPU)")
    if plan is not None:
        mesh_shape = tuple(plan.mesh_shape)
    else:
        mesh_shape = pipeline_mesh(world or dist.get_world_size(), options)
    if math.prod(mesh_shape) != dist.get_world_size():
        raise ValueError(f"planned for {math.prod(mesh_shape)} devices but the process group has "
                         f"{dist.get_world_size()}; pass world={dist.get_world_size()}")
    return parallelize_pipeline(model, example_inputs, mesh_shape, plan, options, plan_graph, overlap, timeout, local)


def _options_of(plan: Optional[Plan], plan_kwargs: dict) -> PlanOptions:
    """The options given, checked; with a ``plan``, its outputs and precision policy where they
    are not given (the graph is captured with them again)."""
    options = PlanOptions(**plan_kwargs)
    if plan is None:
        return options
    planned = plan.schedule.get("outputs", WHOLE)
    if "outputs" in plan_kwargs and planned != options.outputs:
        raise ValueError(f"outputs={options.outputs!r} but the plan was made for outputs={planned!r}, which it "
                         f"priced; plan again with outputs={options.outputs!r}, or leave outputs out to take the "
                         "plan's")
    policy = options.mp_policy if "mp_policy" in plan_kwargs else \
        policy_from_record((plan.schedule.get("precision") or {}).get("policy"))
    return dataclasses.replace(options, outputs=planned, mp_policy=policy)


def _planned(graph: Graph, mesh: tuple, options: PlanOptions) -> str:
    """The plan's JSON: the one kept on disk for these, else planned here and kept for the next
    start (``autoshard.cache``)."""
    name = cache.key(graph, mesh, options) if cache.directory() is not None else None
    text = cache.load(name) if name else None
    if text is None:
        text = plan_graph(graph, mesh, options).to_json()
        if name:
            cache.save(name, text)
    return text


_MESHES: dict = {}   # (rank, device type, mesh shape) -> (default group, DeviceMesh, groups spanning axes)


def _mesh_for(device_type: str, shape: tuple):
    """One DeviceMesh per shape per process group, and one set of the groups spanning several of
    its axes: torch keeps every process group made until the default one is destroyed, so each
    model parallelized on a mesh of 2 or more axes would otherwise add groups (and their sockets)
    that live as long as the process."""
    key = (dist.get_rank(), device_type, shape)   # the rank: simulate's ranks share this module
    world, mesh, joint = _MESHES.get(key, (None, None, None))
    if world is not dist.group.WORLD:
        from torch.distributed.device_mesh import init_device_mesh
        world, mesh, joint = dist.group.WORLD, init_device_mesh(device_type, shape), {}
        _MESHES[key] = (world, mesh, joint)
    return mesh, joint


class ParallelModule(nn.Module):
    """The model as one rank runs it: same names, same call signature, same results."""

    def __init__(self, model: nn.Module, mesh_shape, plan: Optional[Plan], options: PlanOptions, *,
                 overlap: bool = True, training_given: bool = False, local: bool = False,
                 timeout: Optional[float] = None, compile: bool = False):
        super().__init__()
        # share the model's registries so names, state_dict and tying stay the model's own
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if plan is None:
            _warn_preset_on_cpu(options.cluster, device)
        if options.cluster == MEASURE:   # collective: measured here (or read back, kept), on every rank, once
            options = dataclasses.replace(options, cluster=kept_measure())
        mesh, joint = _mesh_for(device.type, tuple(mesh_shape))
        seed = [torch.initial_seed() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(seed, src=0)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed[0]) % (2 ** 63))
        # kept out of nn.Module's registries, which are the model's
        self.__dict__.update(
            _model=model, _plan=plan, _options=options, _overlap=overlap, _device=device, device_mesh=mesh,
            _training_given=training_given,   # else each plan is for the model's mode when it is made
            _local=local, _timeout=timeout,
            _compile={} if compile else None,   # torch.compile's arguments (passes.compile), or None: eager
            _programs={},   # (training, shapes, constants) -> feed.Program
            _distributed=False,
            _rank_mesh=runtime.RankMesh(mesh, gen, joint))
        self._bound_collectives()

    @property
    def plan(self) -> Optional[Plan]:
        return self._plan

    def compile(self, **kwargs) -> None:
        """``nn.Module.compile``, in place: each rank's program compiled by
        ``torch.compile(**kwargs)`` as ``compile=True`` compiles it (``compile()`` with no
        arguments is the same), those made so far at once, each later one when made. Defaults:
        inductor, ``dynamic=False`` (each input shape is its own program), ``fullgraph=True``, and
        under inductor with neither ``mode`` nor ``options`` given the comm reordering passes
        (``passes.compile``). The feed (each parameter's share, the batch's rows) stays eager, so
        the compiled graph takes plain tensors: no guard on a parameter's layout and no graph
        break at a new input shape. ``torch.compile(module)`` compiles the same programs with only
        the arguments it is given (``forward``)."""
        self.__dict__["_compile"] = dict(kwargs)
        for key, made in self._programs.items():
            self._programs[key] = made._replace(program=self._lowered(made.graph, made.plan))

    def manual_seed(self, seed: int) -> None:
        """Seed the generator every rank shares for random ops (dropout)."""
        self._rank_mesh.generator.manual_seed(seed)

    def no_sync(self):
        """Gradient accumulation, as DDP's ``no_sync``: the backward of every forward run inside
        reduces no parameter gradient across ranks; a gradient that needs a reduction leaves
        ``param.grad`` as it was, and each rank keeps its unreduced sum (for a parameter stored
        split, the size of the whole parameter). The first backward of a forward run outside
        adds that sum to what it reduces, so the gradients arrive reduced once, summed over every
        micro-batch. Gradients that need no reduction accumulate in ``param.grad`` as usual, and
        activations' communication (tensor parallelism) still runs. Without the schedule pass
        (``overlap=False``) a parameter gathered before use still has its gradient reduced each
        time: the same sum, more often."""
        return self._rank_mesh.no_sync()

    def train(self, mode: bool = True):
        self._model.train(mode)
        return super().train(mode)

    @property
    def program(self) -> str:
        """The per-rank program of the most recent call, as Python."""
        if not self._programs:
            raise RuntimeError("no program yet: call the module once, or parallelize with example_inputs")
        program = next(reversed(self._programs.values())).program
        return f"# autoshard per-rank program, built by: {', '.join(program.meta['passes'])}\n" + program.code

    # -- planning --------------------------------------------------------------------------------
    def prepare(self, example_inputs):
        args, kwargs = normalize_inputs(example_inputs)
        if self._local:
            args, kwargs, _ = _arriving(args, kwargs)
        self._program_for(args, kwargs)

    @property
    def data_shards(self) -> int:
        """How many different batches the ranks pass: the world under ``inputs="local"``, else 1
        (every rank the same whole batch)."""
        return dist.get_world_size() if self._local else 1

    @property
    def data_rank(self) -> int:
        """Which of them this rank passes (a DistributedSampler's ``rank``)."""
        return dist.get_rank() if self._local else 0

    def _program_for(self, args, kwargs, leaves=None) -> Program:
        if leaves is None:
            leaves, _ = tree_flatten((args, kwargs))
        shapes = tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor))
        # non-tensor arguments (flags, sizes) are constants of the captured graph
        consts = tuple(repr(x) for x in leaves if not isinstance(x, torch.Tensor))
        autocast = ambient_autocast(self._device.type)
        key = (self._model.training, shapes, consts, autocast)
        if key in self._programs:
            return self._programs[key]
        return self._new_program(args, kwargs, leaves, shapes, consts, key)

    # traced within a compiled function that calls the module (``forward``), this runs eagerly: a
    # graph break once per new shape (with fullgraph=True, an error: call the module once
    # uncompiled with the new shape first); the next call traces whole
    @torch.compiler.disable(reason="autoshard captures and lowers a program for each new input shape, "
                                   "eagerly: call the parallel module once uncompiled with this shape first")
    def _new_program(self, args, kwargs, leaves, shapes, consts, key) -> Program:
        autocast = key[3]
        planned = next(iter(self._programs), None)   # every program's key holds the same constants
        if planned is not None and consts != planned[2]:
            raise ValueError(
                f"non-tensor arguments {list(consts)} differ from those the program was captured with "
                f"{list(planned[2])}: they are constants of the traced graph. Call with the same "
                "values, or parallelize a fresh copy of the model for these.")
        agree.check_inputs(self._model, leaves, shapes, consts, self._distributed, self._timeout)
        # the outputs and precision policy given, else those of the plan given (_options_of)
        graph = capture(self._model, kwargs if not args and kwargs else args, kwargs if args else None,
                        self._options.outputs, mp_policy=self._options.mp_policy, autocast=autocast)
        # other shapes (a ragged last batch, an eval batch) take the layout planned for this mode
        # where every node's is still legal, else are planned again keeping the nodes' whose is,
        # and the parameters where they are (_agree_on_plan), as a later mode is; once each
        kept = self._reused(graph, key)
        plan = kept.plan or self._agree_on_plan(graph, kept.pins)
        if not self._distributed:
            self._distribute(plan, graph)
        program = self._lowered(graph, plan)
        self._rank_mesh.prepare_groups(program.meta["joint_axes"])
        self._rank_mesh.reduce_dtype = reduce_dtype(policy_from_record((plan.schedule.get("precision") or {}).get("policy")))
        self._bound_collectives()
        self._programs[key] = Program(program, graph, plan, Feed(self._model, graph, plan, self._device))
        return self._programs[key]

    def _lowered(self, graph: Graph, plan: Plan) -> torch.nn.Module:
        return lower(graph, plan, device=self._device, coords=self._rank_mesh.coords, overlap=self._overlap,
                     compile=self._compile)

    def _reused(self, graph: Graph, key: tuple) -> Reuse:
        """What of the layout of the first program of this mode (and autocast) still holds for
        ``graph``, captured for new shapes (``planner.reuse``). Every rank decides alike from the
        same plan and graph, so this sends nothing."""
        training, autocast = key[0], key[3]
        first = next((p.plan for k, p in self._programs.items()
                      if k[0] == training and k[3] == autocast and p.plan.training == training), None)
        return Reuse(None, {}) if first is None else reuse(first, graph)

    def _bound_collectives(self):
        if self._timeout is not None:
            set_collective_timeout(self._rank_mesh.all_groups(), self._timeout)

    def _agree_on_plan(self, graph: Graph, kept: Optional[dict] = None) -> Plan:
        """Rank 0 plans and every rank takes its plan, so no two ranks can disagree. ``kept``: the
        output placements of the nodes whose layout still holds for these shapes (``Reuse.pins``),
        kept where a plan with them exists."""
        training = self._model.training
        if self._plan is not None and training == self._plan.training and not self._programs:
            return self._plan

        def make() -> str:
            options = self._options
            if self._distributed:  # a later plan (eval mode) keeps the parameters where they are
                pins = dict(options.pin or {})
                for n in graph.nodes:
                    if n.kind == "param":
                        pins[n.fqn] = self._plan.params[n.fqn]
                options = dataclasses.replace(options, pin=pins, training=training)
            elif not self._training_given:
                options = dataclasses.replace(options, training=training)
            mesh = tuple(self.device_mesh.shape)
            text = None
            if kept and self._distributed:
                try:
                    text = _planned(graph, mesh, dataclasses.replace(options, pin={**kept, **options.pin}))
                except ValueError:   # none with them within the budget: the nodes' layouts are free
                    text = None
            return text or _planned(graph, mesh, options)

        plan = Plan.from_json(agree.from_first_rank(make))
        if self._plan is None or not self._distributed:
            self.__dict__["_plan"] = plan
        return plan

    def _distribute(self, plan: Plan, graph: Graph):
        """Replace every parameter by this rank's DTensor share (from rank 0's values), and make
        buffers equal to rank 0's."""
        from torch.distributed.tensor import distribute_tensor
        mesh = self.device_mesh
        owners: dict = {}
        for mod_name, mod in self._model.named_modules(remove_duplicate=False):
            for pname, p in list(mod._parameters.items()):
                if p is not None:
                    fqn = f"{mod_name}.{pname}" if mod_name else pname
                    owners.setdefault(id(p), (p, []))[1].append((mod, pname, fqn))
        for p, places in owners.values():
            placement = next((plan.params[f] for _, _, f in places if f in plan.params), ("B",) * mesh.ndim)
            dt = dtensor_placements(placement, places[0][2])
            new = nn.Parameter(distribute_tensor(p.detach(), mesh, dt, src_data_rank=0), requires_grad=p.requires_grad)
            for mod, pname, _ in places:
                mod._parameters[pname] = new
            optim.adopt([new])
            optim.retire(p, places[0][2], new)
        with torch.no_grad():
            for b in self._model.buffers():
                dist.broadcast(b, src=0)
        self.__dict__["_distributed"] = True

    # -- running ---------------------------------------------------------------------------------
    # A user's ``torch.compile(module)`` runs this frame as Python (``_compat.compiled_within``) and
    # compiles what it calls: the program, whose graph then takes plain tensors (each parameter's
    # share, the batch's rows) and is guarded on them alone, a new input shape its own program,
    # made eagerly, compiled once; what feeds the program and what it hands back run eagerly
    # (``_eagerly``). Traced within a caller's compiled function, the whole call is traced.
    @compiled_within
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():   # inlined in a caller's trace
            program, inputs, feed, arrived = self._fed(args, kwargs)
            with runtime.active(self._rank_mesh), (runtime.regathering() if feed.again else contextlib.nullcontext()):
                outs = program(*inputs)
            return self._given_back(feed, outs, arrived)
        program, inputs, feed, arrived, running = _eagerly(self._started, args, kwargs)
        try:
            outs = program(*inputs)
        except BaseException:
            _eagerly(running.close)
            raise
        return _eagerly(self._finished, running, feed, outs, arrived)

    def _fed(self, args, kwargs):
        """(the program for these arguments, its inputs, its feed, what the ranks brought or None)."""
        kwargs = dict(sorted(kwargs.items()))   # the order capture saw them in (capture.normalize_inputs)
        arrived = None
        if self._local:   # each rank's own rows: planned as the global batch they make
            args, kwargs, arrived = _arriving(args, kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        program, _, _, feed = self._program_for(args, kwargs, leaves)
        given = [x for x in leaves if isinstance(x, torch.Tensor)] if arrived is None else \
            _fed(arrived, feed, self._rank_mesh.coords)
        return program, feed.inputs() + given, feed, arrived

    def _started(self, args, kwargs):
        """``_fed``'s, and the context the program runs in, entered (its mesh; the parameters
        gathered again in backward where the plan reshards them after forward)."""
        running = contextlib.ExitStack()
        fed = self._fed(args, kwargs)
        running.enter_context(runtime.active(self._rank_mesh))
        if fed[2].again:
            running.enter_context(runtime.regathering())
        return (*fed, running)

    def _finished(self, running, feed, outs, arrived):
        running.close()
        return self._given_back(feed, outs, arrived)

    def _given_back(self, feed, outs, arrived):
        out = feed.outputs(outs)
        return out if arrived is None else tree_map_only(torch.Tensor, lambda t: _own_rows(t, *arrived.rows), out)


@torch.compiler.disable
def _eagerly(fn, *args):
    """``fn(*args)``, run as Python where a compile runs the frame that calls it."""
    return fn(*args)


class _Arrived(NamedTuple):
    """``inputs="local"``: what each rank brought (``_arriving``). ``mine``: this rank's tensor
    arguments, as given; ``counts``: every rank's rows of each, by rank (a row per rank, a
    column per tensor of one dim or more, in ``mine``'s order); ``rows``: (first row, count,
    global rows) of this rank's rows, read off the first such tensor."""
    mine: list
    counts: list
    rows: tuple


def _arriving(args, kwargs):
    """``inputs="local"``: (args and kwargs with each tensor of a dim the shape of the global
    batch, the ranks' rows concatenated in rank order along dim 0, to plan and look the program up
    by; ``_Arrived``, or None where no tensor has a dim). The stand-ins are zeros: every rank plans
    from the same values (``runtime.agree``), and no rank's rows travel for it. The ranks' row
    counts may differ (a ragged last batch); they are exchanged, a few bytes, at every call."""
    leaves, spec = tree_flatten((args, kwargs))
    batched = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() >= 1]
    if not batched:
        return args, kwargs, None
    p = dist.get_world_size()
    counts = torch.tensor([leaves[i].shape[0] for i in batched], dtype=torch.int64)
    every = [torch.empty_like(counts) for _ in range(p)]
    dist.all_gather(every, counts)
    every = [c.tolist() for c in every]
    mine = [x for x in leaves if isinstance(x, torch.Tensor)]
    for k, i in enumerate(batched):
        x = leaves[i]
        leaves[i] = x.new_zeros((sum(c[k] for c in every),) + tuple(x.shape[1:]))
    me = dist.get_rank()
    rows = (sum(c[0] for c in every[:me]), every[me][0], sum(c[0] for c in every))
    args, kwargs = tree_unflatten(leaves, spec)
    return args, kwargs, _Arrived(mine, every, rows)


def _fed(arrived: _Arrived, feed: Feed, coords) -> list:
    """The tensors the program takes for what the ranks brought: where the plan has an input
    arrive as each rank's rows (``Plan.arrival``), the rank's own rows, as they are where they
    are its chunk of the arrival layout (every rank the same count: the program then converts
    them, priced), else its chunk of the rows gathered (a ragged batch); an input the plan takes
    whole (one shorter than the world, or a plan made for whole inputs), the ranks' rows gathered."""
    out, k = [], 0
    for x, split in zip(arrived.mine, feed.arrived):
        if x.dim() == 0:
            out.append(x)
            continue
        counts = [c[k] for c in arrived.counts]
        # every rank decides alike: its rows fed as they are only where each rank's are its chunk
        as_they_are = split and list(counts) == inputs_mod.chunk_counts(sum(counts), feed.mesh_shape)
        chunk = inputs_mod.rows_of(sum(counts), feed.mesh_shape, coords) if split else None
        out.append(x if as_they_are else _Gathered.apply(x, counts, chunk))
        k += 1
    return out


class _Gathered(torch.autograd.Function):
    """The rows every rank brought, concatenated in rank order (their counts ``counts``; each
    rank's rows padded to the most for one ``all_gather``), whole or their ``chunk`` (first,
    count) only. Backward: a whole one's gradient is the whole's on every rank (the program's
    ``runtime.to_local``), of which this rank takes its rows; a chunk's gradient is this rank's
    chunk's alone, so the chunks' gradients are summed over the ranks (one all-reduce) first."""

    @staticmethod
    def forward(ctx, x, counts, chunk):
        most = max(counts)
        x = x.detach()
        padded = torch.cat([x, x.new_zeros((most - x.shape[0],) + tuple(x.shape[1:]))]) if x.shape[0] < most else x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        whole = torch.cat([part[:c] for part, c in zip(parts, counts)])
        me = dist.get_rank()
        ctx.meta = (tuple(whole.shape), chunk, sum(counts[:me]), counts[me])
        return whole if chunk is None else whole[chunk[0]:chunk[0] + chunk[1]].clone()

    @staticmethod
    def backward(ctx, g):
        shape, chunk, first, count = ctx.meta
        if chunk is not None:
            whole = g.new_zeros(shape)
            whole[chunk[0]:chunk[0] + chunk[1]] = g
            dist.all_reduce(whole)
            g = whole
        return g[first:first + count], None, None


def _own_rows(t, first: int, count: int, total: int):
    """This rank's rows of an output with the global batch's dim 0 (others as they are)."""
    if t.dim() == 0 or t.shape[0] != total:
        return t
    return _Rows.apply(t, first, count)


class _Rows(torch.autograd.Function):
    """An output's rows for this rank. Each rank seeds the gradient of its own rows only; the
    program takes a whole output's gradient as the same on every rank (each seeds the whole),
    so the rows' gradients are summed over the ranks into it (one all-reduce of the output's
    gradient: every rank must run backward through the output, as through the program)."""

    @staticmethod
    def forward(ctx, t, first, count):
        ctx.meta = (t.shape, first, count)
        return t[first:first + count]

    @staticmethod
    def backward(ctx, g):
        shape, first, count = ctx.meta
        whole = g.new_zeros(shape)
        whole[first:first + count] = g
        dist.all_reduce(whole)
        return whole, None, None
