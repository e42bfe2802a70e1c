"""A plan's estimated step time as a formula (sympy), in named sizes, mesh axes, links and peaks.

``formula(plan, dims)`` prices the plan again, node by node and conversion by conversion, as the
solver priced it (``cost.price.Costs``, ``cost.comm``, ``cost.compute``, ``cost.step``), but
with every quantity carried twice: as a sympy expression and as its number. The symbols:

    sizes       the tensor sizes named in ``dims`` (by default ``b``: the first input's dim 0,
                ``s``: its dim 1 when it holds tokens, ``d``: the parameters' most common dim)
    p0, p1 ..   each mesh axis's size
    alpha_a, beta_a   latency per ring step and bandwidth of axis a's link (``alpha_0_1`` of
                the groups that span axes 0 and 1 at once); ``o`` a collective's launch overhead
    F (F16)     peak FLOP/s of 4-byte (2-byte) matmuls; ``M`` memory bandwidth

A tensor's size is written in the named sizes where it equals one of their products (``b*s``,
``d/h``) or, above 64, a small multiple of one (``3*d``); where two named sizes are equal the
first named wins, so name sizes whose values differ for a faithful formula. Other sizes stay
numbers, and so does the cluster's efficiency. Each max and min of the cost model (the roofline's
compute or memory bound, a ring or a tree all-reduce, communication hidden or not behind compute,
a gradient's share of its bucket) is taken at the branch the plan's own values select: the
formula is the plan's cost where it stands, exact at ``values`` and smooth around them.

Only published cluster figures have a formula: a measured cluster prices kernels and collectives
by fitted rates (``autoshard.measure``), which have no closed form here.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict

import sympy

from autoshard import placement as pl
from autoshard.convert import apply_shape, dual_steps
from autoshard.cost import attention, comm, compute
from autoshard.cost.compute import BACKWARD_FACTOR
from autoshard.cost.overlap import edge_price
from autoshard.cost.step import DRAG
from autoshard.outputs import dual_at

PARTS = ("step", "compute", "communication", "exposed")
SMALL = 64          # sizes up to this stay numbers unless they equal a product of named sizes
MULTIPLES = 8       # a size above SMALL may be up to this many times a product of named sizes


class Q:
    """A quantity as a sympy expression ``e`` and its value ``v``, computed in lockstep."""
    __slots__ = ("e", "v")

    def __init__(self, e, v):
        self.e, self.v = e, v

    def __add__(self, o):
        o = q(o)
        return Q(self.e + o.e, self.v + o.v)

    __radd__ = __add__

    def __sub__(self, o):
        o = q(o)
        return Q(self.e - o.e, self.v - o.v)

    def __rsub__(self, o):
        return q(o) - self

    def __mul__(self, o):
        o = q(o)
        return Q(self.e * o.e, self.v * o.v)

    __rmul__ = __mul__

    def __truediv__(self, o):
        o = q(o)
        return Q(self.e / o.e, self.v / o.v)

    def __rtruediv__(self, o):
        return q(o) / self

    __floordiv__ = __truediv__   # splits are even: a rank's share divides exactly

    def __repr__(self):
        return f"Q({self.e}, {self.v})"


def q(x) -> Q:
    if isinstance(x, Q):
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"not a number: {x!r}")
    return Q(sympy.Integer(x) if float(x).is_integer() else sympy.nsimplify(x, rational=True), x)


def larger(a: Q, b: Q) -> Q:
    """max(a, b) at the plan's values."""
    return a if q(a).v >= q(b).v else q(b)


def smaller(a: Q, b: Q) -> Q:
    return a if q(a).v <= q(b).v else q(b)


# ---- naming sizes --------------------------------------------------------------------------------

def default_dims(plan, graph) -> dict:
    """b (the first input's dim 0), s (its dim 1, when it holds integer tokens), d (the most
    common dim of the parameters)."""
    out = {}
    inputs = [graph.by_name[i] for i in graph.user_inputs if graph.by_name[i].outputs]
    if inputs and inputs[0].outputs[0].shape:
        meta = inputs[0].outputs[0]
        out["b"] = meta.shape[0]
        if len(meta.shape) >= 2 and not meta.floating:
            out["s"] = meta.shape[1]
    sizes = Counter(s for n in graph.nodes if n.kind == "param" for s in n.outputs[0].shape if s > 1)
    if sizes:
        out["d"] = max(sizes.items(), key=lambda kv: (kv[1], kv[0]))[0]
    return out


