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

What crosses between a pipeline's stages arrives so too, in its *crossing* layout
(``crossing_layout``): each rank of stage ``s`` sends its own share to the rank at the same
coordinates of stage ``s + 1``, the fewest bytes over the pipeline's slow links, and each stage's
plan prices converting to and from it on its own axes' links (``arrival``; ``outputs.SENT``).
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


def crossing_layout(shape, mesh_shape) -> tuple:
    """The layout a tensor of ``shape`` crosses between pipeline stages in, on the mesh of a
    stage's axes: each axis splits the first dim whose share so far it divides evenly (the rows
    first: data parallel's layout, and a stage's rows split as far as they go), else, where none
    does, holds it whole. With sequences of rows that do not split over the tensor-parallel axis
    (Megatron-LM's microbatch of one sequence per data-parallel rank) that axis splits the
    sequence: sequence parallelism's layout, a ``1/t`` share each. Chosen by shape alone, so the
    stages on either side agree on it without planning together, and each rank's share is the
    same size: a point-to-point send of one shape."""
    shape, out = list(shape), []
    for n in mesh_shape:
        dim = next((d for d, size in enumerate(shape) if n > 1 and size % n == 0), None)
        if dim is None:
            out.append(pl.B)
            continue
        shape[dim] //= n
        out.append(pl.Split(dim))
    return tuple(out)


def arrival(graph, mesh_shape, inputs: str) -> dict:
    """{user input node: the layout it arrives in} of the inputs that arrive split (``inputs=
    "local"``): every tensor input of one dim or more whose dim 0 gives each rank some rows; and,
    whatever ``inputs`` is, those a pipeline stage takes from the stage before
    (``Graph.received``), each in its ``crossing_layout``."""
    out = {}
    for name in graph.user_inputs[:graph.received]:
        node = graph.by_name[name]
        out[name] = crossing_layout(node.outputs[0].shape, mesh_shape)
    if inputs != LOCAL:
        return out
    layout = arrival_layout(len(mesh_shape))
    for name in graph.user_inputs[graph.received:]:
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
