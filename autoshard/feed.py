"""What a parallel module's program takes and gives back (``ParallelModule`` keeps one per input
shape, mode and autocast): the lowered program with the graph and plan it was made from, and its
feed, which finds each parameter's and buffer's tensor in the model's registries, hands the
program each parameter's share (``runtime.param_share``) and writes back what it returns.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from autoshard import runtime
from autoshard._compat import tree_unflatten
from autoshard.ir import Graph
from autoshard.plan import Plan


class Program(NamedTuple):
    """What one call's shapes, constants and mode run: the lowered program, the graph and plan it
    was made from, and how the module's tensors feed it."""
    program: torch.fx.GraphModule
    graph: Graph
    plan: Plan
    feed: "Feed"


class Feed:
    """What one program takes and gives back, worked out once: where each parameter and buffer
    placeholder's tensor lives in the model, and what each output is (a user output, or a
    buffer's new value). The graph's signature builds its output spec anew at every look (a
    namedtuple class a call), so it is read here, once."""

    def __init__(self, model: nn.Module, graph: Graph, plan: Plan, device):
        from torch.export.graph_signature import OutputKind

        def owner(fqn):
            prefix, _, name = fqn.rpartition(".")
            return model.get_submodule(prefix), name

        constants = graph.exported.constants
        # each placeholder's tensor: a constant the graph lifted, else a name in a module's
        # parameter or buffer registry. Grouped by registry, so that a traced forward (a compiled
        # function calling the module) reaches each registry by one path: dynamo guards an object
        # reached by two (a module's weight and bias) with an aliasing check evaluated in Python at
        # every call
        placeholders = [n for n in graph.nodes if n.kind in ("param", "buffer")]
        self._count, self._constants, by_registry = len(placeholders), [], {}
        for i, n in enumerate(placeholders):
            if n.kind == "param":
                mod, name = owner(n.fqn)
                by_registry.setdefault(id(mod._parameters), (mod._parameters, True, []))[2].append((name, i))
                continue
            try:   # a module's buffer, or a constant the graph lifted
                mod, name = owner(n.fqn)
            except AttributeError:
                mod, name = None, None
            if mod is not None and mod._buffers.get(name) is not None:
                by_registry.setdefault(id(mod._buffers), (mod._buffers, False, []))[2].append((name, i))
            else:
                self._constants.append((i, constants[n.fqn].to(device)))
        self._registries = [(registry, params, tuple(names)) for registry, params, names in by_registry.values()]
        self._outs = []
        for spec in graph.exported.graph_signature.output_specs:
            if spec.kind == OutputKind.BUFFER_MUTATION:
                mod, name = owner(spec.target)
                self._outs.append((mod._buffers, name))
            elif spec.kind == OutputKind.USER_OUTPUT:
                self._outs.append(None)
            else:
                raise NotImplementedError(f"autoshard does not yet run models whose graph outputs {spec.kind}")
        self._out_spec = graph.exported.call_spec.out_spec
        self.again = plan.training and plan.schedule.get("reshard_after_forward", False)
        # per tensor the user passes: whether it arrives as each rank's rows (inputs="local")
        self.arrived = [name in plan.arrival for name in graph.user_inputs if graph.by_name[name].outputs]
        self.mesh_shape = tuple(plan.mesh_shape)
        # placeholder -> (the parameter, its share) as last fed: read by a traced forward (a compiled
        # function calling the module), which feeds that share, a plain leaf, while the registry
        # holds the parameter; made here, eagerly, as the program is
        self._shares = {i: (registry[name], runtime.param_share(registry[name]))
                        for registry, params, names in self._registries if params for name, i in names}

    def inputs(self) -> list:
        feed = [None] * self._count
        for i, t in self._constants:
            feed[i] = t
        traced = torch.compiler.is_compiling()
        for registry, params, names in self._registries:
            for name, i in names:
                t = registry[name]
                if not params:
                    feed[i] = t
                    continue
                kept = self._shares.get(i, (None, None))
                if traced:
                    # the share as last fed, where the parameter is the one it was made for and
                    # still as trainable (dynamo guards both; a tensor replaced inside it is caught
                    # at backward, runtime.grads._hand_back); else DTensor's to_local(), traced
                    # (runtime.param_share)
                    fresh = kept[0] is t and kept[1].requires_grad == t.requires_grad
                    feed[i] = kept[1] if fresh else runtime.param_share(t)
                    continue
                feed[i] = runtime.param_share(t)
                if kept[1] is not feed[i]:
                    self._shares[i] = (t, feed[i])
        return feed

    def outputs(self, outs):
        user = []
        for target, value in zip(self._outs, outs):
            if target is None:
                user.append(value)
            else:
                with torch.no_grad():
                    target[0][target[1]].copy_(value)
        return tree_unflatten(user, self._out_spec)