class Namer:
    """A tensor size as a Q in the named sizes (``dims``), or as a number."""

    def __init__(self, dims: dict):
        self.symbols = [(sympy.Symbol(k, positive=True, integer=True), v) for k, v in dims.items()]
        self._cache: dict = {}
        self._monomials = self._enumerate()

    def _enumerate(self) -> list:
        """(degree, expression, value) of every product of up to 3 named sizes, one of them
        possibly dividing."""
        out = []
        syms = self.symbols
        for i, (s, v) in enumerate(syms):
            out.append((1, s, v))
        for i in range(len(syms)):
            for j in range(i, len(syms)):
                out.append((2, syms[i][0] * syms[j][0], syms[i][1] * syms[j][1]))
                for k in range(j, len(syms)):
                    out.append((3, syms[i][0] * syms[j][0] * syms[k][0], syms[i][1] * syms[j][1] * syms[k][1]))
        for i in range(len(syms)):
            for j in range(len(syms)):
                if i != j and syms[i][1] % syms[j][1] == 0:
                    out.append((2, syms[i][0] / syms[j][0], syms[i][1] // syms[j][1]))
        return out   # stable: degree, then the order named

    def __call__(self, size: int) -> Q:
        if size not in self._cache:
            self._cache[size] = Q(self._name(size), size)
        return self._cache[size]

    def _name(self, size: int):
        if size == 1:
            return sympy.Integer(1)
        exact = [m for m in self._monomials if m[2] == size]
        if exact:
            return min(exact, key=lambda m: m[0])[1]
        if size > SMALL:
            multiples = [(m[0], size // m[2], m[1]) for m in self._monomials
                         if size % m[2] == 0 and size // m[2] <= MULTIPLES]
            if multiples:
                deg, c, e = min(multiples, key=lambda m: (m[0], m[1]))
                return c * e
        return sympy.Integer(size)


# ---- the plan priced again -----------------------------------------------------------------------

class _Pricer:
    def __init__(self, plan, graph, costs, dims: dict):
        cluster = costs.cluster
        self.graph, self.costs, self.cluster = graph, costs, cluster
        self.mesh_values = tuple(costs.mesh_shape)
        self.values: dict = {}
        self.mesh = [self._sym(f"p{a}", n, integer=True) for a, n in enumerate(self.mesh_values)]
        self.name = Namer(dims)
        for s, v in self.name.symbols:
            self.values[s] = v
        self._links: dict = {}
        self.overhead = self._sym("o", cluster.collective_overhead)
        self.efficiency = q(cluster.efficiency)
        self.memory_bandwidth = self._sym("M", cluster.memory_bandwidth)
        self._peaks: dict = {}

    def _sym(self, name, value, integer=False) -> Q:
        if value == 0:
            return q(0)
        s = sympy.Symbol(name, positive=True, **({"integer": True} if integer else {}))
        self.values[s] = value
        return Q(s, value)

    def link(self, axes) -> tuple:
        """(alpha, beta) of the groups spanning ``axes``."""
        axes = tuple(sorted(axes))
        if axes not in self._links:
            latency, bandwidth, _ = self.cluster.group_link(self.mesh_values, axes)
            tag = "_".join(map(str, axes))
            self._links[axes] = (self._sym(f"alpha_{tag}", latency), self._sym(f"beta_{tag}", bandwidth))
        return self._links[axes]

    def peak(self, itemsize: int) -> Q:
        name = "F" if itemsize >= 4 else "F16"
        if name not in self._peaks:
            self._peaks[name] = self._sym(name, self.cluster.matmul_flops(itemsize))
        return self._peaks[name]

    def size(self, axes) -> Q:
        return math.prod((self.mesh[a] for a in axes), start=q(1))

    def shape(self, meta) -> list:
        return [self.name(s) for s in meta.shape]

    def local(self, meta, placement) -> list:
        out = self.shape(meta)
        for a, p in enumerate(placement):
            if isinstance(p, pl.Split):
                out[p.dim] = out[p.dim] / self.mesh[a]
        return out

    # collectives (cost.comm)
    def all_reduce(self, nbytes: Q, axes, share: float = 1.0) -> Q:
        p = self.size(axes)
        alpha, beta = self.link(axes)
        share = q(share)
        ring = share * 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta
        steps = math.ceil(math.log2(p.v))
        tree = share * 2 * Q(sympy.ceiling(sympy.log(p.e, 2)), steps) * alpha + 2 * nbytes / beta
        return share * self.overhead + smaller(ring, tree)

    def step_time(self, step, nbytes: Q, share: float = 1.0) -> Q:
        if not step.is_collective:
            return q(0)
        if step.kind == "all_reduce":
            return self.all_reduce(nbytes, step.axes, share)
        p = self.size(step.axes)
        alpha, beta = self.link(step.axes)
        return q(share) * (self.overhead + (p - 1) * alpha) + comm.ring_bytes(step.kind, nbytes, p) / beta

    def steps_times(self, steps, meta, src, share: float = 1.0, last_itemsize=None) -> tuple:
        """Times of a conversion's steps and of their duals, from the symbolic local shape;
        ``share``: the first step's and the last dual's part of their bucket's latency;
        ``last_itemsize``: the last dual's bytes per element (``Costs.reduced_itemsize``)."""
        shapes = [self.local(meta, src)]
        for st in steps:
            shapes.append(list(apply_shape(shapes[-1], st, self.size(st.axes))))
        nbytes = [math.prod(s, start=q(1)) * meta.itemsize for s in shapes]
        fwd = [self.step_time(st, nbytes[i], share if i == 0 else 1.0) for i, st in enumerate(steps)]
        duals = dual_steps(steps, self.mesh_values)
        last = (last_itemsize or meta.itemsize) / meta.itemsize
        bwd = [self.step_time(st, nbytes[len(steps) - i] * (last if i == len(duals) - 1 else 1),
                              share if i == len(duals) - 1 else 1.0)
               for i, st in enumerate(duals)]
        return fwd, bwd

    # the parts of one node and of one conversion (cost.price.Costs)
    def scheduled(self, fwd: Q, bwd: Q) -> dict:
        hide = q(self.cluster.overlap)
        return {"comm": (1 - hide) * (fwd + bwd), "hidden_fwd": hide * fwd, "hidden_bwd": hide * bwd}

    def node(self, n, strat) -> dict:
        costs = self.costs
        if n.kind == "param":
            out = {}
            for axes, nbytes, _ in costs.grad_syncs(n, strat):
                meta = n.outputs[0]
                b = math.prod(self.local(meta, strat.outputs[0]), start=q(1)) * meta.itemsize
                t = self.all_reduce(b, axes, min(1.0, nbytes / costs.bucket_bytes))
                out = _plus(out, self.scheduled(q(0), t))
            return out
        if n.kind == "input" and n.name in costs.arrival:   # its rows converted as they arrive (inputs="local")
            steps, duals, _, _ = costs.arrival_times(n, strat)
            meta, src = n.outputs[0], costs.arrival[n.name]
            fwd, bwd = self.steps_times(steps, meta, src, 1.0, meta.itemsize)
            return {"comm": sum(fwd, q(0)) + sum(bwd if duals else [], q(0))} if steps else {}
        if n.kind != "op":
            return {}
        metas = [self.graph.meta(v) for v in n.inputs]
        ins = [self.local(m, p) for m, p in zip(metas, strat.inputs)]
        outs = [self.local(m, p) for m, p in zip(n.outputs, strat.outputs)]
        itemsize = max([m.itemsize for m in metas + n.outputs if m.floating] or [4])
        # context parallelism (cost.attention): the ring computes on every block of keys, and
        # causal work balanced is the slowest rank's share; their sends enter as numbers
        ring = attention.ring_axes(n, strat, self.mesh_values, metas[1].shape) if len(metas) > 1 else ()
        flops, moved = compute.work(n.target, attention.whole_keys(ins, ring, self.mesh_values) if ring else ins,
                                    outs, itemsize)
        t = q(moved) / (self.efficiency * self.memory_bandwidth)
        if flops is not None:
            t = larger(q(flops) / (self.efficiency * self.peak(itemsize)), t)
        balance = attention.node_balance(self.graph, n, strat, self.mesh_values) if costs.balances(n, strat) else None
        if balance is not None:
            t = t * q(attention.balanced_share(self.mesh_values[balance], bool(ring)))
        train = costs.training and n.requires_grad
        out = {"compute_fwd": t}
        if train:
            out["compute_bwd"] = BACKWARD_FACTOR * t
        for c in comm.op_collectives(n, strat, self.graph, self.mesh_values, costs.arrival):
            out = _plus(out, {"comm": self.all_reduce(q(c.nbytes), (c.axis,))})
        values = [tuple(q(x).v for x in shape) for shape in ins]
        if balance is not None:
            out = _plus(out, {"comm": q(attention.swap_comm(values, itemsize, costs.links[balance], train))})
        if ring:
            bwd = out.get("compute_bwd", q(0)).v
            out = _plus(out, {"comm": q(attention.ring_comm(values, itemsize, ring, self.mesh_values, costs.links,
                                                            t.v, bwd, train))})
        return out

    def convert(self, value, src, dst, consumer) -> dict:
        costs, graph = self.costs, self.graph
        meta = graph.meta(value)
        backward = (costs.training and meta.floating and dual_at(costs.graph, consumer)
                    and graph.by_name[value[0]].requires_grad)
        steps, prefetched = costs.conversion(value, src, dst, consumer)
        if not steps:
            return {}
        fwd, bwd = self.steps_times(steps, meta, src, costs.gather_share(value) if prefetched else 1.0,
                                    costs.reduced_itemsize(value, prefetched, steps))
        bwd = bwd if backward else []
        again = sum(fwd, q(0)) if backward and costs.regathered(value) else q(0)
        if prefetched:
            hb = bwd[-1] if bwd else q(0)
            return _plus({"comm": sum(fwd[1:], q(0)) + sum(bwd, q(0)) - hb + again}, self.scheduled(fwd[0], hb))
        return {"comm": sum(fwd, q(0)) + sum(bwd, q(0)) + again}


def _plus(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def formula(plan, dims=None, part: str = "step", nodes=None) -> tuple:
    """(expr, values): the plan's ``part`` (``step``, ``compute``, ``communication``: every
    collective, hidden or not, or ``exposed``) as a sympy expression, and the value of each of
    its symbols in this plan; ``expr.subs(values)`` is the plan's figure. ``nodes``: only the
    costs of these graph nodes (each its own and its inputs' conversions), e.g. one layer's."""
    if part not in PARTS:
        raise ValueError(f"part is one of {PARTS}, got {part!r}")
    source = plan._priced   # planner.make.Priced: (graph, strategies, choice, costs, total)
    if source is None:
        raise ValueError("a formula re-prices the plan from its graph, which a plan read from JSON does not "
                         "hold: call formula on the plan autoshard.plan returned")
    graph, strategies, choice, costs = source[:4]
    if costs.cluster.measured:
        raise ValueError(f"cluster {costs.cluster.name!r} was measured: its fitted kernel and collective rates "
                         "have no formula; plan with a preset or a Cluster of published figures")
    if dims is None:
        dims = default_dims(plan, graph)
    if not isinstance(dims, dict):
        raise TypeError(f"dims maps a size's name to its value, e.g. {{'b': 512, 's': 1024}}; got {dims!r}")
    for k, v in dims.items():
        if not (isinstance(k, str) and k.isidentifier()):
            raise ValueError(f"dims: {k!r} is not a name; use names like 'b', 'seq', 'd_model'")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"dims[{k!r}] is a size, a positive int; got {v!r}")
    pr = _Pricer(plan, graph, costs, dims)
    chosen = {n.name: strategies[n.name][choice[n.name]] for n in graph.nodes}
    total: dict = {}
    if nodes is not None:
        nodes = set(nodes)
        unknown = sorted(nodes - set(graph.by_name))
        if unknown:
            raise ValueError(f"nodes: {unknown} are not nodes of the plan's graph (plan.nodes lists them)")
    for n in graph.nodes:
        if nodes is not None and n.name not in nodes:
            continue
        total = _plus(total, pr.node(n, chosen[n.name]))
        for slot, value in enumerate(n.inputs):
            src, dst = chosen[value[0]].outputs[value[1]], chosen[n.name].inputs[slot]
            total = _plus(total, pr.convert(value, src, dst, n))
            # what the schedule hides of it (cost.overlap), a figure of the whole plan's layouts
            hidden = asdict(edge_price(costs, value, src, dst, n, slot))
            total = _plus(total, {k: Q(sympy.Float(v), v) for k, v in hidden.items() if v})
    zero = q(0)
    cf, cb = total.get("compute_fwd", zero), total.get("compute_bwd", zero)
    hf, hb, blocking = total.get("hidden_fwd", zero), total.get("hidden_bwd", zero), total.get("comm", zero)
    exposed = blocking + larger(zero, hf - cf) + larger(zero, hb - cb) + q(DRAG) * (hf + hb)
    saved = plan.breakdown.get("interleave_saved", 0.0)
    if nodes is None and saved:   # the batch interleaved (cost.interleave), a figure of the whole plan
        exposed = exposed - Q(sympy.Float(saved), saved)
    result = {"compute": cf + cb, "communication": blocking + hf + hb, "exposed": exposed,
              "step": cf + cb + exposed}[part]
    used = result.e.free_symbols
    return result.e, {s: v for s, v in pr.values.items() if s in used}
