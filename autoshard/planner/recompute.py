"""Recomputation: which repeated blocks keep only their input and run their forward again in
backward, chosen by the integer program against the memory budget (DESIGN.md section 10).

A block (``blocks.7``: the first numbered module an op lives in, planner.repeat) that recomputes
keeps what its checkpoint holds: its inputs, the parameters it was given, and the outputs the
rest of the model reads. It frees every other activation it would keep (op outputs that only
the block reads, and the conversions of activations made for its ops), and pays in backward its
forward again: the ops' compute and their forward collectives. While one block's backward runs,
its activations are back: the peak holds one block's worth on top of what is kept.

Tied blocks (planner.repeat: every even layer shares block 0's layout, every odd layer block
1's) form one class of K identical blocks. How many of them recompute is an integer m in 0..K,
written in binary-weighted booleans r_j (weights 1, 2, 4, ..., the rest: every m reachable). For
one class, with F(x) the block's forward again (compute, collectives) and D(x) the bytes it
frees, both linear in the layout variables:

    saved_j <= D(x),  saved_j <= maxD * r_j                    memory -= w_j * saved_j
    peak >= D(x) - maxD * (1 - r_j)                             memory += peak   (one block back)
    E_j >= F(x) - maxF * (1 - r_j),  E_j >= 0                   cost   += w_j * E_j

exact at integer points: the budget pushes saved_j up to r_j * D(x), the objective pushes E_j
down to r_j * F(x). ``recompute="blocks"`` fixes every r_j to 1 (each term then linear in x);
``"none"`` adds nothing. A block whose ops change state when run (batch norm's running
statistics, in-place updates) never recomputes.
"""
from __future__ import annotations

from dataclasses import dataclass


from autoshard.cost.step import DRAG, PARTS, Cost
from autoshard.cost import memory
from autoshard.cost.compute import FLOPS, FLOPS_BY_NAME, qualified_name
from autoshard.cost.memory import rank_memory
from autoshard.planner.repeat import stack_blocks, tie_repeated, tied_plan

AUTO = "auto"
SELECTIVE = "selective"
MODES = (AUTO, "none", "blocks", SELECTIVE)
# CP-SAT's deterministic seconds for choosing how many blocks recompute, from the better of no
# block and every block recomputed (planner.solve._solve_choosing)
EFFORT = 5.0


def mode_of(costs) -> str:
    """The recompute mode a program is priced in (``Costs.recompute``; another mode's prices:
    ``Costs.with_recompute``)."""
    return costs.recompute


def chooses(graph, strategies, costs, budget) -> bool:
    """Whether the program chooses how many blocks recompute: ``"auto"``, training, under a
    budget, with repeated blocks to choose from."""
    if mode_of(costs) != AUTO or budget is None or not costs.training:
        return False
    return bool(groups(graph, tie_repeated(graph, strategies)))
_FWD, _COMM = PARTS.index("compute_fwd"), PARTS.index("comm")


def heavy(node) -> bool:
    """Whether an op does the arithmetic of a block (matmuls, attention, convolutions:
    ``cost.compute.FLOPS``): under ``"selective"`` it keeps its output and is not run again; the
    others (norms, activations, adds, dropout: cheap per byte they keep) are."""
    return node.target in FLOPS or qualified_name(node.target) in FLOPS_BY_NAME


@dataclass
class Group:
    """A class of tied blocks: their names in order, the first block's op nodes (whose variables
    the others share), and of those the ones no node outside the block reads (``inner``)."""
    blocks: list
    ops: list
    inner: set

    @property
    def name(self) -> str:
        return self.blocks[0]


def groups(graph, rep: dict) -> list:
    """The classes of tied blocks for this tying (``planner.repeat.tie_repeated``)."""
    blocks = stack_blocks(graph)
    if not blocks:
        return []
    by_key: dict = {}
    for name, ops in blocks.items():
        by_key.setdefault(tuple(rep[o] for o in ops), []).append(name)
    readers: dict = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v[0], []).append(n.name)
    out = []
    for key, names in by_key.items():
        ops = list(key)
        own = set(ops)
        inner = {o for o in ops if readers.get(o) and all(r in own for r in readers[o])}
        out.append(Group(names, ops, inner))
    return out


def _in_region(producer) -> bool:
    """Whether converting ``producer``'s output for an op of a recomputed block is run again and
    its result freed: an activation's is. A parameter's is made once before the block and kept
    as its checkpoint's input; where it is regathered for backward anyway
    (``reshard_after_forward``) it keeps nothing and its gather again is priced already."""
    return producer.kind != "param"


