"""What a parallel module hands back: every output whole on every rank (``outputs="whole"``, the
default), or each user output as a DTensor in the layout the plan gave it (``outputs="dtensor"``,
made by ``autoshard.runtime.outputs``).

Whole outputs cost a conversion to broadcast on every axis, which the plan prices: the logits of a
large vocabulary gathered onto every rank can take more of the step than the model's layers. A
user who computes the loss outside the model keeps them split instead (``loss_parallel`` takes
logits split over the vocabulary), and the plan prices no conversion for them.

A pipeline's stage hands its outputs to the next stage (``SENT``, set by the pipeline, never by a
user): each converted to its crossing layout (``inputs.crossing_layout``), each rank's share sent
as it is, and their gradients come back in that layout, the conversion's dual run in backward.

The option and the values it keeps split stand here, under the cost model that prices them and
the rewriter that lowers them (as ``precision.py`` does for a precision policy).
"""
from __future__ import annotations

from autoshard.inputs import crossing_layout
from autoshard.placement import B

WHOLE, DTENSOR = "whole", "dtensor"
MODES = (WHOLE, DTENSOR)
SENT = "sent"   # a pipeline stage's outputs, handed on in their crossing layouts


def output_layouts(graph, mesh_shape) -> list:
    """The layout the output node takes each of its values in: whole (``B`` on every axis), or
    under ``SENT`` each one's crossing layout."""
    if graph.outputs == SENT:
        return [crossing_layout(graph.meta(v).shape, mesh_shape) for v in graph.output.inputs]
    return [(B,) * len(mesh_shape) for _ in graph.output.inputs]


def dual_at(graph, consumer) -> bool:
    """Whether converting a value for ``consumer`` runs its dual in backward (a floating value
    that carries a gradient): for an op, and for the output of a stage whose outputs are
    ``SENT``, whose gradients come back from the next stage; not for an output returned to the
    caller, whose gradient is seeded whole on every rank."""
    return consumer.kind != "output" or graph.outputs == SENT


def check_outputs(outputs) -> str:
    if not isinstance(outputs, str) or outputs not in MODES:
        raise ValueError(f"outputs is {WHOLE!r} (every output whole on every rank, the default) or {DTENSOR!r} "
                         f"(each output a DTensor in its planned layout, e.g. logits split over the vocabulary "
                         f"for loss_parallel), got {outputs!r}")
    return outputs


def kept_split(graph, outputs: str) -> frozenset:
    """The values of ``graph`` handed back in their planned layouts: with ``outputs="dtensor"``,
    every user output that is not also a buffer's new value (buffers are always written whole)."""
    if outputs != DTENSOR:
        return frozenset()
    from torch.export.graph_signature import OutputKind
    specs = graph.exported.graph_signature.output_specs
    returned = graph.output.fx_node.args[0]   # one per spec, in order
    user = {a for s, a in zip(specs, returned) if s.kind == OutputKind.USER_OUTPUT}
    written = {a for s, a in zip(specs, returned) if s.kind != OutputKind.USER_OUTPUT}
    values = set()
    for fx_node in user - written:
        value = graph.value_of.get(fx_node)
        if isinstance(value, tuple):
            values.add(value)
    return frozenset(values)
