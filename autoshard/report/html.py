"""A plan as one self-contained web page (``Plan.to_html``): no network, no files beside it.

The page shows the summary's header (mesh, step, memory, solver), the mesh laid onto the
cluster's nodes, a timeline of one training step of one rank (every rank runs the same program,
so one stands for all), memory per rank as bars against the budget, the table of the model with
repeated blocks folded, and, for any tensor clicked (in the table, the timeline or the list of
every node), ``plan.explain``.

The timeline is drawn from the plan's own figures, in the order the program runs: the forward's
ops in graph order, then the backward's in reverse, each op's compute split between the two in
the ratio of the plan's totals. A collective that compute waits for (exposed) sits on its axis's
lane and holds the compute lane until it ends; one the schedule overlaps (hidden: gradient
buckets, prefetched parameter gathers) starts when its input is ready (a gradient when its op's
backward ends; a forward gather at the step's start) and runs beside the compute, one at a time
per lane. Collectives over several axes at once have a lane of their own.
"""
from __future__ import annotations

import html
import json

from autoshard.report import summary


def page_data(plan) -> dict:
    """What the page's script draws, as JSON."""
    b = plan.breakdown or {}
    total_compute = sum(n.compute for n in plan.nodes.values())
    fwd_share = (b.get("compute_fwd", total_compute) / total_compute) if total_compute else 1.0
    rows, label = summary.folded(plan)
    nodes = []
    for n in plan.nodes.values():
        if n.kind == "output":
            continue
        nodes.append({"name": n.name, "kind": n.kind, "op": n.op, "fqn": n.fqn, "module": n.module,
                      "shape": list(n.shapes[0]) if n.shapes else [], "placement": list(n.outputs[0]) if n.outputs else [],
                      "fwd": n.compute * fwd_share, "bwd": n.compute * (1 - fwd_share), "row": label.get(n.name, n.name)})
    colls = [{"kind": c.kind, "phase": c.phase, "axes": list(c.axes), "bytes": c.bytes, "node": c.node,
              "seconds": c.seconds, "hidden": c.overlapped} for c in plan.collectives]
    explained = {}
    for n in plan.nodes.values():
        if n.kind != "output":
            try:
                explained[n.name] = plan.explain(n.fqn if n.kind == "param" and n.fqn else n.name)
            except Exception as e:  # noqa: BLE001 - a page without one explanation is still a page
                explained[n.name] = f"(no explanation: {type(e).__name__}: {e})"
    cluster = plan.cluster
    return {
        "mesh": list(plan.mesh_shape), "world": plan.world, "cost": plan.cost, "training": plan.training,
        "gpus_per_node": cluster.gpus_per_node if cluster else plan.world,
        "header": summary.mesh_lines(plan) + summary.step_lines(plan) + summary.memory_line(plan)
        + summary.solver_lines(plan),
        "memory": plan.memory, "breakdown": b, "nodes": nodes, "collectives": colls,
        "table": [list(r) for r in rows], "row_node": _row_nodes(rows, label), "explain": explained,
    }


def _row_nodes(rows: list, label: dict) -> list:
    """Per row of the folded table, the first node it stands for (None for the header)."""
    by_label: dict = {}
    for node, name in label.items():
        by_label.setdefault(name, node)
    out, head = [None], None
    for row in rows[1:]:
        cell = row[0]
        if cell.startswith("  "):   # a module inside the folded blocks above
            sub = cell.strip()
            out.append(by_label.get(head if sub == "(own ops)" else f"{head}.{sub}"))
        else:
            head = cell.split(" x")[0]
            out.append(by_label.get(head) or next((n for k, n in by_label.items() if k.startswith(head + ".")), None))
    return out


def to_html(plan, path=None, title: str = "autoshard plan") -> str:
    """The page's text; written to ``path`` too when given."""
    data = json.dumps(page_data(plan)).replace("</", "<\\/")   # no "</script>" inside the script
    text = PAGE.replace("{{TITLE}}", html.escape(title)).replace("{{DATA}}", data)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{TITLE}}</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 18px 0 6px; }
