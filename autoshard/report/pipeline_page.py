"""A pipeline plan as one self-contained web page (``PipelinePlan.to_html``): no network, no
files beside it, no script.

The page shows the plan's summary, the schedule drawn as each stage's row of forwards and
backwards in time (the slots ``planner.pipeline.simulate`` places them in, given by the
plan, a backward twice
a forward, idle slots left blank: the bubble is the blank), the stages' table, and each stage's
own plan (its summary, folded until opened).
"""
from __future__ import annotations

import html

SLOT = 22        # pixels per time slot
ROW = 26         # pixels per stage
LEFT = 70        # the stage labels' margin
FORWARD, BACKWARD = "#3b7dd8", "#27ae60"
WORK = {"F": "forward", "B": "backward", "I": "input gradients", "W": "weight gradients"}


def schedule_svg(plan, cells: list) -> str:
    """The schedule of ``plan`` as an SVG: a row per stage, a rectangle per forward (F) and
    backward (B) of each microbatch in the slots ``cells`` gives (per stage, {slot: "F3"}),
    labelled with its number."""
    k = len(cells)   # the pipeline axis's ranks (with chunks, each runs several stages)
    who = "stage" if k == len(plan.stages) else "rank"
    end = max((max(c) + 1 for c in cells if c), default=0)
    width, height = LEFT + end * SLOT + 10, k * ROW + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="schedule" width="{width}" height="{height}">']
    for s, row in enumerate(cells):
        y = s * ROW + 4
        parts.append(f'<text x="4" y="{y + 16}">{who} {s}</text>')
        parts.append(f'<rect class="lane" x="{LEFT}" y="{y}" width="{end * SLOT}" height="{ROW - 6}" '
                     'fill="#f2f2f2"/>')
        t = 0
        while t < end:   # a forward or backward spans its consecutive slots: one rectangle
            if t not in row:
                t += 1
                continue
            label, start = row[t], t
            while t < end and row.get(t) == label:
                t += 1
            color = FORWARD if label[0] == "F" else BACKWARD
            parts.append(f'<rect class="work" data-stage="{s}" data-work="{label}" x="{LEFT + start * SLOT + 1}" '
                         f'y="{y}" width="{(t - start) * SLOT - 2}" height="{ROW - 6}" fill="{color}">'
                         f'<title>{who} {s}: {WORK.get(label[0], label[0])} of microbatch {label[1:]}</title></rect>')
            parts.append(f'<text x="{LEFT + start * SLOT + 4}" y="{y + 15}" fill="#fff">{label}</text>')
    parts.append(f'<text x="{LEFT}" y="{height - 4}">time, slot by slot; blank: '
                 f'the bubble, {plan.bubble:.0%} of the step</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def to_html(plan, cells: list, path=None, title: str = "autoshard pipeline plan") -> str:
    """The page's text, the schedule drawn in ``cells``' slots; written to ``path`` too when given."""
    stages = "\n".join(
        f'<details class="stage" id="stage-{s.index}"><summary>stage {s.index}: ranks '
        f'{s.ranks[0]}-{s.ranks[-1]}, {len(s.blocks)} blocks</summary><pre>{html.escape(str(s.plan))}</pre></details>'
        for s in plan.stages)
    text = PAGE.format(title=html.escape(title), summary=html.escape(str(plan)), schedule=schedule_svg(plan, cells),
                       stages=stages, forward=FORWARD, backward=BACKWARD)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 8px; }} h2 {{ font-size: 15px; margin: 18px 0 6px; }}
pre {{ background: #f6f6f6; padding: 8px; margin: 0; white-space: pre; overflow-x: auto; font-size: 12px; }}
svg text {{ font: 11px monospace; }}
.sw {{ display: inline-block; width: 12px; height: 10px; margin: 0 4px 0 12px; vertical-align: middle; }}
details {{ margin: 4px 0; }} summary {{ cursor: pointer; font-family: monospace; }}
</style></head>
<body>
<h1>{title}</h1>
<h2>Schedule</h2>
<div><span class="sw" style="background:{forward}"></span>forward<span class="sw"
 style="background:{backward}"></span>backward (microbatch n)</div>
<div id="timeline">{schedule}</div>
<h2>Plan</h2><pre id="head">{summary}</pre>
<h2>Each stage's plan</h2>
{stages}
</body></html>
"""
