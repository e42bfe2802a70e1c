"""The search of ``pipeline=None``: whether a pipeline pays, with how many stages, cut where, and
how many microbatches (``search_pipeline``), on the prices of one plan of a few blocks.

Tied blocks price alike, so a stage's time is the sum of its blocks' prices: one plan of the
whole model (one microbatch, on the mesh each stage would have) prices every block, the ops
before the first block going with it and those after the last with the last; a dynamic program
over the block sequence then finds the cuts whose slowest stage (its blocks and its sends) is
fastest, ``min over cuts of max_s (t_s + c_s)``: O(k n^2) for n blocks, not one more solver
variable (Alpa's inter-op pass, on these prices).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from autoshard._compat import tree_flatten
from autoshard.cost.sends import send_seconds
from autoshard.passes.capture import capture, normalize_inputs
from autoshard.passes.stages import block_stack, short_stack
from autoshard.plan import Plan
from autoshard.planner.pipeline import in_flight, microbatch_inputs, plan_pipeline, reduction, step_slots
from autoshard.planner.solution import NoPlanInTime
from autoshard.runtime.pipeline import check_schedule, schedule_name


@dataclass(frozen=True)
class Prices:
    """Per block of the stack, in order: its seconds (a microbatch's forward and backward, the
    ops before the stack in the first, after it in the last) and the (bytes, floating, shape) of
    each tensor that crosses a cut just before it (the first: none)."""
    seconds: tuple
    crossing: tuple


def block_prices(graph, plan) -> Prices:
    """``graph``'s blocks priced by ``plan`` (its ops' compute and communication, scaled so that
    they add up to the plan's step without its gradients' reduction, which a pipeline runs once
    a step), and the bytes each cut would send."""
    from autoshard.planner.repeat import _block_of
    container, indices = block_stack(graph)
    position = {b: i for i, b in enumerate(indices)}
    n = len(indices)
    # made from parameters alone (a policy's cast of a weight): each stage makes its own, as
    # ``passes.stages.split`` cuts them, never sent; the policy writes them at the top of the
    # graph, where they move no block's boundary
    fixed: set = set()
    for node in graph.nodes:
        if node.kind in ("param", "buffer") or \
                node.kind == "op" and node.inputs and all(v[0] in fixed for v in node.inputs):
            fixed.add(node.name)
    segment: dict = {}
    current = 0
    for node in graph.nodes:
        if node.kind == "op" and node.name in fixed:
            b = _block_of(node)
            segment[node.name] = position[b[1]] if b is not None and b[0] == container else 0
        elif node.kind == "op":
            b = _block_of(node)
            if b is not None and b[0] == container:
                current = position[b[1]]
            segment[node.name] = max([current] + [segment[v[0]] for v in node.inputs
                                                  if v[0] in segment and v[0] not in fixed])
        elif node.kind == "input":
            segment[node.name] = 0
    seconds = [0.0] * n
    for name, choice in plan.nodes.items():   # the parameters' gradient reductions run once a step
        if name in segment and choice.kind == "op":
            seconds[segment[name]] += choice.compute + choice.comm
    total = sum(seconds)
    scale = (plan.cost - reduction(plan)) / total if total > 0 else 1.0
    last_read: dict = {}
    for node in graph.nodes:
        for v in node.inputs:
            if node.kind == "output":
                last_read[v] = n - 1
            elif node.name in segment:
                last_read[v] = max(last_read.get(v, 0), segment[node.name])
    crossing = [[] for _ in range(n)]   # a value made in block p and read in block r crosses the cuts p+1..r
    for v, r in last_read.items():
        # a user's input is read where it is needed, never sent
        if graph.by_name[v[0]].kind != "op" or v[0] in fixed:
            continue
        meta = graph.meta(v)
        for j in range(segment[v[0]] + 1, r + 1):
            crossing[j].append((meta.nbytes, meta.floating, tuple(meta.shape)))
    return Prices(tuple(s * scale for s in seconds), tuple(tuple(c) for c in crossing))


def best_cuts(prices: Prices, k: int, sends) -> tuple:
    """(slowest stage's seconds with its sends, first block of each stage) of the cut of the
    priced blocks into ``k`` stages whose slowest stage is fastest; ``sends(tensors)``: the
    seconds of sending those across a cut (``send_seconds``)."""
    t, n = prices.seconds, len(prices.seconds)
    prefix = [0.0]
    for x in t:
        prefix.append(prefix[-1] + x)

    cost = [sends(prices.crossing[j]) if j < n else 0.0 for j in range(n + 1)]

    def send(j):   # the sends of a stage that ends just before block j
        return cost[j]

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]   # best[s][j]: blocks 0..j-1 in s stages
    back = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                v = max(best[s - 1][i], prefix[j] - prefix[i] + send(j))
                if v < best[s][j]:
                    best[s][j], back[s][j] = v, i
    starts, j = [], n
    for s in range(k, 0, -1):
        j = back[s][j]
        starts.append(j)
    return best[k][n], tuple(reversed(starts))


@dataclass(frozen=True)
class Held:
    """What a rank holds, to price what its in-flight microbatches make it recompute: the whole
    stack's parameter state on one stage's mesh (bytes per rank), a block's activations for one
    microbatch (bytes per rank), and the budget."""
    state: float
    block: float
    budget: float

    @staticmethod
    def of(planned, priced, graph, budget: float) -> "Held":
        """From ``planned``, the plan of ``priced`` (the first blocks of ``graph``): its
        parameters' state scaled to ``graph``'s parameters, its activations per block."""
        mem = planned.memory
        state = sum(mem.get(part, 0) for part in ("parameters", "gradients", "optimizer"))
        return Held(state * param_bytes(graph) / max(param_bytes(priced), 1),
                    mem.get("activations", 0) / len(block_stack(priced)[1]), budget)


def rank_seconds(prices: Prices, starts, k: int, sends, flights=None, held: Held = None) -> float:
    """Seconds of one microbatch through the slowest rank's chunks, the blocks cut at ``starts``
    (chunk ``c`` on pipeline coordinate ``c mod k``), each chunk's blocks and the sends of the cut
    after it. With ``flights`` (the microbatches each chunk keeps in flight) and ``held``: a
    chunk whose in-flight activations overflow its share of the budget (its rank's over its
    chunks, as ``plan_pipeline`` plans it) recomputes the part ``f`` that overflows, a forward
    of its blocks again, about a third of a microbatch's forward and backward: ``(1 + f / 3)``
    times its blocks' seconds."""
    n = len(prices.seconds)
    bounds = tuple(starts) + (n,)
    chunk = []
    for c, (a, b) in enumerate(zip(bounds, bounds[1:])):
        seconds = sum(prices.seconds[a:b])
        if flights is not None and held is not None:
            budget = held.budget * k / len(starts)
            kept = flights[c] * (b - a) * held.block
            over = held.state * (b - a) / n + kept - budget
            if over > 0 and kept > 0:
                seconds *= 1 + min(1.0, over / kept) / 3
        chunk.append(seconds + (sends(prices.crossing[b]) if b < n else 0.0))
    return max(sum(chunk[r::k]) for r in range(k))


def schedule_steps(prices: Prices, k: int, m: int, sends, mesh_shape: tuple, held: Held = None) -> list:
    """(seconds of a step's microbatches, schedule, chunks per rank, first block of each chunk)
    of each schedule the search weighs on ``k`` stages and ``m`` microbatches: 1F1B (GPipe where
    ``m < k``), and interleaved 1F1B with two chunks a rank where the stack holds ``2k`` blocks and
    the microbatches split into its rounds: a bubble ``v`` times shorter for ``v`` times the
    sends, and a chunk's share of the budget for its microbatches in flight (``held``: what
    overflows it, recomputed, ``rank_seconds``). Zero bubble is not weighed: its stages run
    without the schedule pass (no gradient bucket overlaps the backward), which its price does
    not count, so it would win on a price it does not keep."""
    out = []
    for v in (1, 2):
        schedule = schedule_name(k, m, v)
        if len(prices.seconds) < k * v:
            continue
        try:
            check_schedule(schedule, mesh_shape, m)
        except ValueError:
            continue
        _, starts = best_cuts(prices, k * v, sends)
        seconds = rank_seconds(prices, starts, k, sends, in_flight(schedule, k, m, v), held)
        out.append((step_slots(schedule, k, m, v) * seconds, schedule, v, starts))
    return out


SHORT = 3   # blocks of the model that prices a degree: the first, one standing for the middle, the last


def pricing_graph(model, example_inputs, m: int, outputs: str, container: str, n: int, mp_policy=None):
    """``model`` captured with one of ``m`` microbatches' shapes, to price its blocks by: where
    its stack holds more than ``SHORT`` blocks numbered ``0 .. n-1``, only the first ``SHORT``
    (``short_stack``; tied blocks price alike, and capturing and planning a few is the search's
    time saved), else, or where the model will not run so shortened, the whole model. Under
    ``mp_policy`` with its casts written in, as ``cut`` captures the stages that run."""
    args, kwargs = microbatch_inputs(example_inputs, m)
    if n > SHORT:
        try:
            with short_stack(model, container, SHORT) as shortened:
                if shortened:
                    graph = capture(model, args, kwargs or None, outputs, mp_policy=mp_policy)
                    if block_stack(graph) == (container, tuple(range(SHORT))):
                        return graph
        except Exception:  # noqa: BLE001 - a forward that counts its blocks its own way: the whole model
            pass
    return capture(model, args, kwargs or None, outputs, mp_policy=mp_policy)


def stretched(prices: Prices, n: int) -> Prices:
    """The prices of a stack of ``n`` tied blocks from those of a shorter one's (``pricing_graph``):
    its first and last as they are (with what runs before and after the stack), the middle one
    for every block between, and the cuts after the second crossed as the one after it is."""
    if len(prices.seconds) == n:
        return prices
    s, c = prices.seconds, prices.crossing
    return Prices((s[0],) + (s[1],) * (n - 2) + (s[-1],), (c[0], c[1]) + (c[2],) * (n - 2))


def stage_bytes(held: Held, graph, k: int) -> float:
    """Bytes per rank of a stage of ``graph`` cut ``k`` ways: its parameters' share with their
    state, and a microbatch's activations."""
    return (held.state + held.block * len(block_stack(graph)[1])) / k


def param_bytes(graph) -> int:
    return sum(graph.meta((n.name, 0)).nbytes for n in graph.nodes if n.kind == "param")


def _rows(example_inputs):
    """The batch's rows (dim 0 of the first input with a dim), or None."""
    return next((x.shape[0] for x in tree_flatten(normalize_inputs(example_inputs))[0]
                 if isinstance(x, torch.Tensor) and x.dim() >= 1), None)


def _microbatches(rows: int, k: int, inner: tuple) -> int:
    """The most microbatches, up to ``16 k``, whose rows split evenly over the stages' first axis
    (Megatron-LM's GPT-3 175B: 96 of 16 sequences on 8 stages of data 16); else up to ``2 k``."""
    fits = [m for m in range(1, 16 * k + 1) if rows % m == 0 and (rows // m) % inner[0] == 0]
    return max(fits) if fits else max(d for d in range(1, 2 * k + 1) if rows % d == 0)


def _inner(mesh_shape: tuple, k: int):
    """The mesh each of ``k`` stages gets from the best mesh without a pipeline: its first axis
    (the ranks furthest apart) shrunk ``k`` times; None where it does not divide."""
    if mesh_shape[0] % k:
        return None
    first = mesh_shape[0] // k
    rest = tuple(mesh_shape[1:])
    return ((first,) + rest) if first > 1 or not rest else rest


def search_pipeline(model, example_inputs, graph, world: int, options, base: Plan, plan_stage):
    """``pipeline=None``: the best pipelined plan where one beats ``base``, the best plan without
    a pipeline, else ``base`` itself. Pipelines are searched only across nodes: each stage whole
    nodes, the pipeline axis on the network between them (within a node the links are fast, and a
    pipeline would buy nothing but its bubble); ``k`` divides the world, each stage's mesh is
    ``base``'s with its first axis ``k`` times smaller, and the microbatches are ``microbatches=``
    or ``_microbatches``' choice. Each degree costs one plan, on its stages' mesh, of the model
    shortened to its first ``SHORT`` blocks (``pricing_graph``; one capture per microbatch size),
    whose middle block prices every block between (``stretched``); the degree whose cut is cheapest
    by those prices is then planned stage by stage, and kept where it beats ``base``."""
    cluster = base.cluster
    if cluster is None or world <= cluster.gpus_per_node or not options.training:
        return base
    try:
        container, indices = block_stack(graph)
    except ValueError:
        return base
    out = graph.exported.graph_signature.output_specs
    user = [n for n in graph.output.inputs]
    if len(user) != 1 or graph.meta(user[0]).shape != () or not graph.meta(user[0]).floating or len(out) != 1:
        return base
    stage_options = dataclasses.replace(options, pipeline=None, microbatches=None)
    degrees = [k for k in range(2, min(world // cluster.gpus_per_node, len(indices)) + 1)
               if world % k == 0 and _inner(tuple(base.mesh_shape), k) is not None
               and math.prod(_inner(tuple(base.mesh_shape), k)) % cluster.gpus_per_node == 0]
    rows = _rows(example_inputs)
    if rows is None:   # no input with a batch dim to cut
        return base
    micro = {k: options.microbatches or _microbatches(rows, k, _inner(tuple(base.mesh_shape), k)) for k in degrees}
    # a pipeline runs the same work on the same devices and adds its bubble, (k - 1) / m of the
    # compute: it can pay only where the plan without one waits on more communication than that
    compute, exposed = base.breakdown.get("compute"), base.breakdown.get("exposed")
    if compute is not None and exposed is not None:
        degrees = [k for k in degrees if compute * (k - 1) / micro[k] < exposed]
    captured: dict = {}   # microbatches -> the model (its first blocks) captured with one microbatch's shapes
    n = len(indices) if indices == tuple(range(len(indices))) else 0
    ranked = []
    # each degree's stages are priced, and the chosen one's planned, with the parameters laid out
    # as in ``base`` (the same axes, the first smaller): a small solve for the activations alone
    kept = {c.fqn: tuple(base.params[c.fqn]) for c in base.nodes.values() if c.kind == "param" and c.fqn in base.params}

    # base's layouts on a stage's mesh (less its first axis where gone); ``whole``: the stack's alone (the rest as the
    # stage plans it), whole on axes across nodes as Megatron-LM's: split there, gathered every microbatch
    def keeping(inner, whole=True):
        drop = len(inner) < len(base.mesh_shape)
        across = {a for a in range(len(inner)) if whole and math.prod(inner[a:]) > cluster.gpus_per_node}
        laid = {n: tuple("B" if a in across else p for a, p in enumerate(v[1:] if drop else v))
                for n, v in kept.items() if not whole or n.startswith(container + ".")}
        return {**laid, **(options.pin or {})}

    # the degrees' plans only price the blocks: together they take half of one solve's limit
    limit = options.time_limit / (2 * max(len(degrees), 1))
    budget = options.memory_budget or cluster.memory
    for k in degrees:
        inner, m = _inner(tuple(base.mesh_shape), k), micro[k]
        planned = None
        for whole in (True, False):   # whole where a stage holds it within the budget, else as base lays it out
            try:
                if m not in captured:
                    captured[m] = pricing_graph(model, example_inputs, m, options.outputs, container, n,
                                                options.mp_policy)
                priced = captured[m]
                pins = {name: v for name, v in keeping(inner, whole).items() if name in priced.param_aliases}
                planned = plan_stage(priced, inner, dataclasses.replace(stage_options, mesh=inner, time_limit=limit,
                                                                        pin=pins or None))
            except (ValueError, NoPlanInTime):   # none within the budget, or in its time
                continue
            if not whole or stage_bytes(Held.of(planned, priced, graph, budget), graph, k) <= budget:
                break
            planned = None
        if planned is None:
            continue   # not this degree
        prices = stretched(block_prices(priced, planned), len(indices))
        # the gradients' reduction, of the whole model's parameters where the shorter one priced it
        grads = reduction(planned) * param_bytes(graph) / max(param_bytes(priced), 1)
        held = Held.of(planned, priced, graph, budget)
        for step, schedule, v, starts in schedule_steps(
                prices, k, m, lambda sends, k=k, inner=inner: send_seconds(sends, (k,) + inner, cluster), (k,) + inner,
                held):
            ranked.append((step + grads / k, k, inner, m, schedule, v, starts, whole))
    ranked.sort()
    for estimate, k, inner, m, schedule, v, starts, whole in ranked[:2]:   # the cheapest; the next where it fails
        if estimate >= base.cost:
            break
        # and the chosen degree's stages share another
        try:
            plan = plan_pipeline(model, example_inputs, (k,) + inner, dataclasses.replace(
                stage_options, pipeline=k, microbatches=m, virtual=v, schedule=schedule,
                time_limit=options.time_limit / k, pin=keeping(inner, whole)), plan_stage, starts=starts)
        except (ValueError, NoPlanInTime):
            continue
        if plan.cost < base.cost and all(plan.memory(s) <= budget for s in plan.stages):
            plan.candidates = [dict(pipeline=k, mesh=list((k,) + inner), microbatches=m, schedule=schedule,
                                    virtual=v, estimate=e) for e, k, inner, m, schedule, v, *_ in ranked] + \
                [dict(pipeline=1, mesh=list(base.mesh_shape), estimate=base.cost)]
            return plan
    return base