# ---- the integer program ------------------------------------------------------------------------

class _Linear:
    """A linear form over the program's variables, and the most it can reach."""

    def __init__(self):
        self.terms, self.const, self.most, self.least = {}, 0, 0, 0

    def add(self, var, c):
        if not c:
            return
        if var is None:
            self.const += c
        else:
            self.terms[var] = self.terms.get(var, 0) + c


def _forms(table, x, placed, costs, unit, integer, scale, light: bool = False) -> dict:
    """group name -> (compute F, collectives F, freed bytes D) of one block, as ``_Linear``;
    ``light``: its cheap ops only (``"selective"``: ``heavy``'s outputs are kept)."""
    rep = table.rep
    gs = groups(costs.graph, rep)
    if not gs:
        return {}
    owner = {o: g for g in gs for o in g.ops}
    forms = {g.name: (_Linear(), _Linear(), _Linear()) for g in gs}
    r = (lambda s: int(round(s * unit))) if integer else (lambda s: s * unit)
    for n, _, vecs, nbytes in table.nodes:
        g = owner.get(n.name)
        if g is None or (light and heavy(n)):
            continue
        fc, fm, d = forms[g.name]
        vs = x[n.name] or [None]
        inner = n.name in g.inner
        for var, vec, b in zip(vs, vecs, nbytes):
            fc.add(var, r(vec[_FWD]))
            fm.add(var, r(vec[_COMM]))
            if inner:
                d.add(var, b * scale)
        fc.most += max(r(vec[_FWD]) for vec in vecs)
        fm.most += max(r(vec[_COMM]) for vec in vecs)
        fc.least += min(r(vec[_FWD]) for vec in vecs)
        fm.least += min(r(vec[_COMM]) for vec in vecs)
        d.most += max(nbytes) * scale if inner else 0
    for (u, value, v, slot, times, src, dst, pairs), spots in placed:
        g = owner.get(v.name)
        if g is None or not _in_region(u):
            continue
        fc, fm, d = forms[g.name]
        most_t = most_b = 0
        price = costs.price_key(value, v, slot)   # edges of equal keys run every pair again alike
        for var, pair in spots:
            t = r(costs.rerun(value, v, slot, *pair, price))
            kept = pairs[pair][1] * scale
            fm.add(var, t)
            d.add(var, kept)
            most_t, most_b = max(most_t, t), max(most_b, kept)
        fm.most += most_t
        d.most += most_b
    return {g.name: (g, forms[g.name]) for g in gs}


def floor(table, costs, again: bool = True, light: bool = False) -> float:
    """Seconds no plan with every block recomputed (``"blocks"``) can beat, without a program:
    each node's cheapest strategy alone, its own cost (compute, collectives, optimizer step) and,
    in a block, its forward again once per block of its class (``again=False``: not, a bound of
    every plan; ``light``: its cheap ops only, ``"selective"``). The exposed communication and the conversions only add to a plan, so this is a
    bound; on a large model, where compute is most of the step, a close one (the 96-layer GPT
    on (128, 8): every block's forward again is a third of the step, more than the memory
    budget costs without recomputation, so ``"blocks"`` needs no program of its own there)."""
    weight = [DRAG if p.startswith("hidden") else 1.0 for p in PARTS]   # cost.step: the drag at least
    gs = groups(costs.graph, table.rep)
    runs = {o: len(g.blocks) for g in gs for o in g.ops
            if not (light and heavy(costs.graph.by_name[o]))} if again else {}
    total = 0.0
    for n, times, vecs, _ in table.nodes:
        k = runs.get(n.name, 0)
        total += min(times * sum(w * x for w, x in zip(weight, vec)) + k * (vec[_FWD] + vec[_COMM]) for vec in vecs)
    return total


def _weights(k: int) -> list:
    """Binary weights summing to ``k``: any count 0..k is a subset's sum."""
    out, w = [], 1
    while k > 0:
        out.append(min(w, k))
        k -= out[-1]
        w *= 2
    return out


@dataclass
class Handles:
    """The recompute variables of one program: per group, its (weight, boolean) pairs."""
    by_group: list   # (Group, [(w, r)])

    def counts(self, value) -> dict:
        """group name -> how many of its blocks recompute, from ``value(var)``."""
        return {g.name: sum(w for w, r in rs if (True if r is None else value(r))) for g, rs in self.by_group}


