"""Why a tensor is laid out as it is: the alternatives the solver had, priced.

For a graph node n (a parameter's node, an input, an op) and each strategy s the solver could
have given it, the plan with n switched to s and every other node held where it is:

    step(s)    the whole plan's step (``cost.step``): n's own cost, the conversions of its
               inputs from their producers' layouts, and of its outputs into their consumers'
               layouts, all re-priced under s; every max of the step taken again
    compute    n's compute under s
    comm       n's communication under s: its own collectives and those conversions
    memory     bytes per rank of the whole plan

The solver minimised the same cost over every node at once, so no alternative beats the chosen
one by more than the solver's gap, unless it breaks the memory budget or the solve was a local
optimum (descent on 3- and 4-axis meshes). Holding the neighbours makes step(s) an upper bound on
what a plan pinned to s costs: a pin (``pin={name: placement}``, which fixes a node's output
layout) lets the solver move the neighbours too.

The alternatives are worked out when first asked for (or when the plan is saved), from the
solver's own ``Costs`` of the mesh the plan was made on; a saved plan carries them, and keeps of
each node the best strategy per output layout: the few best overall, and the best with each
other placement on each axis.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from autoshard import placement as pl
from autoshard.cost.memory import rank_memory
from autoshard.cost.step import Cost

KEEP = 6   # alternatives kept per node beside the best per axis and placement


@dataclass(frozen=True)
class Alternative:
    inputs: tuple       # per tensor input: per-axis placement strings
    outputs: tuple      # per tensor output: per-axis placement strings
    step: float         # seconds per step of the plan with this node switched, the rest held
    compute: float      # seconds of this node's compute
    comm: float         # seconds of this node's collectives and of its inputs' and outputs' conversions
    memory: int         # bytes per rank of the whole plan with this node switched
    chosen: bool = False

    def to_list(self) -> list:
        return [list(map(list, self.inputs)), list(map(list, self.outputs)), self.step, self.compute, self.comm,
                self.memory, self.chosen]

    @staticmethod
    def from_list(row) -> "Alternative":
        ins, outs, step, compute, comm, memory, chosen = row
        return Alternative(tuple(map(tuple, ins)), tuple(map(tuple, outs)), step, compute, comm, memory, chosen)


def _minus_plus(total: Cost, old: Cost, new: Cost) -> Cost:
    return Cost(*(getattr(total, f.name) - getattr(old, f.name) + getattr(new, f.name) for f in fields(Cost)))


def priced(graph, strategies, choice: dict, costs, keep: int = KEEP) -> dict:
    """node name -> [Alternative], the chosen strategy first, then the kept ones best first."""
    mesh = costs.mesh_shape
    chosen = {n.name: strategies[n.name][choice[n.name]] for n in graph.nodes}
    users = graph.users()
    total = Cost()
    for n in graph.nodes:
        total = total + costs.node(n, chosen[n.name])
        for slot, value in enumerate(n.inputs):
            total = total + costs.convert(value, chosen[value[0]].outputs[value[1]], chosen[n.name].inputs[slot], n)
    memory = rank_memory(graph, strategies, choice, mesh, costs.training, costs.reshard)["total"]
    out = {}
    for n in graph.nodes:
        strats = strategies[n.name]
        if n.kind == "output" or len(strats) < 2:
            continue

        def local(s, n=n):
            cost, mem = costs.node(n, s), costs.memory(n, s)
            for slot, value in enumerate(n.inputs):
                src = chosen[value[0]].outputs[value[1]]
                cost = cost + costs.convert(value, src, s.inputs[slot], n)
                mem += costs.kept(value, src, s.inputs[slot], n)
            for i in range(len(n.outputs)):
                for consumer, slot in users.get((n.name, i), []):
                    c = graph.by_name[consumer]
                    dst = chosen[consumer].inputs[slot]
                    cost = cost + costs.convert((n.name, i), s.outputs[i], dst, c)
                    mem += costs.kept((n.name, i), s.outputs[i], dst, c)
            return cost, mem

        base_cost, base_mem = local(chosen[n.name])
        best: dict = {}   # output layout -> (step, index, cost, mem)
        for i, s in enumerate(strats):
            cost, mem = local(s)
            step = _minus_plus(total, base_cost, cost).step
            key = s.outputs
            if key not in best or (step, i) < best[key][:2]:
                best[key] = (step, i, cost, mem)
        mine = choice[n.name]
        ranked = sorted((v for k, v in best.items() if v[1] != mine), key=lambda v: v[:2])
        kept = {v[1]: v for v in ranked[:keep]}
        own = chosen[n.name].outputs[0] if chosen[n.name].outputs else ()
        for axis in range(len(own)):
            for v in ranked:   # the best with each other placement on this axis
                p = strats[v[1]].outputs[0][axis]
                if p != own[axis] and not any(strats[k].outputs[0][axis] == p for k in kept):
                    kept[v[1]] = v
        rows = [(total.step, mine, base_cost, base_mem)] + sorted(kept.values(), key=lambda v: v[:2])
        out[n.name] = [Alternative(tuple(pl.to_strings(p) for p in strats[i].inputs),
                                   tuple(pl.to_strings(p) for p in strats[i].outputs), step, cost.compute,
                                   cost.communication, int(memory - base_mem + mem), i == mine)
                       for step, i, cost, mem in rows]
    return out


# ---- what a plan carries ------------------------------------------------------------------------

def attach(plan, graph, strategies, choice: dict, costs) -> None:
    """Keep what pricing the alternatives needs on the plan, to work them out when first asked."""
    plan.__dict__["_explain_source"] = (graph, strategies, dict(choice), costs)


def data(plan) -> dict:
    """{"aliases": parameter name -> its graph node, "alternatives": node -> [Alternative]}."""
    if "_explain" not in plan.__dict__:
        source = plan.__dict__.get("_explain_source")
        if source is None:
            return {"aliases": {}, "alternatives": {}}
        graph = source[0]
        param_node = {n.fqn: n.name for n in graph.nodes if n.kind == "param"}
        aliases = {a: param_node[f] for a, f in graph.param_aliases.items() if f in param_node}
        plan.__dict__["_explain"] = {"aliases": aliases, "alternatives": priced(*source)}
    return plan.__dict__["_explain"]


def to_json(plan) -> dict:
    d = data(plan)
    return {"aliases": d["aliases"], "alternatives": {k: [a.to_list() for a in v] for k, v in d["alternatives"].items()}}


def from_json(plan, d) -> None:
    if d:
        plan.__dict__["_explain"] = {"aliases": dict(d.get("aliases", {})), "alternatives": {
            k: [Alternative.from_list(r) for r in v] for k, v in d.get("alternatives", {}).items()}}


def node_alternatives(plan, name: str) -> list:
    """The priced alternatives of node ``name`` (a parameter's name is taken too), the chosen
    one first; empty for a node with one possible layout."""
    return list(data(plan)["alternatives"].get(_node_name(plan, name), []))


def _node_name(plan, name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name is a parameter's name (e.g. 'blocks.0.fc.weight') or a graph node's, got {name!r}")
    if name in plan.nodes:
        return name
    by_fqn = {n.fqn: n.name for n in plan.nodes.values() if n.kind == "param" and n.fqn}
    by_fqn.update(data(plan)["aliases"])
    if by_fqn.get(name):
        return by_fqn[name]
    import difflib
    known = sorted(set(plan.params) | set(plan.nodes))
    close = difflib.get_close_matches(name, known, n=3)
    raise KeyError(f"{name!r} is neither a parameter of the model nor a node of its graph"
                   + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                      "; plan.params and plan.nodes list the names"))


def _fmt_s(t: float) -> str:
    from autoshard.summary import fmt_s
    return fmt_s(t)


def _fmt_bytes(n: float) -> str:
    from autoshard.summary import fmt_bytes
    return fmt_bytes(n)


def _delta(t: float, base: float) -> str:
    sign = "+" if t >= base else "-"
    return f"{sign}{_fmt_s(abs(t - base))}"


def _nd(strings) -> str:
    return "(" + ", ".join(strings) + ")"


def _what(p: str) -> str:
    if p == "B":
        return "whole on every device"
    if p == "P":
        return "a partial sum on each device"
    return f"split along dim {p[2:p.index(')')]}" + (f" in {p.split('/')[1]} blocks" if "/" in p else "")


def explain(plan, name: str) -> str:
    """The placement of ``name`` per axis, what it costs, the alternatives and what forces each."""
    node = _node_name(plan, name)
    n = plan.nodes[node]
    mesh = tuple(plan.mesh_shape)
    alts = data(plan)["alternatives"].get(node, [])
    title = (f"{n.fqn} (parameter, graph node {n.name})" if n.kind == "param" else
             f"{n.name} ({n.op}{', in ' + n.module if n.module else ''})" if n.kind == "op" else f"{n.name} ({n.kind})")
    shape = "x".join(map(str, n.shapes[0])) if n.shapes else "-"
    lines = [f"{title}: shape {shape}"]
    if n.outputs:
        place = n.outputs[0]
        lines.append(f"placement {_nd(place)}:")
        for a, p in enumerate(place):
            lines.append(f"  axis {a} ({mesh[a]} devices): {p}, {_what(p)}")
    for slot, ins in enumerate(n.inputs):
        lines.append(f"  takes input {slot} as {_nd(ins)}")
    for c in (c for c in plan.collectives if c.node == node):
        lines.append(f"  {c.kind} {c.phase} over axes {tuple(c.axes)}: {_fmt_bytes(c.bytes)}, {_fmt_s(c.seconds)}"
                     + (" (hidden behind compute)" if c.overlapped else ""))
    lines.append(f"its cost in the plan: compute {_fmt_s(n.compute)}, communication {_fmt_s(n.comm)} "
                 f"(its own collectives and its inputs' conversions); the plan's step {_fmt_s(plan.cost)}")
    if not alts:
        lines.append("no alternatives: this node has one possible layout on this mesh (a pin, or a tensor no rule splits)")
        return "\n".join(lines)
    mine, others = alts[0], alts[1:]
    budget = plan.memory.get("budget")
    lines += ["", f"alternatives, each priced with every other tensor held where it is (a plan pinned to one "
                  f"costs at most its step: the solver may move the neighbours too):"]
    rows = [("placement", "step", "vs plan", "compute", "comm", "memory/rank", "")]
    for a in [mine] + others:
        fits = budget is None or a.memory <= budget
        rows.append((_nd(a.outputs[0]) if a.outputs else "-", _fmt_s(a.step),
                     "chosen" if a.chosen else _delta(a.step, mine.step), _fmt_s(a.compute), _fmt_s(a.comm),
                     _fmt_bytes(a.memory), "" if fits else "over budget"))
    from autoshard.summary import columns
    lines += ["  " + r for r in columns(rows)]
    lines.append("")
    lines += _why(plan, n, mine, others, budget)
    return "\n".join(lines)


def _pin(plan, n, placement) -> str:
    key = n.fqn if n.kind == "param" and n.fqn else n.name
    return f"pin={{{key!r}: {tuple(placement)!r}}}"


def _why(plan, n, mine, others, budget) -> list:
    """The reasons in words: what the best alternative would change, and what forces it."""
    out = []
    fitting = [a for a in others if budget is None or a.memory <= budget]
    cheaper = [a for a in others if a.step < mine.step * (1 - 1e-9)]
    if not others:
        return out
    best = min(fitting or others, key=lambda a: a.step)
    parts = []
    for label, d in (("compute", best.compute - mine.compute), ("communication", best.comm - mine.comm)):
        if abs(d) > 1e-12:
            parts.append(f"{label} {'+' if d > 0 else '-'}{_fmt_s(abs(d))}")
    dm = best.memory - mine.memory
    if dm:
        parts.append(f"memory {'+' if dm > 0 else '-'}{_fmt_bytes(abs(dm))} per rank")
    if cheaper and all(budget is not None and a.memory > budget for a in cheaper):
        out.append(f"why: {_nd(cheaper[0].outputs[0])} would be faster by {_fmt_s(mine.step - cheaper[0].step)} "
                   f"but needs {_fmt_bytes(cheaper[0].memory)} per rank, over the budget of {_fmt_bytes(budget)}.")
    elif best.step < mine.step * (1 - 1e-9):
        why = ("the solve was a local optimum of one-axis descent" if plan.solver.get("gap") is None
               else f"the solver stops within {100 * max(plan.solver.get('gap') or 0, 1e-3):.1f}% of the optimum")
        out.append(f"why: {_nd(best.outputs[0])} alone would save {_fmt_s(mine.step - best.step)} "
                   f"({', '.join(parts) or 'no part changes'}); {why}.")
    else:
        out.append(f"why: {_nd(mine.outputs[0]) if mine.outputs else 'this layout'} is the cheapest; the next best, "
                   f"{_nd(best.outputs[0])}, would add {_fmt_s(best.step - mine.step)} to the step "
                   f"({', '.join(parts) or 'in the max of compute and hidden communication'}).")
    out.append(f"to force it: {_pin(plan, n, best.outputs[0])}; the solver then re-plans the neighbours.")
    if mine.outputs:
        own = mine.outputs[0]
        for axis in range(len(own)):
            alt = [a for a in others if a.outputs[0][axis] != own[axis]]
            if not alt:
                out.append(f"  axis {axis}: {own[axis]} is the only placement this tensor can take on this axis")
                continue
            a = min(alt, key=lambda a: a.step)
            out.append(f"  axis {axis}: {own[axis]} chosen; the best with {a.outputs[0][axis]} there, "
                       f"{_nd(a.outputs[0])}, {_delta(a.step, mine.step)} per step")
    return out