pre { background: #f6f6f6; padding: 8px; margin: 0; white-space: pre-wrap; }
#head { font-family: monospace; white-space: pre; background: #f6f6f6; padding: 8px; overflow-x: auto; }
.grid { display: grid; grid-template-columns: 1010px minmax(380px, 1fr); gap: 16px; align-items: start; }
table { border-collapse: collapse; font-family: monospace; font-size: 12px; }
td, th { padding: 1px 8px; text-align: left; border-bottom: 1px solid #eee; white-space: nowrap; }
tr.click:hover { background: #eef4ff; cursor: pointer; }
#explain { position: sticky; top: 8px; }
#explain pre { max-height: 90vh; overflow: auto; font-size: 12px; white-space: pre; }
.legend span { display: inline-block; margin-right: 12px; }
.sw { display: inline-block; width: 12px; height: 10px; margin-right: 4px; vertical-align: middle; }
svg text { font: 11px monospace; }
#filter { width: 240px; }
#nodes { max-height: 300px; overflow: auto; display: block; }
</style></head>
<body>
<h1>{{TITLE}}</h1>
<div id="head"></div>
<div class="grid">
 <div>
  <h2>Mesh on the cluster's nodes</h2><div id="mesh"></div>
  <h2>One step of one rank</h2><div class="legend" id="legend"></div><div id="timeline"></div>
  <h2>Memory per rank</h2><div id="memory"></div>
  <h2>The model, repeated blocks folded</h2><table id="table"></table>
  <h2>Every tensor</h2><input id="filter" placeholder="filter by name"><table id="nodes"></table>
 </div>
 <div id="explain"><h2>Explain</h2><pre id="why">Click a row, a tensor or a bar of the timeline.</pre></div>
</div>
<script id="plan-data" type="application/json">{{DATA}}</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("plan-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const KIND = {all_reduce: "#d9534f", all_gather: "#3b7dd8", reduce_scatter: "#8e44ad", all_to_all: "#e67e22", send: "#16a085"};
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(t) {
  if (t === 0) return "0";
  if (t >= 1) return t.toFixed(2) + " s";
  if (t >= 1e-3) return (t * 1e3).toFixed(2) + " ms";
  return (t * 1e6).toFixed(1) + " us";
}
function bytes(n) {
  const u = ["B", "KB", "MB", "GB"]; let i = 0;
  while (n >= 1024 && i < 3) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + u[i];
}
function explain(name) {
  const text = D.explain[name];
  document.getElementById("why").textContent = text === undefined ? name + ": not a node of this plan" : text;
}
document.getElementById("head").textContent = D.header.join("\n");

// the mesh: ranks in their nodes; a click on an axis marks rank 0's group on it
(function mesh() {
  const box = document.getElementById("mesh");
  const world = D.world, gpn = Math.min(D.gpus_per_node, world), nodes = Math.ceil(world / gpn);
  const strides = D.mesh.map((_, a) => D.mesh.slice(a + 1).reduce((x, y) => x * y, 1));
  const cell = 9, perRow = Math.max(1, Math.min(nodes, Math.floor(990 / (gpn * cell + 8)))), w = perRow * (gpn * cell + 8) + 8;
  const h = Math.ceil(nodes / perRow) * (cell + 12) + 8;
  const svg = el("svg", {width: w, height: h}, box);
  const rects = [];
  for (let r = 0; r < world; r++) {
    const node = Math.floor(r / gpn), slot = r % gpn;
    const x = 8 + (node % perRow) * (gpn * cell + 8) + slot * cell, y = 8 + Math.floor(node / perRow) * (cell + 12);
    if (slot === 0) el("rect", {x: x - 2, y: y - 2, width: gpn * cell + 3, height: cell + 3, fill: "none", stroke: "#999"}, svg);
    rects.push(el("rect", {x: x, y: y, width: cell - 1, height: cell - 1, fill: "#ccc"}, svg));
  }
  const list = document.createElement("div");
  D.mesh.forEach((size, a) => {
    const b = document.createElement("button");
    b.textContent = "axis " + a + " (" + size + ")";
    b.onclick = () => rects.forEach((rc, r) => {
      const inGroup = D.mesh.every((_, o) => o === a || Math.floor(r / strides[o]) % D.mesh[o] === 0);
      rc.setAttribute("fill", inGroup ? "#3b7dd8" : "#ccc");
    });
    list.appendChild(b);
  });
  box.appendChild(list);
})();

// the timeline
(function timeline() {
  const lanes = ["compute"], laneOf = {};
  const laneName = axes => "axis " + axes.join("+");
  D.collectives.forEach(c => { const n = laneName(c.axes); if (!(n in laneOf)) { laneOf[n] = lanes.length; lanes.push(n); } });
  const at = {};
  D.collectives.forEach(c => (at[c.node] = at[c.node] || []).push(c));
  const bars = [], free = lanes.map(() => 0);
  let t = 0;
  function hidden(c, ready) {
    const l = laneOf[laneName(c.axes)], s = Math.max(free[l], ready);
    bars.push({lane: l, s: s, e: s + c.seconds, c: c, node: c.node}); free[l] = s + c.seconds;
  }
  function exposed(c) {
    const l = laneOf[laneName(c.axes)], s = Math.max(free[l], t);
    bars.push({lane: l, s: s, e: s + c.seconds, c: c, node: c.node}); free[l] = s + c.seconds; t = s + c.seconds;
  }
  D.nodes.forEach(n => (at[n.name] || []).forEach(c => { if (c.phase === "forward" && c.hidden) hidden(c, 0); }));
  D.nodes.forEach(n => {
    (at[n.name] || []).forEach(c => { if (c.phase === "forward" && !c.hidden) exposed(c); });
    if (n.fwd > 0) { bars.push({lane: 0, s: t, e: t + n.fwd, node: n.name, fwd: true}); t += n.fwd; }
  });
  (at["output"] || []).forEach(c => exposed(c));
  const fwdEnd = t, ready = {}, later = [];
  const owner = n => n.kind === "param" && n.fqn ? n.fqn.split(".").slice(0, -1).join(".") : n.module;
  [...D.nodes].reverse().forEach(n => {
    (at[n.name] || []).forEach(c => { if (c.phase === "backward" && !c.hidden) exposed(c); });
    if (n.bwd > 0) { bars.push({lane: 0, s: t, e: t + n.bwd, node: n.name}); t += n.bwd; }
    if (n.kind === "op" && n.module !== null) ready[n.module] = t;   // its module's gradients are made
    (at[n.name] || []).forEach(c => { if (c.phase === "backward" && c.hidden) later.push([n, c, t]); });
  });
  // a parameter's gradient is ready when the backward of its module's ops is done
  later.map(([n, c, done]) => [n.kind === "param" && owner(n) in ready ? ready[owner(n)] : done, c])
       .sort((a, b) => a[0] - b[0]).forEach(([when, c]) => hidden(c, when));
  const end = Math.max(t, ...free), W = 900, left = 90, rowH = 22;
  const svg = el("svg", {width: W + left + 10, height: lanes.length * rowH + 30}, document.getElementById("timeline"));
  const x = s => left + (end > 0 ? s / end * W : 0);
  lanes.forEach((name, i) => {
    el("text", {x: 2, y: i * rowH + 15}, svg).textContent = name;
    el("line", {x1: left, x2: left + W, y1: i * rowH + rowH - 1, y2: i * rowH + rowH - 1, stroke: "#eee"}, svg);
  });
  el("line", {x1: x(fwdEnd), x2: x(fwdEnd), y1: 0, y2: lanes.length * rowH, stroke: "#888", "stroke-dasharray": "3,3"}, svg);
  el("text", {x: x(fwdEnd) + 3, y: lanes.length * rowH + 12}, svg).textContent = "backward";
  el("text", {x: left, y: lanes.length * rowH + 12}, svg).textContent = "forward";
  el("text", {x: left, y: lanes.length * rowH + 26}, svg).textContent = "one step as drawn: " + fmt(end)
    + "; the cost model's estimate: " + fmt(D.cost) + " (it also charges hidden communication a small drag)";
  bars.forEach(b => {
    const color = b.c ? KIND[b.c.kind] || "#555" : (b.fwd ? "#5cb85c" : "#3d8b3d");
    const r = el("rect", {x: x(b.s), y: b.lane * rowH + 3, width: Math.max(1, x(b.e) - x(b.s)), height: rowH - 8,
                          fill: color, "fill-opacity": b.c && b.c.hidden ? 0.35 : 1, stroke: b.c && b.c.hidden ? color : "none"}, svg);
    const tip = el("title", {}, r);
    tip.textContent = b.c ? b.c.kind + " " + b.c.phase + " " + bytes(b.c.bytes) + " " + fmt(b.c.seconds)
      + (b.c.hidden ? " hidden" : " exposed") + " at " + b.node : b.node + " " + (b.fwd ? "forward " : "backward ") + fmt(b.e - b.s);
    r.addEventListener("click", () => explain(b.node));
    r.setAttribute("class", "bar");
  });
  const legend = document.getElementById("legend");
  legend.innerHTML = '<span><i class="sw" style="background:#5cb85c"></i>forward compute</span>'
    + '<span><i class="sw" style="background:#3d8b3d"></i>backward compute</span>'
    + Object.keys(KIND).map(k => '<span><i class="sw" style="background:' + KIND[k] + '"></i>' + k + '</span>').join("")
    + '<span><i class="sw" style="background:#3b7dd8;opacity:.35"></i>pale: hidden behind compute</span>';
})();

// memory per rank against the budget
(function memory() {
  const m = D.memory, box = document.getElementById("memory");
  if (!m || !m.total) { box.textContent = "no memory figures"; return; }
  const parts = ["parameters", "gradients", "optimizer", "activations"], colors = ["#3b7dd8", "#8e44ad", "#e67e22", "#5cb85c"];
  const W = 800, svg = el("svg", {width: W + 200, height: 74}, box);
  function bar(y, full, label) {   // the parts, scaled to full
    let x = 0;
    parts.forEach((p, i) => {
      const w = m[p] / full * W;
      const r = el("rect", {x: x, y: y, width: Math.max(0, w), height: 16, fill: colors[i]}, svg);
      el("title", {}, r).textContent = p + " " + bytes(m[p]);
      x += w;
    });
    el("rect", {x: 0, y: y, width: W, height: 16, fill: "none", stroke: "#999"}, svg);
    el("text", {x: W + 6, y: y + 12}, svg).textContent = label;
  }
  bar(2, m.total, "the parts of " + bytes(m.total));
  if (m.budget) bar(24, Math.max(m.budget, m.total), "against the budget, " + (100 * m.total / m.budget).toFixed(1) + "%");
  el("text", {x: 0, y: 60}, svg).textContent = "every rank: " + parts.map((p, i) => p + " " + bytes(m[p])).join(", ")
    + ", total " + bytes(m.total) + (m.budget ? " of " + bytes(m.budget) : "");
})();

// the folded table, and every node
(function tables() {
  const t = document.getElementById("table");
  D.table.forEach((row, i) => {
    const tr = document.createElement("tr");
    row.forEach(cell => { const td = document.createElement(i ? "td" : "th"); td.textContent = cell; tr.appendChild(td); });
    const first = D.row_node[i];
    if (first) { tr.className = "click"; tr.onclick = () => explain(first); }
    t.appendChild(tr);
  });
  const list = document.getElementById("nodes");
  function fill(filter) {
    list.innerHTML = "";
    D.nodes.filter(n => !filter || (n.name + " " + (n.fqn || "") + " " + (n.module || "")).includes(filter)).forEach(n => {
      const tr = document.createElement("tr");
      tr.className = "click";
      [n.fqn || n.name, n.op, n.shape.join("x"), "(" + n.placement.join(", ") + ")"].forEach(c => {
        const td = document.createElement("td"); td.textContent = c; tr.appendChild(td);
      });
      tr.onclick = () => explain(n.name);
      list.appendChild(tr);
    });
  }
  document.getElementById("filter").addEventListener("input", e => fill(e.target.value));
  fill("");
})();
</script></body></html>
"""
