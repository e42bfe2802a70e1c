"""Why a tensor is laid out as it is: the alternatives the solver had, priced, and how to force one.

The alternatives are the plan's (``plan.alternatives``, priced and chosen by
``planner.make.alternatives``, whose docstring says how); this module words them and never
imports ``autoshard.plan`` (see its docstring).
"""
from __future__ import annotations

import difflib

from autoshard import placement as pl
from autoshard.report.summary import columns, fmt_axes, fmt_bytes, fmt_s

# ---- words --------------------------------------------------------------------------------------

def _axis_words(p: str, size: int) -> str:
    if p == "B":
        return f"whole on each of its {size} devices"
    if p == "P":
        return f"a partial sum on each of its {size} devices (the value is their sum)"
    place = pl.parse(p)
    groups = f" within each of {place.groups} blocks" if getattr(place, "groups", 1) > 1 else ""
    return f"dim {place.dim} split {size} ways{groups}"


def _nd(p) -> str:
    return "(" + ", ".join(p) + ")"


def _coll_words(c) -> str:
    kind, phase, axes, nbytes, seconds, hidden, at = c
    return (f"{kind} {'fwd' if phase == 'forward' else 'bwd'} over axes {fmt_axes(axes)} "
            f"{fmt_bytes(nbytes)} {fmt_s(seconds)}{' hidden' if hidden else ''}")


def _signed(t: float) -> str:
    return ("+" if t >= 0 else "-") + fmt_s(abs(t))


def _signed_bytes(n: float) -> str:
    return ("+" if n >= 0 else "-") + fmt_bytes(abs(n))


def resolve(plan, name: str) -> tuple:
    """(graph node name, parameter name or None) of a parameter or node name; a clear error else."""
    fqn = plan.aliases.get(name, name)
    for n in plan.nodes.values():
        if n.kind == "param" and n.fqn == fqn:
            return n.name, name
    if name in plan.nodes and plan.nodes[name].kind != "output":
        return name, None
    known = list(plan.params) + [n for n in plan.nodes if plan.nodes[n].kind != "output"]
    close = difflib.get_close_matches(name, known, n=3)
    raise KeyError(f"{name!r} is neither a parameter of the model nor a node of its graph"
                   + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                      "; plan.params lists the parameters, plan.table() the nodes"))


def explain(plan, name: str) -> str:
    node_name, param = resolve(plan, name)
    n = plan.nodes[node_name]
    mesh = tuple(plan.mesh_shape)
    shape = "x".join(map(str, n.shapes[0])) if n.shapes else "-"
    what = f"parameter {param} (graph node {node_name})" if param else f"node {node_name} ({n.op})"
    lines = [f"{what}, shape {shape}" + (f", in {n.module}" if n.module else "")]
    if n.outputs:
        lines.append(f"placement {_nd(n.outputs[0])}:")
        for a, (p, size) in enumerate(zip(n.outputs[0], mesh)):
            lines.append(f"  axis {a} ({size} devices): {p}, {_axis_words(p, size)}")
        for d, sizes in pl.uneven_splits(tuple(n.shapes[0]), tuple(map(pl.parse, n.outputs[0])), mesh).items():
            lines.append(f"  dim {d} ({n.shapes[0][d]}) does not divide: its ranks hold {','.join(map(str, sizes))} "
                         "(DTensor's chunks), priced by the largest")
    if n.kind == "op" and n.inputs:
        lines.append("computes from inputs laid out " + ", ".join(_nd(p) for p in n.inputs))
    entry = plan.alternatives.get(node_name)
    if entry and "same_as" in entry:
        twin = entry["same_as"]
        lines.append(f"its repeated block shares one choice with {twin}'s; the alternatives are priced there")
        entry = plan.alternatives.get(twin)
    if not entry:
        lines.append("no alternatives recorded: this plan was saved without them")
        return "\n".join(lines)
    options = entry["options"]
    chosen = options[0]
    colls = chosen["collectives"]
    lines.append(f"in this plan it costs compute {fmt_s(chosen['compute'])}, communication {fmt_s(chosen['comm'])}, "
                 f"memory {fmt_bytes(chosen['memory'])} per rank of its own"
                 + (": " + "; ".join(_coll_words(c) for c in colls[:4]) + (" ..." if len(colls) > 4 else "") if colls else ""))
    if entry.get("count", 1) > 1:
        lines.append(f"the solver gives this choice to {entry['count']} nodes of the repeated blocks at once")
    if len(options) == 1:
        lines.append("no other layout is legal here" if entry.get("legal", 1) == 1 else "")
        return "\n".join(line for line in lines if line)
    lines.append(f"alternatives ({entry.get('legal', len(options)) - 1} in all; each priced as the plan with only "
                 f"this node changed):")
    rows = [("placement", "step", "vs plan", "compute", "comm", "memory/rank", "")]
    for k, o in enumerate(options):
        rows.append((_nd(o["outputs"][0]) if o["outputs"] else "-", fmt_s(o["step"]),
                     "chosen" if k == 0 else _signed(o["step"] - chosen["step"]), fmt_s(o["compute"]), fmt_s(o["comm"]),
                     fmt_bytes(o["memory"]), "" if o["fits"] else "over the memory budget"))
    lines += ["  " + r for r in columns(rows)]
    lines += _why(plan, param or node_name, chosen, options[1:])
    if "form" in chosen:
        lines += _attention(plan, node_name, n, chosen, options[1:])
    return "\n".join(lines)


