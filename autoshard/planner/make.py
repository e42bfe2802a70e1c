"""Making a plan: the chosen strategy of every node, with the collectives and costs it implies
(``make_plan``), its price alone for a mesh search to compare (``plan_cost``), and each node's
alternatives priced when a reader first asks for them (``alternatives``, read by
``report.explain``).

Each alternative of a node is priced as the plan with only that node changed: its own cost (compute,
its gradient's all-reduce, the all-reduces its lowering issues), the conversions of its inputs from
their producers' chosen layouts and those of its outputs into its consumers' chosen layouts, all by
the solver's own ``Costs``, and the whole step recomputed from the parts (``cost.step``), so
overlap is priced as the solver prices it. Such a plan is one the solver could have returned, so
pinning the alternative costs at most its price (at most: the solver then re-plans the neighbours).

Alternatives are grouped by the node's output placements (what ``pin=`` fixes); of each group the
cheapest strategy stands for it. Only the chosen one and the ``TOP`` cheapest others are kept, and
the nodes of repeated blocks that share one set of solver variables share one entry
(``planner.repeat``), so a deep stack costs what one or two blocks do.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import NamedTuple, Optional

from autoshard import placement as pl
from autoshard.cost import attention, comm, interleave
from autoshard.cost.memory import rank_memory
from autoshard.cost.overlap import added, conversion_price, edge_overlap
from autoshard.cost.step import Cost
from autoshard.outputs import dual_at
from autoshard.plan import Collective, NodeChoice, Plan
from autoshard.planner import recompute, repeat
from autoshard.planner.repeat import tie_repeated
from autoshard.planner.tables import choice_cost, plan_price

def conversion_collectives(graph, costs, value, src, dst, consumer) -> list:
    """The collectives of converting ``value`` from ``src`` to ``dst`` for ``consumer``: forward,
    its dual in backward, and again in backward where the parameter is regathered."""
    producer = graph.by_name[value[0]]
    meta = graph.meta(value)
    backward = costs.training and meta.floating and dual_at(costs.graph, consumer) and producer.requires_grad
    # a prefetched gather, its dual and its regather travel in a bucket, priced as Costs.convert
    steps, duals, fwd, bwd, hidden = costs.step_times(value, src, costs.handed_over(value, src, dst, consumer),
                                                      backward)
    phases = [("forward", steps, fwd, 0, hidden)]
    if backward:
        phases.append(("backward", duals, bwd, len(duals) - 1, hidden))
        if costs.regathered(value):   # converted again for the backward, which waits for it
            phases.append(("backward", steps, fwd, 0, False))
    # a prefetched gather's dual reduce-scatter, or a policy copy's, runs in the policy's reduce dtype
    reduced = costs.reduced_itemsize(value, hidden, steps)
    return [Collective(st.kind, phase, st.axes,
                       comm.step_bytes(st, reduced if phase == "backward" and sts is duals and i == bucketed
                                       else meta.itemsize), consumer.name, t, hid and i == bucketed)
            for phase, sts, times, bucketed, hid in phases
            for i, (st, t) in enumerate(zip(sts, times)) if st.is_collective]


def own_collectives(graph, costs, n, strat) -> list:
    """A node's collectives that are not conversions between nodes: a parameter's gradient
    all-reduce, the all-reduces an op's lowering issues, a user input's from the layout it
    arrives in (``Costs.arrival_times``)."""
    mesh, links = costs.mesh_shape, costs.links
    out = [Collective("all_reduce", "backward", axes, nbytes, n.name, t, True)
           for axes, nbytes, t in costs.grad_syncs(n, strat)]
    if n.name in costs.arrival:   # a user input's rows, as they arrive, converted to its layout
        steps, duals, fwd, bwd = costs.arrival_times(n, strat)
        itemsize = n.outputs[0].itemsize
        out += [Collective(st.kind, phase, st.axes, comm.step_bytes(st, itemsize), n.name, t)
                for phase, sts, times in (("forward", steps, fwd), ("backward", duals, bwd))
                for st, t in zip(sts, times) if st.is_collective]
    if n.kind == "op":
        for c in comm.op_collectives(n, strat, graph, mesh, costs.arrival):
            t = comm.op_collective_time(c, mesh, links)
            out.append(Collective(c.kind, c.phase, (c.axis,), c.nbytes, n.name, t))
        # attention's point-to-point sends: the balancing swaps, the ring's keys and values
        out += [Collective("send", phase, (axis,), int(nbytes), n.name, t)
                for phase, axis, nbytes, t in costs.attention_sends(n, strat)]
    return out


def make_plan(graph, strategies, solution, costs, *, budget: Optional[float] = None) -> Plan:
    """The chosen strategy of every node, with the collectives and costs it implies, and the
    memory ``budget`` it was solved within. What ``Plan.explain`` needs (each node's alternatives,
    priced) is worked out when first asked for."""
    mesh = costs.mesh_shape
    nodes, params = {}, {}
    # recomputed blocks: their forward again in backward, their activations freed but one block's;
    # they run in checkpointed submodules, where the schedule overlaps and chunks nothing
    # (cost.overlap.unhidden gives back what their conversions' prices hide)
    extra, freed, peak, again = recompute.chosen(graph, strategies, solution.choice, costs, solution.recompute)
    rerun = _rerun(graph, again)
    colls, overlaps = _collectives(graph, strategies, solution.choice, costs, rerun)
    for n, strat, cost in _priced(graph, strategies, solution.choice, costs):
        nodes[n.name] = NodeChoice(
            name=n.name, kind=n.kind, op=n.op_name, shapes=[m.shape for m in n.outputs],
            inputs=[pl.to_strings(p) for p in strat.inputs], outputs=[pl.to_strings(p) for p in strat.outputs],
            compute=cost.compute, comm=cost.communication, fqn=n.fqn, module=_module(n))
    total = plan_price(graph, strategies, solution.choice, costs) + extra   # as plan_cost and a search sum it
    param_node = {n.fqn: n.name for n in graph.nodes if n.kind == "param"}
    for alias, fqn in graph.param_aliases.items():
        if fqn in param_node:
            params[alias] = tuple(nodes[param_node[fqn]].outputs[0])
    solver = {"status": solution.status, "objective": solution.objective, "bound": solution.bound,
              "gap": solution.gap, "seconds": solution.seconds}
    input_shapes = [graph.by_name[i].outputs[0].shape if graph.by_name[i].outputs else () for i in graph.user_inputs]
    memory = rank_memory(graph, strategies, solution.choice, mesh, costs.training, costs.reshard)
    memory["activations"] += peak - freed
    memory["total"] += peak - freed
    memory["budget"] = budget
    # the conversions the schedule chunks: none made in a recomputed block's submodule
    chunks = [[o.producer, o.consumer, o.chunks, o.dim] for o in overlaps if o.chunks > 1 and o.producer not in rerun]
    # the batch cut into k interleaved chunks where that hides more than it costs (cost.interleave):
    # the step the plan estimates, and that a mesh search compares, is the one it runs
    k, saved = interleave.choose(graph, strategies, solution.choice, costs, rerun, lambda: (colls, overlaps))
    parts = breakdown(total, overlaps)
    parts.update(interleave_saved=saved, exposed=parts["exposed"] - saved, hidden=parts["hidden"] + saved)
    plan = Plan(tuple(mesh), nodes, params, colls, total.step - saved, costs.training, costs.cluster, solver,
                input_shapes, memory, parts,
                {"bucket_bytes": costs.bucket_bytes, "reshard_after_forward": costs.reshard, "outputs": graph.outputs,
                 "chunks": chunks, "interleave": k, "precision": graph.precision,
                 # causal attention whose work is balanced (cost.attention: where it pays)
                 "balanced_attention": [n.name for n in graph.nodes if n.kind == "op" and n.target is attention.SDPA
                                        and costs.balances(n, strategies[n.name][solution.choice[n.name]])]},
                aliases={a: f for a, f in graph.param_aliases.items() if a != f}, recompute=again or {},
                arrival={name: pl.to_strings(p) for name, p in costs.arrival.items()},
                _priced=Priced(graph, strategies, solution.choice, costs, total))   # for the alternatives, on demand
    return plan


def _priced(graph, strategies, choice: dict, costs):
    """(node, its strategy, its cost and its inputs' conversions', less what the schedule hides
    of them: ``cost.overlap.conversion_price``) of every node, in graph order."""
    for n in graph.nodes:
        strat = strategies[n.name][choice[n.name]]
        cost = costs.node(n, strat)
        for slot, value in enumerate(n.inputs):
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            cost = cost + costs.pair(value, n, slot, src, strat.inputs[slot])[0]
        yield n, strat, cost


def plan_cost(graph, strategies, solution, costs) -> float:
    """``make_plan(...).cost`` without the rest of the plan: the estimated step a mesh search
    compares plans by, before it makes the plan of the one it chooses."""
    extra, _, _, again = recompute.chosen(graph, strategies, solution.choice, costs, solution.recompute)
    rerun = _rerun(graph, again)
    saved = interleave.choose(graph, strategies, solution.choice, costs, rerun,
                              lambda: _collectives(graph, strategies, solution.choice, costs, rerun))[1]
    return choice_cost(graph, strategies, solution.choice, costs, extra) - saved   # make_plan's total, summed alike


def _rerun(graph, again) -> set:
    """The nodes of the blocks a plan recomputes (``recompute.chosen``'s last part)."""
    return {o for b in (again or {}).get("blocks", ()) for o in repeat.stack_blocks(graph)[b]}


def _collectives(graph, strategies, choice: dict, costs, rerun: set) -> tuple:
    """(the plan's collectives as the schedule runs them, in graph order; the ``cost.overlap``
    records of its conversions outside the recomputed blocks ``rerun``)."""
    colls, overlaps = [], []
    for n in graph.nodes:
        strat = strategies[n.name][choice[n.name]]
        for slot, value in enumerate(n.inputs):
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            dst = strat.inputs[slot]
            # what the schedule hides of it, and how it chunks it (cost.overlap)
            o = edge_overlap(costs, value, src, dst, n, slot)
            o_run = o if n.name not in rerun else None
            colls += _as_run(conversion_collectives(graph, costs, value, src, dst, n), o_run)
            overlaps += [o_run] if o_run is not None else []
        colls += own_collectives(graph, costs, n, strat)
    return colls, overlaps


def _as_run(colls: list, o) -> list:
    """A conversion's collectives as the schedule runs them: where it chunks the conversion
    (``o``, its ``cost.overlap.Overlap``), each phase's step takes the k chunks' seconds."""
    if o is None or o.chunks == 1:
        return colls
    return [dataclasses.replace(c, seconds=o.fwd if c.phase == "forward" else o.bwd) for c in colls]


def breakdown(total: Cost, overlaps: list) -> dict:
    """The step's parts (``cost.step.Cost``); in seconds its ``compute``, the communication it
    waits for (``exposed``, with the overlap's drag) and the communication hidden behind compute
    (``hidden``); and what the schedule hides of the activations' collectives, the chunks'
    drag deducted (``activations_hidden``), which the step counts (``cost.overlap``)."""
    overflow = max(0.0, total.hidden_fwd - total.compute_fwd) + max(0.0, total.hidden_bwd - total.compute_bwd)
    return asdict(total) | {"compute": total.compute, "exposed": total.exposed,
                            "hidden": total.hidden_fwd + total.hidden_bwd - overflow,
                            "activations_hidden": -sum(added(o) for o in overlaps)}


def _module(node) -> Optional[str]:
    """The innermost module an op was traced in (torch.export's ``nn_module_stack``)."""
    stack = node.fx_node.meta.get("nn_module_stack") if node.kind == "op" else None
    return list(stack.values())[-1][0] if stack else None


class Priced(NamedTuple):
    """What a made plan was priced from, kept on it (``Plan._priced``) for what is worked out only
    when asked for: its alternatives (``Plan.alternatives``) and its formula (``report.formula``)."""
    graph: object
    strategies: dict
    choice: dict
    costs: object
    total: Cost

    def alternatives(self, plan) -> dict:
        return alternatives(plan, *self)


# ---- alternatives, priced on demand --------------------------------------------------------------

TOP = 4


def _local(graph, strategies, choice, costs, users, n, s) -> tuple:
    """(Cost, bytes per rank) that node ``n`` adds when it runs strategy ``s`` and every other
    node keeps its choice."""
    cost, mem = costs.node(n, s), costs.memory(n, s)
    for slot, value in enumerate(n.inputs):
        src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
        cost = cost + conversion_price(costs, value, src, s.inputs[slot], n, slot)
        mem += costs.kept(value, src, s.inputs[slot], n)
    for k in range(len(n.outputs)):
        for name, slot in users.get((n.name, k), []):
            consumer = graph.by_name[name]
            dst = strategies[name][choice[name]].inputs[slot]
            cost = cost + conversion_price(costs, (n.name, k), s.outputs[k], dst, consumer, slot)
            mem += costs.kept((n.name, k), s.outputs[k], dst, consumer)
    return cost, mem


def _node_collectives(graph, strategies, choice, costs, users, n, s) -> list:
    """What strategy ``s`` of ``n`` communicates, as [kind, phase, axes, bytes, seconds, hidden, at]."""
    colls = list(own_collectives(graph, costs, n, s))
    for slot, value in enumerate(n.inputs):
        src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
        colls += conversion_collectives(graph, costs, value, src, s.inputs[slot], n)
    for k in range(len(n.outputs)):
        for name, slot in users.get((n.name, k), []):
            dst = strategies[name][choice[name]].inputs[slot]
            colls += conversion_collectives(graph, costs, (n.name, k), s.outputs[k], dst, graph.by_name[name])
    return [[c.kind, c.phase, list(c.axes), c.bytes, c.seconds, c.overlapped, c.node] for c in colls]


def alternatives(plan, graph, strategies, choice, costs, total: Cost) -> dict:
    """node name -> {"count", "options"} (the chosen option first), or {"same_as": twin}."""
    rep = tie_repeated(graph, strategies)
    count: dict = {}
    for r in rep.values():
        count[r] = count.get(r, 0) + 1
    users = graph.users()
    base_memory = plan.memory.get("total", 0)
    budget = plan.memory.get("budget")
    out = {}
    for n in graph.nodes:
        if n.kind == "output":
            continue
        if rep[n.name] != n.name:
            out[n.name] = {"same_as": rep[n.name]}
            continue
        strats = strategies[n.name]
        chosen = choice[n.name]
        here, here_mem = _local(graph, strategies, choice, costs, users, n, strats[chosen])
        rest = {f: getattr(total, f) - getattr(here, f) for f in Cost.__dataclass_fields__}
        best: dict = {}   # output placements -> (step, memory, index, cost)
        for i, s in enumerate(strats):
            cost, mem = _local(graph, strategies, choice, costs, users, n, s)
            step = Cost(**{f: rest[f] + getattr(cost, f) for f in rest}).step
            key = (s.outputs, attention.form(graph, n, s, costs.mesh_shape))   # attention: each form its own
            if i == chosen or key not in best or (step, mem) < best[key][:2]:
                if best.get(key, (0, 0, None))[2] != chosen:
                    best[key] = (step, mem, i, cost)
        others = sorted((v for k, v in best.items() if v[2] != chosen), key=lambda v: (v[0], v[1], v[2]))
        kept = others[:TOP]
        own = strats[chosen].outputs[0] if strats[chosen].outputs else ()
        for axis in range(len(own)):   # and the best with each other placement on each axis
            for v in others:
                p = strats[v[2]].outputs[0][axis]
                if p != own[axis] and not any(strats[k[2]].outputs[0][axis] == p for k in kept):
                    kept.append(v)
        kept.sort(key=lambda v: (v[0], v[1], v[2]))
        options = []
        mine = (strats[chosen].outputs, attention.form(graph, n, strats[chosen], costs.mesh_shape))
        for step, mem, i, cost in [best[mine]] + kept:
            s = strats[i]
            memory = base_memory - here_mem + mem
            options.append({
                "outputs": [list(pl.to_strings(p)) for p in s.outputs],
                "inputs": [list(pl.to_strings(p)) for p in s.inputs],
                **({"form": attention.form(graph, n, s, costs.mesh_shape),
                    "balanceable": attention.node_balance(graph, n, s, costs.mesh_shape) is not None}
                   if n.target is attention.SDPA else {}),
                "step": step, "compute": cost.compute, "comm": cost.communication, "memory": mem,
                "fits": budget is None or memory <= budget,
                "collectives": _node_collectives(graph, strategies, choice, costs, users, n, s)})
        out[n.name] = {"count": count[n.name], "options": options, "legal": len(best)}
    return out
