"""How a parallel module's user inputs arrive: every rank passes the same whole batch
(``inputs="whole"``, the default), or each rank its own rows (``inputs="local"``, as with DDP and a
DistributedSampler), the global batch being the ranks' rows concatenated in rank order along dim 0.

Rank r's rows are chunk r of the global batch: on a mesh of axes (a, b), rank (i, j) = i*b + j
holds chunk i*b + j, which is the layout ``S(0)`` on every axis (DTensor's nested chunks, outermost
axis first, as ``placement.rank_shape`` cuts them). That is the input's *arrival* layout; the plan
prices each input's conversion from it to the layout its strategy gives it (``cost.price``),
as it prices any other conversion, so a data-parallel layout takes the rows as they came and a
layout that needs the batch whole on an axis pays that axis's gather, and the solver chooses with
it. The plan records the arrival (``Plan.arrival``); the rewriter feeds each rank's rows to the
program and emits that conversion (``passes.rewrite``).

An input arrives split only where every rank holds some rows of it; one whose dim 0 is shorter
than the world arrives whole (gathered before the program, unpriced), as every input did before.
The option and the layouts it gives stand here, under the cost model and the rewriter, as
``outputs.py`` does for the outputs.
"""
from __future__ import annotations

from autoshard import placement as pl

WHOLE, LOCAL = "whole", "local"
MODES = (WHOLE, LOCAL)


def check_inputs(inputs) -> str:
    if not isinstance(inputs, str) or inputs not in MODES:
        raise ValueError(f"inputs is \"whole\" (every rank passes the whole batch) or \"local\" (each rank its "
                         f"own, concatenated in rank order), got {inputs!r}")
    return inputs


def arrival_layout(naxes: int) -> tuple:
    """Rank r's rows of the global batch, in SBP: ``S(0)`` on every axis."""
    return (pl.Split(0),) * naxes


def arrival(graph, mesh_shape, inputs: str) -> dict:
    """{user input node: the layout it arrives in} of the inputs that arrive split (``inputs=
    "local"``): every tensor input of one dim or more whose dim 0 gives each rank some rows."""
    if inputs != LOCAL:
        return {}
    layout = arrival_layout(len(mesh_shape))
    out = {}
    for name in graph.user_inputs:
        node = graph.by_name[name]
        if node.outputs and node.outputs[0].shape and pl.local_shape(node.outputs[0].shape, layout, mesh_shape):
            out[name] = layout
    return out


def chunk_counts(n: int, mesh_shape) -> list:
    """The rows of a dim of ``n`` each rank holds in the arrival layout, by rank."""
    out = [n]
    for p in mesh_shape:
        out = [c for m in out for c in pl.chunk_sizes(m, p)]
    return out


def rows_of(n: int, mesh_shape, coords) -> tuple:
    """(first, count): the rows of a dim of ``n`` the rank at ``coords`` holds in the arrival
    layout (nested chunks, outermost axis first, as ``placement.chunk_sizes`` cuts each)."""
    first = 0
    for p, c in zip(mesh_shape, coords):
        sizes = pl.chunk_sizes(n, p)
        first += sum(sizes[:c])
        n = sizes[c]
    return first, n
