"""Rules for a user's own ops (``torch.library`` custom ops), which otherwise run replicated:

    autoshard.rules.register(torch.ops.mylib.scaled_mm, "m k, k n -> m n")
    autoshard.rules.register(torch.ops.mylib.fused_act, elementwise=True)
    autoshard.rules.register("mylib::scatter_rows", "_ d, n d, n d -> _ d", additive=(0,))

A factor string names each dim of each tensor input, in argument order, then the output's, and
reads as ``rules.factor``'s (DESIGN.md section 2): a factor the output has may be split on every
side that has it (-> S); a factor the output lacks is summed over, so split it leaves partial
sums (-> P), the additive inputs (added to the result, not multiplied into it) P as well; and a
partial sum passes through each multiplicative input with the others whole. So the string
claims the op is a sum over its missing factors of a product linear in each input, that a dim of
size 1 broadcasts, and that running the op on each rank's chunks is the op on the whole. A dim
named ``_`` is never split: a dim whose positions are data (the rows a scatter adds into).

Elementwise: every output has the shape of the inputs broadcast together, each element computed
from the inputs' elements at its position; any dim may be split. No partial sums pass.

A rule is a claim about the op that autoshard cannot see inside; check it on real inputs before
trusting a plan: ``autoshard.check.validate.validate([(op, args, kwargs)], p=2)`` runs every
signature it offers on simulated ranks and reports those that are wrong.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch

from autoshard._compat import custom_op_overload
from autoshard.rules.factor import factor_sigs
from autoshard.rules.pointwise import broadcast_sigs
from autoshard.rules.registry import OpCtx, Rule
from autoshard.rules.registry import register as _register_ops
from autoshard.rules.registry import register_by_name

WHOLE = "_"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_']*\Z")


def register(op, factors: Optional[str] = None, *, elementwise: bool = False, additive: Iterable[int] = ()) -> Rule:
    """Give ``op`` the sharding rule of a factor string or of an elementwise op (module
    docstring); returns the rule. ``op``: ``torch.ops.ns.name`` (every overload), one overload,
    the function ``torch.library.custom_op`` made, or ``"ns::name"`` for an op a library defines
    only once it is imported. ``additive``: the inputs (by position among the tensor inputs)
    added to the result rather than multiplied."""
    if (factors is None) == (not elementwise):
        raise ValueError("register(op, \"m k, k n -> m n\") gives a factor string, register(op, elementwise=True) "
                         "declares an elementwise op: give one of the two")
    targets, name = _targets(op)
    if elementwise:
        if tuple(additive):
            raise ValueError("additive= belongs to a factor string; an elementwise op has none")
        rule = _elementwise_rule(name)
    else:
        rule = _factor_rule(name, factors, additive)
    if targets:
        _register_ops(targets, rule)
    else:
        register_by_name([name], rule)
    return rule


def _targets(op) -> tuple:
    """(the overloads to register, the op's name for messages); no overloads for a name."""
    if isinstance(op, torch.library.CustomOpDef):
        op = custom_op_overload(op)
    if isinstance(op, str):
        if "::" not in op or not all(op.split("::", 1)):
            raise ValueError(f"an op's name is \"namespace::name\", such as \"mylib::scatter_rows\"; got {op!r}")
        name, namespace, targets = op, op.split("::", 1)[0], []
    elif isinstance(op, torch._ops.OpOverload):
        name, namespace, targets = op.name(), op.namespace, [op]
    elif isinstance(op, torch._ops.OpOverloadPacket):
        first = getattr(op, op.overloads()[0])
        name, namespace, targets = first.name().split(".")[0], first.namespace, [op]
    else:
        raise TypeError(f"op is a custom op: torch.ops.mylib.name, one of its overloads, the function "
                        f"torch.library.custom_op made, or its name \"mylib::name\"; got {type(op).__name__}")
    if namespace == "aten":
        raise ValueError(f"{name} is an aten op, whose rules autoshard keeps itself (autoshard/rules/); register "
                         "gives rules to a library's own ops")
    return targets, name


def _parse(factors: str, name: str) -> tuple:
    """"m k, k n -> m n" -> ([["m", "k"], ["k", "n"]], ["m", "n"])."""
    if not isinstance(factors, str) or factors.count("->") != 1:
        raise ValueError(f"{name}: a factor string reads \"m k, k n -> m n\" (each input's dims, then the output's); "
                         f"got {factors!r}")
    lhs, rhs = factors.split("->")
    if "," in rhs:
        raise ValueError(f"{name}: a factor string names one output; {factors!r} names {rhs.count(',') + 1}")
    operands = [part.split() for part in lhs.split(",")]
    output = rhs.split()
    for dims in operands + [output]:
        bad = [f for f in dims if not _NAME.match(f)]
        if bad:
            raise ValueError(f"{name}: factor names are identifiers such as m, k, n_head; got {bad} in {factors!r}")
        repeated = sorted({f for f in dims if f != WHOLE and dims.count(f) > 1})
        if repeated:
            raise ValueError(f"{name}: factor {repeated[0]!r} names two dims of one tensor in {factors!r} (a "
                             "diagonal): no factor rule describes it")
    return operands, output


def _factor_rule(name: str, factors: str, additive) -> Rule:
    operands, output = _parse(factors, name)
    additive = tuple(additive)
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(operands) for i in additive):
        raise ValueError(f"{name}: additive= names inputs by position, 0 to {len(operands) - 1} for {factors!r}; "
                         f"got {list(additive)}")

    def rule(ctx: OpCtx):
        ranks = [len(s) for s in ctx.in_shapes]
        if ctx.n_out != 1 or ranks != [len(o) for o in operands] or len(ctx.out_shapes[0]) != len(output):
            raise ValueError(
                f"{name} was registered with the factors {factors!r}, which name {len(operands)} tensor input(s) "
                f"of {[len(o) for o in operands]} dims and one output of {len(output)}; a call of it has "
                f"{ctx.n_in} tensor input(s) of {ranks} dims and outputs of shapes "
                f"{[list(s) for s in ctx.out_shapes]}: register it with factors that fit")
        return factor_sigs(operands, output, ctx.in_shapes, ctx.out_shapes[0], additive, whole=(WHOLE,))

    rule.__name__ = rule.__qualname__ = f"factors[{factors}]"
    return rule


def _elementwise_rule(name: str) -> Rule:
    def rule(ctx: OpCtx):
        if len(set(ctx.out_shapes)) > 1:
            raise ValueError(f"{name} was registered as elementwise, but its outputs have different shapes "
                             f"{[list(s) for s in ctx.out_shapes]}: register it with a factor string instead")
        return broadcast_sigs(ctx) if ctx.n_out else []

    rule.__name__ = rule.__qualname__ = "elementwise"
    return rule
