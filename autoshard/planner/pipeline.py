"""Pipeline plans: the model cut into stages along one more mesh axis, the first (across the
slowest links; stage ``s`` its ranks at coordinate ``s``), between its repeated blocks
(``passes.stages``); each stage captured on its own with one microbatch's shapes and planned by
the same ILP on the other axes (``plan_stage``, ``api.plan_graph``), stages alike once (``alike``).

Priced (DESIGN.md section 11): a microbatch's forward and backward through stage ``s`` takes
``t_s``, its plan's step, and its sends to the next stage ``c_s``: the tensors that cross forward
and the gradients of the floating ones back, each rank's share in its crossing layout
(``inputs.crossing_layout``) one point-to-point transfer of ``alpha + bytes / beta`` on the links
the pipeline axis spans (``cost.sends``; ``machine.cluster``: across nodes where a stage's ranks
fill a node), converted in the stages' own plans. 1F1B and GPipe with ``k`` stages and ``m``
microbatches take ``(m + k - 1) * max(t_s + c_s)``, of which ``(k - 1) / (m + k - 1)`` is the
bubble. Memory: stage ``s`` keeps the activations of its microbatches in flight, ``min(k - s,
m)`` under 1F1B, all ``m`` under GPipe, beside its parameters, gradients and optimizer state.

Interleaved (``virtual=v``): the blocks are cut into ``k v`` chunks, rank coordinate ``r`` holding
chunks ``r, r + k, ...``; a microbatch's forward and backward through a rank's chunks takes
``T_r``, the sum of its chunks' ``t_c + c_c`` (``v`` times the sends of 1F1B, each chunk handing
on to the next rank), and the step ``(m + (k - 1) / v) * max T_r``: the fill and drain are chunks,
``v`` times shorter, and the bubble ``(k - 1) / (v m + k - 1)``. What each chunk keeps in flight
is read off the schedule's order (``orders``), as torch's ``ScheduleInterleaved1F1B`` runs it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import torch

from autoshard._compat import tree_flatten, tree_unflatten
from autoshard.cost.sends import send_seconds
from autoshard.passes.capture import capture, normalize_inputs
from autoshard.passes.stages import block_stack, even_cuts, split
from autoshard.arguments import (GPIPE, INTERLEAVED, ONE_F_ONE_B, SPLIT_BACKWARD, ZBV, ZERO_BUBBLE,
                                 stage_coordinate)
from autoshard.outputs import SENT
from autoshard.plan import Plan
from autoshard.precision import policy_from_record, policy_record
from autoshard.planner.alike import Alike
from autoshard.planner.solution import NoPlanInTime
from autoshard.runtime.pipeline import check_schedule, schedule_name


@dataclass
class StagePlan:
    """One stage (a chunk, where ranks hold several): its index, the blocks it holds, the ranks
    that run it (global ranks, in the order of the mesh of the other axes) and its plan on that
    mesh."""
    index: int
    blocks: tuple
    ranks: tuple
    plan: Plan
    sends: tuple = ()        # (bytes, floating, shape) of each tensor it hands the next stage, per microbatch

    @property
    def params(self) -> tuple:
        return tuple(self.plan.params)


@dataclass
class PipelinePlan:
    """A plan whose first mesh axis is a pipeline: ``stages[s]`` runs at coordinate ``s % k`` on
    it (``k`` its size; ``virtual`` stages, chunks, per coordinate, ``k virtual`` in all; in a V
    under ZBV, ``arguments.stage_coordinate``)."""
    mesh_shape: tuple
    microbatches: int
    schedule: str
    stages: list
    training: bool = True
    input_shapes: list = field(default_factory=list)   # the whole batch's, as given
    starts: tuple = ()          # each stage's first block, where a search chose them (else as even as they go)
    candidates: list = field(default_factory=list)   # pipeline=None: the degrees priced, and no pipeline
    virtual: int = 1            # chunks per rank: > 1, interleaved

    @property
    def world(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def cost(self) -> float:
        """Estimated seconds per step: the slowest rank's microbatch (through all its chunks) and
        sends, ``m + (k - 1) / v`` times, and the gradients' reduction the stages wait on, once."""
        k, m, v = self.mesh_shape[0], self.microbatches, self.virtual
        return step_slots(self.schedule, k, m, v) * self.slowest + max(self.reduction(s) for s in self.stages)

    def chunks(self, r: int) -> list:
        """The stages (chunks) pipeline coordinate ``r`` holds, in order."""
        return [s for s in self.stages if stage_coordinate(self.schedule, s.index, self.mesh_shape[0]) == r]

    @property
    def slowest(self) -> float:
        """Seconds of one microbatch through the slowest rank's chunks, forward and backward, with their sends."""
        return max(sum(self.slot(s) for s in self.chunks(r)) for r in range(self.mesh_shape[0]))

    def slot(self, stage: "StagePlan") -> float:
        """Seconds of one microbatch through ``stage`` (forward and backward) and its sends, its
        gradients' reduction apart (the runtime reduces them once per step)."""
        return stage.plan.cost - self.reduction(stage) + self.send_time(stage)

    def reduction(self, stage: "StagePlan") -> float:
        """Seconds of ``stage``'s plan waiting on its gradients' reduction (``reduction``)."""
        return reduction(stage.plan)

    def send_time(self, stage: "StagePlan") -> float:
        """Seconds of a microbatch's sends from ``stage`` to the next, forward and back."""
        k = self.mesh_shape[0]
        if not stage.sends or stage.plan.cluster is None or \
                stage_coordinate(self.schedule, stage.index, k) == stage_coordinate(self.schedule, stage.index + 1, k):
            return 0.0   # the next chunk on the same rank (ZBV's turn): handed on in place
        return send_seconds(stage.sends, tuple(self.mesh_shape), stage.plan.cluster)

    def in_flight(self, stage: "StagePlan") -> int:
        """How many microbatches' activations ``stage`` keeps at once (``in_flight``)."""
        return in_flight(self.schedule, self.mesh_shape[0], self.microbatches, self.virtual)[stage.index]

    def memory(self, stage: "StagePlan") -> float:
        """Bytes per rank of ``stage``: its plan's, with the activations of every microbatch in
        flight (a rank holding several chunks holds the sum of theirs, ``rank_memory``)."""
        mem = stage.plan.memory
        return mem.get("total", 0) + (self.in_flight(stage) - 1) * mem.get("activations", 0)

    def rank_memory(self, r: int) -> float:
        """Bytes per rank at pipeline coordinate ``r``: its chunks' together."""
        return sum(self.memory(s) for s in self.chunks(r))

    @property
    def bubble(self) -> float:
        """The part of a step the stages stand idle: ``(k - 1) / (v m + k - 1)`` (``step_slots``)."""
        k, m, v = self.mesh_shape[0], self.microbatches, self.virtual
        slots = step_slots(self.schedule, k, m, v)
        return (slots - m) / slots

    def stage_of(self, name: str) -> list:
        """The stages that hold parameter (or node) ``name``."""
        return [s for s in self.stages if name in s.plan.params or name in s.plan.nodes]

    def placement(self, name: str) -> tuple:
        """Per-axis placements of a parameter on the mesh of its stage's axes: ``"stage s"`` on
        the pipeline axis, then its stage plan's."""
        held = self.stage_of(name)
        if not held:
            raise KeyError(f"{name!r} is held by no stage; parameters: "
                           f"{', '.join(sorted({p for s in self.stages for p in s.plan.params})[:8])}...")
        return (f"stage {held[0].index}",) + held[0].plan.placement(name)

    def explain(self, name: str) -> str:
        held = self.stage_of(name)
        if not held:
            self.placement(name)
        where = ", ".join(f"stage {s.index} (ranks {_ranks(s.ranks)})" for s in held)
        return f"{name}: held by {where}\n" + held[0].plan.explain(name)

    def __str__(self) -> str:
        k, m, v = self.mesh_shape[0], self.microbatches, self.virtual
        reduce = max(self.reduction(s) for s in self.stages)
        chunked = f", {v} chunks per rank ({k * v} in all)" if v > 1 else ""
        fill = f"{k - 1}" if v == 1 else f"{k - 1}/{v}"
        fill = f"{step_slots(self.schedule, k, m, v) - m:.2f}" if self.schedule in SPLIT_BACKWARD else fill
        lines = [f"autoshard pipeline plan: {self.world} devices as mesh {tuple(self.mesh_shape)}, the first axis "
                 f"a pipeline of {k} stages{chunked}, {m} microbatches, schedule {self.schedule} "
                 f"(torch.distributed.pipelining)",
                 f"step {_ms(self.cost)} (estimated) = ({m} microbatches + {fill}) x slowest "
                 f"{'stage' if v == 1 else 'rank'} {_ms(self.slowest)} + gradients reduced once {_ms(reduce)}; "
                 f"bubble {self.bubble:.0%} of the step",
                 "", f"{'stage':<6} {'ranks':<10} {'blocks':<24} {'microbatch':>11} {'sends':>9} {'in flight':>9} "
                 f"{'memory':>9}"]
        for s in self.stages:
            first = s.index == 0
            last = s.index == len(self.stages) - 1
            held = ("embedding + " if first else "") + _blocks(s.blocks) + (" + head" if last else "")
            lines.append(f"{s.index:<6} {_ranks(s.ranks):<10} {held:<24} {_ms(s.plan.cost):>11} "
                         f"{_ms(self.send_time(s)):>9} {self.in_flight(s):>9} {self.memory(s) / 1e9:>7.2f}GB")
        if v > 1:
            lines.append("memory per rank: " + ", ".join(f"{r}: {self.rank_memory(r) / 1e9:.2f}GB" for r in range(k)))
        letters = "; chunk a, b, ... of the rank" if v > 1 else ""
        parts = "I input and W weight gradients" if self.schedule in SPLIT_BACKWARD else "B backward"
        lines += ["", f"schedule (F forward, {parts} of microbatch n{letters}; . idle):"]
        lines += timeline(self.schedule, k, m, virtual=v)
        if self.candidates:
            lines += ["", "pipelines searched (estimated step; pipelines by their block prices):"]
            lines += [f"  pipeline {c['pipeline']:<3} mesh {tuple(c['mesh'])!s:<16} "
                      f"{c.get('schedule', '') + (' x' + str(c['virtual']) if c.get('virtual', 1) > 1 else ''):<18} "
                      f"{_ms(c['estimate'])}" for c in self.candidates]
        return "\n".join(lines)

    def to_html(self, path=None) -> str:
        """One self-contained page: the stages, the schedule drawn (its bubble in sight), each
        stage's own plan (``report.pipeline_page``)."""
        from autoshard.report.pipeline_page import to_html
        return to_html(self, simulate(self.schedule, self.mesh_shape[0], self.microbatches, self.virtual)[0], path)

    def to_json(self) -> str:
        return json.dumps({"pipeline": True, "mesh_shape": list(self.mesh_shape), "microbatches": self.microbatches,
                           "schedule": self.schedule, "virtual": self.virtual, "training": self.training,
                           "input_shapes": [list(s) for s in self.input_shapes], "starts": list(self.starts),
                           "candidates": self.candidates,
                           "stages": [{"index": s.index, "blocks": list(s.blocks), "ranks": list(s.ranks),
                                       "sends": [list(x) for x in s.sends],
                                       "plan": json.loads(s.plan.to_json())} for s in self.stages]}, indent=1)

    @staticmethod
    def from_json(text: str) -> "PipelinePlan":
        d = json.loads(text)
        stages = [StagePlan(s["index"], tuple(s["blocks"]), tuple(s["ranks"]), Plan.from_json(json.dumps(s["plan"])),
                            # (a plan saved before a send carried its shape kept its rows alone)
                            tuple((b, f, tuple(x) if isinstance(x, list) else (x,)) for b, f, x in s.get("sends", ())))
                  for s in d["stages"]]
        return PipelinePlan(tuple(d["mesh_shape"]), d["microbatches"], d["schedule"], stages, d["training"],
                            [tuple(s) for s in d.get("input_shapes", [])], tuple(d.get("starts", ())),
                            d.get("candidates", []), d.get("virtual", 1))