def add_terms(model, table, x, placed, costs, sums, unit, integer, scale, budgeted: bool):
    """The recompute choices onto ``model``: their costs onto ``sums`` and their memory as
    (terms, constant) bytes times ``scale``; and the ``Handles`` to read the choice back."""
    mode = mode_of(costs)
    none = ({}, 0), Handles([])
    if mode == "none" or not costs.training or (mode == "auto" and not budgeted):
        return none
    forms = _forms(table, x, placed, costs, unit, integer, scale, light=mode == SELECTIVE)
    if not forms:
        return none
    mem, const, by_group = {}, 0, []
    peak = model.int_var(0, max(f[2].most for _, f in forms.values()) or 1) if budgeted else None
    if peak is not None:
        mem[peak] = 1
    if mode in ("blocks", SELECTIVE):
        cost, (freed, less) = every_block(forms)
        for part, (terms, c) in cost.items():
            for var, k in terms.items():
                sums.coef[part][var] = sums.coef[part].get(var, 0) + k
            sums.const[part] += c
        for var, c in freed.items():
            mem[var] = mem.get(var, 0) + c
        const += less
        for g, (_, _, d) in forms.values():
            if peak is not None:   # peak >= D(x)
                model.at_least(_minus({peak: 1}, d.terms), d.const)
            by_group.append((g, [(len(g.blocks), None)]))
        by_group += [(Group([SELECTIVE], [], set()), [(1, None)])] if mode == SELECTIVE else []   # ``chosen``
        return (mem, const), Handles(by_group)
    for name, (g, (fc, fm, d)) in forms.items():
        k = len(g.blocks)
        rs = []
        for w in _weights(k):
            r = model.bool_var()
            rs.append((w, r))
            saved = model.int_var(0, d.most or 1)
            model.at_most(_minus({saved: 1}, d.terms), d.const)                 # saved <= D(x)
            model.at_most({saved: 1, r: -(d.most or 1)}, 0)                     # saved <= maxD * r
            mem[saved] = mem.get(saved, 0) - w
            model.at_least(_minus({peak: 1, r: -d.most}, d.terms), d.const - d.most)   # peak >= D - maxD(1 - r)
            for part, f in (("compute_bwd", fc), ("comm", fm)):
                if not f.most:
                    continue
                e = model.int_var(0, f.most)
                model.at_least(_minus({e: 1, r: -f.most}, f.terms), f.const - f.most)   # E >= F - maxF(1 - r)
                if f.least:   # E >= minF * r: the relaxation's fractional r pays its share
                    model.at_least({e: 1, r: -f.least}, 0)
                sums.coef[part][e] = sums.coef[part].get(e, 0) + w
        by_group.append((g, rs))
        for _, r in rs:   # a start that fits the budget where anything does: every block recomputed
            model.hint(r, True)
    return (mem, const), Handles(by_group)


def every_block(forms) -> tuple:
    """Every block of every class recomputed (``"blocks"``, ``"selective"``: ``_forms``' light
    ones), linear in the layouts: ({part: (terms, constant)} the cost adds, (terms, constant)
    the memory loses, negative); the peak of one block back is the caller's."""
    cost = {"compute_bwd": ({}, 0), "comm": ({}, 0)}
    freed, less = {}, 0
    for g, (fc, fm, d) in forms.values():
        k = len(g.blocks)
        for part, f in (("compute_bwd", fc), ("comm", fm)):
            terms, c = cost[part]
            for var, x in f.terms.items():
                terms[var] = terms.get(var, 0) + k * x
            cost[part] = (terms, c + k * f.const)
        for var, x in d.terms.items():
            freed[var] = freed.get(var, 0) - k * x
        less -= k * d.const
    return cost, (freed, less)


def _minus(base: dict, terms: dict) -> dict:
    out = dict(base)
    for v, c in terms.items():
        out[v] = out.get(v, 0) - c
    return out


