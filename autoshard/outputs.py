"""What a parallel module hands back: every output whole on every rank (``outputs="whole"``, the
default), or each user output as a DTensor in the layout the plan gave it (``outputs="dtensor"``,
made by ``autoshard.runtime.outputs``).

Whole outputs cost a conversion to broadcast on every axis, which the plan prices: the logits of a
large vocabulary gathered onto every rank can take more of the step than the model's layers. A
user who computes the loss outside the model keeps them split instead (``loss_parallel`` takes
logits split over the vocabulary), and the plan prices no conversion for them.

The option and the values it keeps split stand here, under the cost model that prices them and
the rewriter that lowers them (as ``precision.py`` does for a precision policy).
"""
from __future__ import annotations

WHOLE, DTENSOR = "whole", "dtensor"
MODES = (WHOLE, DTENSOR)


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