def reduction(plan: Plan) -> float:
    """Seconds of ``plan`` waiting on its parameters' gradient collectives: their time, at most
    what of its communication it leaves exposed."""
    params = {n for n, c in plan.nodes.items() if c.kind == "param"}
    grads = sum(c.seconds for c in plan.collectives if c.phase == "backward" and c.node in params)
    return min(grads, plan.breakdown.get("exposed", grads))


def orders(schedule: str, k: int, m: int, virtual: int = 1) -> list:
    """Per rank of ``k``, the forwards and backwards it runs, in its order: ``(kind, microbatch,
    stage)`` with kind ``"F"`` or ``"B"`` (``"I"`` and ``"W"``, a backward's input and weight
    gradients apart, under zero bubble) and ``stage`` the chunk (``k virtual`` in all; rank ``r``
    holds ``r, r + k, ...``). GPipe: every forward, then every backward. 1F1B: ``k - r - 1``
    forwards to fill the pipe, then one forward and one backward in turn. Interleaved 1F1B, as
    torch's ``ScheduleInterleaved1F1B`` orders it (the Megatron-LM schedule, depth first): the
    microbatches go in rounds of ``m / max(1, m // k)`` through the rank's chunks in turn, forwards
    first to chunk 0, backwards first from its last chunk; ``(v - 1)`` rounds and ``2 (k - r - 1)``
    forwards fill the pipe. Interleaved zero bubble (``ScheduleInterleavedZeroBubble``, ZB1P):
    ``k - r - 1`` forwards and the rounds fill it, and each rank's weight passes trail its input
    passes by ``r``, filling the drain."""
    out = []
    for r in range(k):
        if schedule == GPIPE:
            out.append([("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)])
            continue
        if schedule == ZBV:
            out.append(_zbv_order(r, k, m))
            continue
        v = virtual if schedule in (INTERLEAVED, ZERO_BUBBLE) else 1
        per_round = m // max(1, m // k)
        fill = 1 if schedule == ZERO_BUBBLE else 2
        warm = min((v - 1) * per_round + fill * (k - r - 1), m * v) if schedule != ONE_F_ONE_B else min(k - r - 1, m)
        forward = [(op // per_round) % v * k + r for op in range(m * v)]
        backward = [(v - 1 - ((op - warm) // per_round) % v) * k + r for op in range(warm, warm + m * v)]
        back = "I" if schedule == ZERO_BUBBLE else "B"
        count: dict = {}
        order, weights = [], []

        def add(kind, c):
            order.append((kind, count.setdefault((kind, c), 0), c))
            count[(kind, c)] += 1

        for op in range(m * v + warm):
            if op < m * v:
                add("F", forward[op])
            if op >= warm:
                add(back, backward[op - warm])
                weights.append(backward[op - warm])
                if schedule == ZERO_BUBBLE and op - warm >= r:
                    add("W", weights.pop(0))
        for c in weights if schedule == ZERO_BUBBLE else ():
            add("W", c)
        out.append(order)
    return out


def _zbv_order(r: int, k: int, m: int) -> list:
    """Rank ``r``'s work under ZBV, as torch's ``ScheduleZBVZeroBubble`` orders it (the ZB-V
    schedule): its chunks ``r`` (down the V) and ``2k - 1 - r`` (back up); ``2 (k - r) - 1``
    forwards of the first fill, ``r`` of each in turn, then ``k - r`` of the second each with its
    input and weight passes; then each step a forward, input and weight pass of both; then the
    drain, input passes first and the weights' after. Torch plans at least ``2k - 1``
    microbatches and idles where there are fewer."""
    lo, hi = r, 2 * k - 1 - r
    n = max(2 * k - 1, m)
    count: dict = {}
    order = []

    def add(kind, c):
        i = count.get((kind, c), 0)
        count[(kind, c)] = i + 1
        order.append((kind, i, c))

    def done(kind, c):
        return count.get((kind, c), 0)

    for _ in range(2 * (k - r) - 1):
        add("F", lo)
    for _ in range(r):
        add("F", hi)
        add("F", lo)
    for _ in range(k - r):
        add("F", hi)
        add("I", hi)
        add("W", hi)
    while done("F", hi) < done("F", lo) or done("F", lo) < n:
        if done("F", lo) < n:
            add("F", lo)
        add("I", lo)
        add("W", lo)
        add("F", hi)
        add("I", hi)
        add("W", hi)
    weights = {lo: done("W", lo), hi: done("W", hi)}
    for _ in range(r):
        add("I", lo)
        add("I", hi)
    for _ in range(k - r):
        add("I", lo)
        add("W", lo)
    order += [("W", i, hi) for i in range(weights[hi], done("I", hi))]
    order += [("W", i, lo) for i in range(count[("W", lo)], done("I", lo))]
    return [(kind, i, c) for kind, i, c in order if i < m]   # torch's microbatches beyond m idle


def in_flight(schedule: str, k: int, m: int, virtual: int = 1) -> list:
    """Per stage (chunk), the most microbatches whose activations it keeps at once in its rank's
    order (``orders``), from a forward to its backward (its weight pass under zero bubble):
    ``min(k - s, m)`` under 1F1B, ``m`` under GPipe."""
    most = [0] * (k * virtual)
    for order in orders(schedule, k, m, virtual):
        held: dict = {}
        for kind, _, c in order:
            if kind == "I":
                continue
            held[c] = held.get(c, 0) + (1 if kind == "F" else -1)
            most[c] = max(most[c], held[c])
    return most


SPAN = {"F": 1, "B": 2, "I": 1, "W": 1}   # time slots: a backward twice a forward's FLOPs, halved when split


def simulate(schedule: str, k: int, m: int, virtual: int = 1) -> tuple:
    """(per rank, {slot: label}; the slots the step takes): each rank's work in its order
    (``orders``), each as early as the stage before (forward) or after (backward) allows, a
    chunk's forward one slot (``SPAN``)."""
    n = k * virtual
    done: dict = {}   # (kind, microbatch, stage) -> the slot it ends at
    cells = [dict() for _ in range(k)]
    free = [0] * k
    pending = orders(schedule, k, m, virtual)
    while any(pending):
        moved = False
        for r in list(range(k)) + list(reversed(range(k))):
            while pending[r]:
                kind, i, c = pending[r][0]
                if kind == "F":
                    dep = ("F", i, c - 1) if c > 0 else None
                elif kind == "W":
                    dep = ("I", i, c)
                else:
                    dep = ("F", i, c) if c == n - 1 else (kind, i, c + 1)
                if dep is not None and dep not in done:
                    break
                t0 = max(free[r], done.get(dep, 0))
                label = f"{kind}{i}" + (chr(ord("a") + c // k) if virtual > 1 else "")
                for t in range(t0, t0 + SPAN[kind]):
                    cells[r][t] = label
                done[(kind, i, c)] = free[r] = t0 + SPAN[kind]
                pending[r].pop(0)
                moved = True
        if not moved:
            break
    return cells, max(free)


def step_slots(schedule: str, k: int, m: int, virtual: int = 1) -> float:
    """A step in microbatches through the slowest rank: ``m + k - 1`` (1F1B, GPipe),
    ``m + (k - 1) / v`` (interleaved); zero bubble's, its simulated step (``simulate``) over the
    three slots of a microbatch's forward, input and weight passes through each chunk."""
    if schedule in (ZERO_BUBBLE, ZBV):
        return simulate(schedule, k, m, virtual)[1] / (3 * virtual)
    if schedule == INTERLEAVED:
        return m + (k - 1) / virtual
    return m + k - 1


def timeline(schedule: str, k: int, m: int, width: int = 110, virtual: int = 1) -> list:
    """One row per rank, one column per time slot (``simulate``): where the bubble is, drawn.
    With chunks, each cell names its chunk of the rank: ``F0a``, ``B3b``."""
    cells, end = simulate(schedule, k, m, virtual)
    cell = 4 if virtual == 1 else 5
    out = []
    for r in range(k):
        text = "".join(f"{cells[r].get(t, '.'):<{cell}}" for t in range(end)).rstrip()
        out.append(f"  stage {r}: {text[:width]}" if virtual == 1 else f"  rank {r}: {text[:width]}")
    return out


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _blocks(names) -> str:
    if len(names) == 1:
        return names[0]
    container = names[0].rpartition(".")[0]
    return f"{container}.{names[0].rpartition('.')[2]}-{names[-1].rpartition('.')[2]}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f}us"


def microbatch_inputs(example_inputs, m: int):
    """(args, kwargs) of one microbatch: every tensor of one dim or more its first ``1/m`` of
    rows; the batch must split evenly."""
    args, kwargs = normalize_inputs(example_inputs)
    leaves, spec = tree_flatten((args, kwargs))
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            if x.shape[0] % m:
                raise ValueError(f"microbatches={m} must divide the batch, {x.shape[0]} rows (dim 0 of every input); "
                                 "pass microbatches= a divisor of it")
            x = x[: x.shape[0] // m]
        out.append(x)
    return tree_unflatten(out, spec)


def default_microbatches(example_inputs, k: int) -> int:
    """Twice the stages where the batch allows (a bubble of at most a third), else the largest
    divisor of the batch up to that."""
    args, kwargs = normalize_inputs(example_inputs)
    rows = [x.shape[0] for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.dim() >= 1]
    if not rows:
        raise ValueError("pipeline= splits the batch into microbatches along dim 0, and no input has a dim")
    return max(d for d in range(1, 2 * k + 1) if rows[0] % d == 0)


def stage_inputs(stages, s: int, device) -> tuple:
    """Zeros of the shapes stage ``s`` takes (one microbatch), to capture it with."""
    return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in stages.inputs[s])


def cut(model, example_inputs, k: int, m: int, outputs: str, starts=None, mp_policy=None, virtual: int = 1):
    """The stages of ``model`` for ``k`` stages of ``virtual`` chunks each and ``m`` microbatches
    (``passes.stages``), beginning at blocks ``starts`` (by default as even as they go). Under ``mp_policy`` the
    model is captured with its casts written in (``autoshard.precision``), so each stage casts
    the parameters it holds, and what crosses between stages travels in the dtype it has there."""
    args, kwargs = microbatch_inputs(example_inputs, m)
    graph = capture(model, args, kwargs or None, outputs, mp_policy=mp_policy)
    _, indices = block_stack(graph)
    return split(graph, model, list(starts) if starts else even_cuts(len(indices), k, virtual))


def capture_stage(stages, s: int, device, outputs: str, mp_policy=None):
    """Stage ``s``'s program captured as a model of its own (one microbatch's shapes). Its
    policy's casts are already in it (``cut``); the graph records the policy, by which its plan
    reduces the gradients in ``reduce_dtype`` (``precision.reduce_dtype``). What crosses from the
    stage before arrives, and what it hands the next leaves, in its crossing layout
    (``inputs.crossing_layout``, ``outputs.SENT``): its plan prices converting them on its own
    axes' links, and each rank sends or takes its own share alone."""
    last = s == len(stages.modules) - 1
    graph = capture(stages.modules[s], stage_inputs(stages, s, device), None, outputs if last else SENT)
    graph.received = len(stages.crossing(s))
    if mp_policy is not None:
        graph.precision = {"policy": policy_record(mp_policy), "autocast": None}
    return graph


def stage_policy(plan: "PipelinePlan"):
    """The precision policy a pipelined plan was made under (its stages' record), or None."""
    return policy_from_record((plan.stages[0].plan.schedule.get("precision") or {}).get("policy"))


def input_device(example_inputs):
    return next((x.device for x in tree_flatten(normalize_inputs(example_inputs))[0] if isinstance(x, torch.Tensor)),
                torch.device("cpu"))


def plan_pipeline(model, example_inputs, mesh_shape: tuple, options, plan_stage, starts=None) -> PipelinePlan:
    """The plan of ``model`` with ``mesh_shape[0]`` pipeline stages, ``options.virtual`` chunks
    each (the first beginning at block ``starts[s]``; by default as even as they go);
    ``plan_stage(graph, mesh_shape, options)`` plans each chunk's captured graph on the other axes."""
    k, v = mesh_shape[0], options.virtual
    inner = tuple(mesh_shape[1:]) or (1,)
    m = options.microbatches or default_microbatches(example_inputs, k)
    schedule = options.schedule or schedule_name(k, m, v)
    check_schedule(schedule, mesh_shape, m)
    n = k * v
    stages = cut(model, example_inputs, k, m, options.outputs, starts, options.mp_policy, v)
    device = input_device(example_inputs)
    stage_options = dataclasses.replace(options, mesh=inner, pipeline=None, microbatches=None, virtual=1, schedule=None)
    size = math.prod(inner)
    flights = in_flight(schedule, k, m, v)
    planned, pinned, firsts, most = [], set(), [], {}
    alike = Alike(plan_stage)   # stages alike (the middle ones of a stack, mostly) planned once
    for s in range(n):
        graph = capture_stage(stages, s, device, options.outputs, options.mp_policy)
        # a pin names a parameter's placements on the stage's axes; each stage takes those of its own
        pins = {name: v for name, v in (options.pin or {}).items() if name in graph.param_aliases}
        pinned.update(pins)
        one = dataclasses.replace(stage_options, pin=pins or None)
        firsts.append((graph, one, alike.plan(graph, inner, one, stages.blocks[s]), alike.key))
        most[alike.key] = max(most.get(alike.key, 0), flights[s])
    # a stage keeps its in-flight microbatches' activations, which its plan (of one) does not see:
    # where they overflow the budget (a chunk's share of its rank's), planned again within what
    # they leave; stages alike within what the most in flight of them leave (solved once), else
    # (none found) each within its own. None fits: the plan says how far over (``memory``)
    for s, (graph, one, splan, key) in enumerate(firsts):
        budget, mem = (splan.memory.get("budget") or 0) / v, splan.memory
        if budget and mem.get("total", 0) + (flights[s] - 1) * mem.get("activations", 0) > budget:
            fixed = mem.get("total", 0) - mem.get("activations", 0)
            for flight in sorted({most[key], flights[s]}, reverse=True):   # all in flight within the budget
                try:
                    splan = alike.plan(graph, inner, dataclasses.replace(one, memory_budget=fixed + (budget - fixed)
                                                                         / flight), stages.blocks[s])
                    break
                except (ValueError, NoPlanInTime):
                    continue
        sends = tuple((math.prod(shape) * dtype.itemsize, dtype.is_floating_point, tuple(shape))
                      for shape, dtype in (stages.crossing(s + 1) if s + 1 < n else ()))
        r = stage_coordinate(schedule, s, k)
        planned.append(StagePlan(s, stages.blocks[s], tuple(range(r * size, (r + 1) * size)), splan, sends))
    unknown = sorted(set(options.pin or {}) - pinned)
    if unknown:
        raise ValueError(f"cannot pin {', '.join(map(repr, unknown))} with pipeline=: a pin names a parameter of the "
                         "model (its placements on the axes after the pipeline's), and no stage holds these")
    args, kwargs = normalize_inputs(example_inputs)
    shapes = [tuple(x.shape) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    return PipelinePlan((k,) + inner, m, schedule, planned, options.training, shapes,
                        starts=tuple(starts) if starts else (), virtual=v)