def region_terms(model, strategies, table, x, placed, costs, scale, budgeted: bool) -> tuple:
    """The user's own checkpoint regions back in their backward (``cost.memory.region_peak``)
    as (terms, constant) bytes times ``scale`` of the memory budget: one variable at least each
    region's bytes made again, a linear form over the layout variables (tied blocks' regions
    alike: their representatives')."""
    graph, mesh = costs.graph, costs.mesh_shape
    if not (budgeted and costs.training) or all(n.region is None for n in graph.nodes):
        return {}, 0
    forms: dict = {}
    for n, _, _, _ in table.nodes:
        bs = [memory.back_bytes(n, st, mesh) * scale for st in strategies[n.name]]
        if any(bs):
            d = forms.setdefault(n.region, _Linear())
            for var, b in zip(x[n.name] or [None], bs):
                d.add(var, b)
            d.most += max(bs)
    for (u, value, v, *_), spots in placed:
        if v.region is None or not memory.in_region(graph, value, v):
            continue
        bs = [(var, memory.conversion_bytes(v, graph.meta(value), a, b, mesh, True) * scale) for var, (a, b) in spots]
        d = forms.setdefault(v.region, _Linear())
        for var, b in bs:
            d.add(var, b)
        d.most += max((b for _, b in bs), default=0)
    forms = [d for d in forms.values() if d.most]
    if not forms:
        return {}, 0
    peak = model.int_var(0, max(d.most for d in forms))
    for d in forms:   # peak >= D_r(x)
        model.at_least(_minus({peak: 1}, d.terms), d.const)
    return {peak: 1}, 0


# ---- a chosen plan's recomputation --------------------------------------------------------------

def block_price(graph, strategies, choice, costs, g: Group, light: bool = False) -> tuple:
    """(Cost of one block's forward run again, bytes it frees) in this plan; ``light``: its
    cheap ops only (``"selective"``)."""
    fwd = coll = freed = 0.0
    for name in g.ops:
        n = graph.by_name[name]
        strat = strategies[name][choice[name]]
        if not (light and heavy(n)):
            c = costs.node(n, strat)
            fwd += c.compute_fwd
            coll += c.comm
            if name in g.inner:
                freed += costs.memory(n, strat)
        for slot, value in enumerate(n.inputs):
            u = graph.by_name[value[0]]
            if not _in_region(u):
                continue
            src = strategies[value[0]][choice[value[0]]].outputs[value[1]]
            dst = strat.inputs[slot]
            coll += costs.rerun(value, n, slot, src, dst)
            freed += costs.kept(value, src, dst, n)
    return Cost(compute_bwd=fwd, comm=coll), int(freed)


def chosen(graph, strategies, choice, costs, counts: dict) -> tuple:
    """(extra Cost, bytes freed, peak bytes back, the report) of recomputing ``counts`` (group
    name -> how many of its blocks) blocks; the first blocks of each group recompute, their
    cheap ops only where ``counts[SELECTIVE]`` is set."""
    extra, freed, peak, blocks = Cost(), 0, 0, []
    if not counts or not any(counts.values()):
        return extra, 0, 0, None
    light = bool(counts.get(SELECTIVE))
    for g in groups(graph, tie_repeated(graph, strategies)):
        m = counts.get(g.name, 0)
        if not m:
            continue
        cost, d = block_price(graph, strategies, choice, costs, g, light)
        for _ in range(m):
            extra = extra + cost
        freed += m * d
        peak = max(peak, d)
        blocks += g.blocks[:m]
    order = list(stack_blocks(graph))
    blocks.sort(key=order.index)
    report = {"mode": mode_of(costs), "blocks": blocks, "of": len(order), "selective": light,
              "compute": extra.compute, "communication": extra.comm, "freed": freed, "peak": peak}
    return extra, freed, peak, report


def best_counts(graph, strategies, choice, costs, budget) -> dict:
    """For a fixed layout (a descent's start), how many blocks of each group recompute: none
    (``"none"``, or when the plan fits), all (``"blocks"``), else the fewest by forward time per
    byte freed until it fits, all where it cannot."""
    mode = mode_of(costs)
    gs = groups(graph, tie_repeated(graph, strategies)) if mode != "none" and costs.training else []
    if not gs:
        return {}
    if mode == "blocks":
        return {g.name: len(g.blocks) for g in gs}
    if mode == SELECTIVE:
        return {**{g.name: len(g.blocks) for g in gs}, SELECTIVE: 1}
    if budget is None:
        return {}
    need = rank_memory(graph, strategies, choice, costs.mesh_shape, costs.training, costs.reshard,
                       tied_plan(graph, strategies, choice))["total"]
    if need <= budget:
        return {}
    priced = [(g, *block_price(graph, strategies, choice, costs, g)) for g in gs]
    priced = [p for p in priced if p[2] > 0]
    counts, peak = {}, 0
    for g, cost, d in sorted(priced, key=lambda p: p[1].step / p[2]):
        for m in range(1, len(g.blocks) + 1):
            counts[g.name] = m
            peak = max(peak, d)
            need -= d
            if need + peak <= budget:
                return counts
    return counts