FORMS = {"allgather": "the keys and values gathered whole on each rank (Llama 3's all-gather form)",
         "ring": "the keys and values passed round the ring, the partial outputs merged by log-sum-exp (ring form)",
         "": "no split of the sequence"}


def _attention(plan, name, n, chosen, others) -> list:
    """Attention: which form of context parallelism it takes, and what the others would cost."""
    seq = len(n.shapes[0]) - 2 if n.shapes else 2
    axes = [a for a, p in enumerate(chosen["inputs"][0]) if p == f"S({seq})" and plan.mesh_shape[a] > 1]
    out = [f"attention: {FORMS[chosen['form']]}"
           + (f"; the queries split along the sequence on axes {fmt_axes(axes)}" if axes else "")]
    if name in plan.schedule.get("balanced_attention", ()):
        out.append("  causal work balanced: each rank swaps half its queries with its mirror rank and holds a head "
                   "and a tail of the sequence (priced in, the swaps costing less than the compute they save)")
    elif chosen.get("balanceable"):   # causal, no dropout, one axis splitting the queries in even halves
        out.append("  causal work not balanced: the swaps would cost more than they save")
    for form in ("allgather", "ring", ""):
        if form == chosen["form"]:
            continue
        o = next((o for o in others if o.get("form") == form), None)
        if o is None:
            continue
        d = o["step"] - chosen["step"]
        pin = ", ".join(map(_nd, o["inputs"])) + " -> " + _nd(o["outputs"][0])
        out.append(f"  {FORMS[form]}: {_signed(d)} per step (communication {_signed(o['comm'] - chosen['comm'])}, "
                   f"compute {_signed(o['compute'] - chosen['compute'])}, memory "
                   f"{_signed_bytes(o['memory'] - chosen['memory'])} per rank"
                   + ("" if o["fits"] else ", over the memory budget") + f"); to force it: pin={{{name!r}: {pin!r}}}")
    return out


def _why(plan, name, chosen, others) -> list:
    """Words: why the chosen layout won over the runner-up, and the pin that forces another."""
    out = []
    # the chosen layout's step as the solver priced it, before the batch is interleaved
    # (plan.breakdown["interleave_saved"]), as every alternative is priced
    base = chosen["step"]
    exact = plan.solver.get("gap") is not None
    runner = next((o for o in others if o["fits"]), None)
    cheaper = [o for o in others if o["step"] < base * (1 - 1e-9)]
    if runner is not None:
        d_comm, d_comp = runner["comm"] - chosen["comm"], runner["compute"] - chosen["compute"]
        d_mem = runner["memory"] - chosen["memory"]
        parts = [f"communication {_signed(d_comm)}", f"compute {_signed(d_comp)}", f"memory {_signed_bytes(d_mem)} per rank"]
        new = [c for c in runner["collectives"] if c not in chosen["collectives"]]
        verdict = ("costs the same: the solver's pick among equals" if abs(runner["step"] - base) <= 1e-12 else
                   f"would cost {fmt_s(runner['step'] - base)} more per step" if runner["step"] > base else
                   f"would save {fmt_s(base - runner['step'])} per step")
        out.append(f"why: the next best, {_nd(runner['outputs'][0])}, {verdict} ({', '.join(parts)}"
                   + (f"; it would add {'; '.join(_coll_words(c) for c in new[:3])}" if new else "") + ")")
    unfit = [o for o in others if not o["fits"]]
    if unfit:
        out.append(f"{', '.join(_nd(o['outputs'][0]) for o in unfit)} would not fit the memory budget")
    if cheaper:
        o = cheaper[0]
        out.append(f"note: {_nd(o['outputs'][0])} alone would save {fmt_s(base - o['step'])} per step"
                   + ("" if o["fits"] else " but breaks the memory budget")
                   + ("; the solver's bound allows it (gap " + f"{100 * plan.solver['gap']:.2f}%)" if exact else
                      "; this plan is a local optimum of one-axis descent, not proven"))
    own = chosen["outputs"][0] if chosen["outputs"] else []
    for axis, p in enumerate(own):
        alt = [o for o in others if o["outputs"][0][axis] != p]
        if not alt:
            out.append(f"  axis {axis}: {p} is the only placement the solver had on this axis")
            continue
        o = alt[0]
        out.append(f"  axis {axis}: {p} chosen; the best with {o['outputs'][0][axis]} there, {_nd(o['outputs'][0])}, "
                   f"{_signed(o['step'] - base)} per step" + ("" if o["fits"] else ", over the memory budget"))
    target = runner or (others[0] if others else None)
    if target is not None:
        pin = tuple(target["outputs"][0])
        out.append(f"to force it: autoshard.plan(..., pin={{{name!r}: {pin!r}}})"
                   + (f"; the step then costs {'at most' if exact else 'about'} {fmt_s(target['step'])}"
                      if target["fits"] else ""))
    return out
