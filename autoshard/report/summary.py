"""A plan at a glance (``str(plan)``) and in full (``plan.table()``).

The summary says where the devices are (each mesh axis within a node or across nodes), what one
step costs and where the time goes (compute, communication the step waits for, communication the
schedule hides behind compute), memory per rank against the budget, how sure the solver is, then
one table of the model in which repeated blocks are folded (``blocks.0-11 x12``: every block laid
out alike) and the largest collectives.
"""
from __future__ import annotations

import math

from autoshard import placement as pl
from autoshard.cost.step import PARTS, Cost

TOP_COLLECTIVES = 8


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def fmt_s(t: float) -> str:
    if t == 0:
        return "0"
    if abs(t) >= 1:
        return f"{t:.2f}s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:.2f}ms"
    return f"{t * 1e6:.1f}us"


def fmt_axes(axes) -> str:
    return "(" + ",".join(map(str, axes)) + ")"


def columns(rows, limit: int = 60) -> list:
    """Rows of strings as left-aligned columns, each cell cut at ``limit`` characters."""
    widths = [min(max(len(r[i]) for r in rows), limit) for i in range(len(rows[0]))]
    return ["  ".join(str(c)[:limit].ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def short_op(op: str) -> str:
    return op.split(".")[0].replace("scaled_dot_product_attention", "sdpa")


# ---- the header ---------------------------------------------------------------------------------

def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("s" if n != 1 else "")


def mesh_lines(plan) -> list:
    """Each mesh axis: its size, whether its groups stay within a node or cross nodes, its link."""
    mesh, cluster = tuple(plan.mesh_shape), plan.cluster
    lines = [f"autoshard plan: {plan.world} devices as mesh {mesh}"
             + (f" on {cluster.name} ({cluster.gpus_per_node} per node, {_plural(math.ceil(plan.world / cluster.gpus_per_node), 'node')})"
                if cluster else "") + f", {'training' if plan.training else 'inference'}"]
    if not cluster:
        return lines
    for a, size in enumerate(mesh):
        stride = math.prod(mesh[a + 1:])
        inside = stride * size <= cluster.gpus_per_node
        latency, bandwidth, _ = cluster.group_link(mesh, (a,))
        where = ("within a node" if inside else
                 f"across {_plural(min(size, math.ceil(stride * size / cluster.gpus_per_node)), 'node')}")
        lines.append(f"  axis {a}: {size} devices {stride} apart, {where}: "
                     f"{bandwidth / 1e9:.1f} GB/s per device, {latency * 1e6:.0f}us per ring step")
    return lines


def step_lines(plan) -> list:
    commt = sum(c.seconds for c in plan.collectives)
    if plan.breakdown:
        b = Cost(**{k: plan.breakdown[k] for k in PARTS})
        hidden_all = b.hidden_fwd + b.hidden_bwd
        overflow = max(0.0, b.hidden_fwd - b.compute_fwd) + max(0.0, b.hidden_bwd - b.compute_bwd)
        compute, exposed, hidden, optimizer = b.compute, b.exposed, hidden_all - overflow, b.optimizer
        fwd_bwd = f" (forward {fmt_s(b.compute_fwd)}, backward {fmt_s(b.compute_bwd)})" if plan.training else ""
    else:
        compute = sum(n.compute for n in plan.nodes.values())
        exposed, hidden, optimizer, fwd_bwd = commt, 0.0, 0.0, ""
    lines = [f"step {fmt_s(plan.cost)} (estimated, per step) = compute {fmt_s(compute)}{fwd_bwd}"
             f" + exposed communication {fmt_s(exposed)}" + (f" + optimizer {fmt_s(optimizer)}" if optimizer else "")]
    buckets = fmt_bytes(plan.schedule.get("bucket_bytes", 0))
    lines.append(f"  communication {fmt_s(commt)} in all; hidden communication {fmt_s(hidden)} is overlapped with "
                 f"compute by the schedule (gradient buckets of {buckets}, prefetched parameter gathers, "
                 f"activations' collectives started early and waited on late)"
                 + ("; converted parameters are freed after forward and converted again for backward"
                    if plan.schedule.get("reshard_after_forward") else ""))
    lines += chunk_lines(plan)
    per_axis: dict = {}
    for c in plan.collectives:
        for a in c.axes:   # a collective over several axes at once: an equal share to each
            per_axis[a] = per_axis.get(a, 0.0) + c.seconds / len(c.axes)
    if per_axis:
        lines.append("  communication per axis: " + ", ".join(f"axis {a} {fmt_s(t)}" for a, t in sorted(per_axis.items())))
    return lines


def chunk_lines(plan, shown: int = 4) -> list:
    """Which conversions the schedule overdecomposes, and into how many chunks (``cost.overlap``)."""
    chunks = plan.schedule.get("chunks") or []
    saved = plan.breakdown.get("activations_hidden", 0.0)
    hides = f"activation collectives started early hide {fmt_s(saved)} of the step" if saved > 0 else ""
    cuts = plan.schedule.get("interleave", 1)
    batch = ([f"  the batch cut into {cuts} interleaved chunks, each chunk's activation collectives beside the "
              f"next chunk's compute: about {fmt_s(plan.breakdown.get('interleave_saved', 0.0))} less a step "
              "(taken off the estimated step)"] if cuts > 1 else [])
    if not chunks:
        return ([f"  {hides}"] if hides else []) + batch
    by_k: dict = {}
    for producer, consumer, k, _ in chunks:
        by_k.setdefault(k, []).append(f"{producer} -> {consumer}")
    parts = [f"{_plural(len(names), 'conversion')} into {k} chunks ({', '.join(names[:shown])}"
             + (f", ... {len(names) - shown} more" if len(names) > shown else "") + ")"
             for k, names in sorted(by_k.items())]
    return ["  overdecomposed, each chunk's collective overlapping the next chunk's matmul: " + "; ".join(parts)
            + (f"; with them, {hides}" if hides else "")] + batch


def memory_line(plan) -> list:
    m = plan.memory
    if not m:
        return []
    budget = m.get("budget")
    head = f"memory per rank {fmt_bytes(m['total'])}" + (
        f" of a {fmt_bytes(budget)} budget ({100 * m['total'] / budget:.0f}%)" if budget else "")
    return [head + ": " + ", ".join(f"{k} {fmt_bytes(m[k])}" for k in ("parameters", "gradients", "optimizer", "activations"))]


def arrival_lines(plan) -> list:
    """Where each rank brings its own rows (``inputs="local"``): the layout they arrive in, and
    what converting them to the plan's layouts costs."""
    if not plan.arrival:
        return []
    colls = [c for c in plan.collectives if c.node in plan.arrival]
    layouts = sorted({pl.format_nd(tuple(pl.parse(p) for p in v)) for v in plan.arrival.values()})
    cost = (f"converting them costs {fmt_s(sum(c.seconds for c in colls))}: "
            + ", ".join(f"{c.kind}{fmt_axes(c.axes)} {fmt_bytes(c.bytes)} at {c.node}" for c in colls)) if colls \
        else "they are used as they arrive, no input byte moved"
    return [f"inputs: each rank's own rows (inputs=\"local\"), arriving {', '.join(layouts)}; {cost}"]


def recompute_lines(plan) -> list:
    """Which blocks run their forward again in backward, and what it costs and saves."""
    r = plan.recompute
    if not r or not r.get("blocks"):
        return []
    units: dict = {}
    for b in r["blocks"]:
        unit, i, _ = _unit(b)
        units.setdefault(unit, []).append(i)
    where = ", ".join(f"{u}.{_indices(sorted(idx))}" for u, idx in units.items())
    kept = ("keep their matmuls' and attention's outputs and run their other ops again in backward" if r.get("selective")
            else "keep only their inputs and run their forward again in backward")
    return [f"recompute: {len(r['blocks'])} of {r['of']} blocks ({where}) {kept}: + compute {fmt_s(r['compute'])}, + communication {fmt_s(r['communication'])} "
            f"per step; activations {fmt_bytes(r['freed'])} not kept, {fmt_bytes(r['peak'])} back while one block's "
            f"backward runs"]


def solver_lines(plan) -> list:
    lines = []
    s = plan.solver
    if s:
        gap = s.get("gap")
        lines.append(f"solver: {s.get('status')} in {s.get('seconds', 0):.2f} s, "
                     + (f"optimality gap {100 * gap:.2f}%" if gap is not None else
                        "a local optimum of one-axis descent (no bound on this mesh)"))
    if plan.mesh_candidates:
        ranked = [c for c in plan.mesh_candidates if c.get("cost") is not None]
        lines.append(f"mesh search: {len(plan.mesh_candidates)} shapes, {len(ranked)} solved, best first: "
                     + ", ".join(f"{tuple(c['mesh'])} {fmt_s(c['cost'])}" for c in ranked[:4]))
    return lines


# ---- the folded table ---------------------------------------------------------------------------

def _unit(path: str):
    """A module path as (unit, block index, the rest): ``blocks.3.attn.qkv`` -> ("blocks", 3,
    "attn.qkv"); ``head`` -> ("head", None, "")."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and i > 0:
            return ".".join(parts[:i]), int(p), ".".join(parts[i + 1:])
    return path, None, ""


def _indices(idx: list) -> str:
    """[0..11] -> "0-11"; [0, 2, .., 10] -> "0,2,..,10"; else a comma list."""
    if len(idx) == 1:
        return str(idx[0])
    steps = {b - a for a, b in zip(idx, idx[1:])}
    if steps == {1}:
        return f"{idx[0]}-{idx[-1]}"
    if len(steps) == 1 and len(idx) > 3:
        return f"{idx[0]},{idx[1]},..,{idx[-1]}"
    return ",".join(map(str, idx))


def node_modules(plan) -> dict:
    """node name -> (unit, block index or None, sub-module path): where each node sits."""
    out = {}
    for n in plan.nodes.values():
        if n.kind == "param" and n.fqn:
            path = n.fqn.rsplit(".", 1)[0] if "." in n.fqn else ""
        elif n.kind == "op":
            path = n.module or ""
        else:
            path = f"({n.kind}s)"
        out[n.name] = _unit(path) if path else ("(model)", None, "")
    return out


_PHASE = {"forward": "fwd", "backward": "bwd"}


def _row(plan, names, colls_at) -> tuple:
    """(ops, params, output, compute, comm, collectives) of a set of nodes, as strings."""
    nodes = [plan.nodes[k] for k in names]
    ops: dict = {}   # op -> [count, compute]: the costliest first
    for n in nodes:
        if n.kind == "op":
            o = ops.setdefault(short_op(n.op), [0, 0.0])
            o[0] += 1
            o[1] += n.compute
    ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])
    op_text = ", ".join(f"{k} x{c}" if c > 1 else k for k, (c, _) in ranked[:3]) + (" .." if len(ops) > 3 else "")
    params = [n for n in nodes if n.kind == "param"]
    places = {}
    for n in params:
        places.setdefault("(" + ", ".join(n.outputs[0]) + ")", []).append(n.fqn.rsplit(".", 1)[-1])
    param_text = "; ".join(f"{','.join(v)} {k}" for k, v in places.items())
    outs = [n for n in nodes if n.kind in ("op", "input") and n.outputs]
    out_text = ("(" + ", ".join(outs[-1].outputs[0]) + ")") if outs else "-"
    kinds: dict = {}
    for k in names:
        for c in colls_at.get(k, []):
            key = f"{c.kind} {_PHASE[c.phase]}"
            kinds[key] = kinds.get(key, 0) + 1
    coll_text = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in kinds.items())
    return (op_text or "-", param_text or "-", out_text, fmt_s(sum(n.compute for n in nodes)),
            fmt_s(sum(n.comm for n in nodes)), coll_text or "-")


def folded(plan) -> tuple:
    """The table rows (header first), and node name -> the folded name of its row."""
    where = node_modules(plan)
    colls_at: dict = {}
    for c in plan.collectives:
        colls_at.setdefault(c.node, []).append(c)
    units: dict = {}   # unit -> index -> sub -> [node names], in the order the ops run
    order = [n for n in plan.nodes.values() if n.kind == "input"] + [n for n in plan.nodes.values() if n.kind == "op"]
    order += [n for n in plan.nodes.values() if n.kind not in ("input", "op", "output")]
    for n in sorted(order, key=lambda n: where[n.name][0] == "(model)"):
        unit, idx, sub = where[n.name]
        units.setdefault(unit, {}).setdefault(idx, {}).setdefault(sub, []).append(n.name)
    rows = [("module", "ops", "parameters", "output", "compute", "comm", "collectives")]
    label: dict = {}
    for unit, by_index in units.items():
        if list(by_index) == [None]:
            for sub, names in by_index[None].items():
                text = unit + ("." + sub if sub else "")
                row = _row(plan, names, colls_at)
                if row == ("-", "-", "-", "0", "0", "-"):   # nothing to read: buffers no op uses, say
                    continue
                rows.append((text,) + row)
                label.update(dict.fromkeys(names, text))
            continue
        groups: dict = {}   # blocks laid out alike, in order of first appearance
        for idx, subs in by_index.items():
            sig = tuple((sub, _row(plan, names, colls_at)) for sub, names in subs.items())
            groups.setdefault(sig, []).append(idx)
        for sig, idx in groups.items():
            head = f"{unit}.{_indices(idx)}" + (f" x{len(idx)}" if len(idx) > 1 else "")
            one = [k for names in by_index[idx[0]].values() for k in names]
            total = _row(plan, one, colls_at)
            rows.append((head, "per block:", "", "", total[3], total[4], total[5]))
            for sub, r in sig:
                rows.append(("  " + (sub or "(own ops)"),) + r)
                for i in idx:
                    label.update(dict.fromkeys(by_index[i][sub], f"{unit}.{_indices(idx)}" + (f".{sub}" if sub else "")))
    return rows, label


def _at(plan, where: str, node: str) -> str:
    """Where a collective runs: a parameter's folded name, or the row's and the node's."""
    n = plan.nodes.get(node)
    if n is not None and n.kind == "param" and n.fqn:
        return f"{where}.{n.fqn.rsplit('.', 1)[-1]}"
    return f"{where} ({node})" if where != node else node


def collective_lines(plan, label: dict) -> list:
    """The largest collectives, those that repeat in folded blocks counted once with their count."""
    if not plan.collectives:
        return ["collectives: none"]
    groups: dict = {}
    for c in plan.collectives:
        key = (c.kind, c.phase, tuple(c.axes), c.bytes, c.overlapped, label.get(c.node, c.node))
        g = groups.setdefault(key, [0, 0.0, c.node])
        g[0] += 1
        g[1] += c.seconds
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:TOP_COLLECTIVES]
    rows = [("collective", "phase", "axes", "bytes", "count", "seconds", "", "at")]
    for (kind, phase, axes, nbytes, over, where), (count, secs, node) in top:
        rows.append((kind, phase, fmt_axes(axes), fmt_bytes(nbytes), f"x{count}", fmt_s(secs),
                     "hidden" if over else "exposed", _at(plan, where, node)))
    kinds: dict = {}
    for c in plan.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return ([f"largest collectives, of {len(plan.collectives)} "
             f"({', '.join(f'{k} x{v}' for k, v in sorted(kinds.items()))}):"] + ["  " + r for r in columns(rows)])


def uneven_lines(plan, shown: int = 4) -> list:
    """The tensors split unevenly (a dim that does not divide by its axes), with the chunk each
    rank holds, DTensor's layout; compute, memory and collectives are priced by the largest."""
    mesh = tuple(plan.mesh_shape)
    groups: dict = {}
    for n in plan.nodes.values():
        for shape, out in zip(n.shapes, n.outputs):
            cuts = pl.uneven_splits(tuple(shape), tuple(map(pl.parse, out)), mesh)
            if cuts:
                groups.setdefault((tuple(shape), tuple(out), tuple(cuts.items())), []).append(n.name)
    if not groups:
        return []
    rows = []
    for (shape, out, cuts), names in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:shown]:
        dims = "; ".join(f"dim {d} sizes {','.join(map(str, s))}" for d, s in cuts)
        rows.append(("x".join(map(str, shape)), "(" + ", ".join(out) + ")", dims,
                     names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")))
    return ["", f"uneven splits ({_plural(sum(map(len, groups.values())), 'tensor')}; chunks as DTensor cuts "
                "them, priced by the largest):"] + ["  " + r for r in columns(rows)]


def summary(plan) -> str:
    rows, label = folded(plan)
    lines = (mesh_lines(plan) + step_lines(plan) + memory_line(plan) + arrival_lines(plan) + recompute_lines(plan)
             + solver_lines(plan)
             + [""] + columns(rows) + [""] + collective_lines(plan, label) + uneven_lines(plan)
             + ["", "plan.table(): every node; plan.explain(name): why a tensor is laid out as it is"])
    return "\n".join(lines)


# ---- the full table -----------------------------------------------------------------------------

def table(plan) -> str:
    """One row per graph node: shape, placement, collectives, compute and communication."""
    by_node: dict = {}
    for c in plan.collectives:
        by_node.setdefault(c.node, []).append(c)
    rows = [("node", "op", "shape", "placement", "collectives", "compute", "comm")]
    for n in plan.nodes.values():
        if n.kind == "output":
            continue
        colls = "; ".join(f"{c.kind}{fmt_axes(c.axes)} {c.phase[:3]} {fmt_bytes(c.bytes)}" for c in by_node.get(n.name, []))
        shape = "x".join(map(str, n.shapes[0])) if n.shapes else "-"
        place = pl.format_nd(n.out_placements()[0]) if n.outputs else "-"
        rows.append((n.name, n.op, shape, place, colls or "-", fmt_s(n.compute), fmt_s(n.comm)))
    out_colls = by_node.get("output", [])
    if out_colls:
        rows.append(("output", "output", "-", "B", "; ".join(f"{c.kind}{fmt_axes(c.axes)} fwd {fmt_bytes(c.bytes)}" for c in out_colls),
                     "-", fmt_s(sum(c.seconds for c in out_colls))))
    return "\n".join(columns(rows))
