"""The rule table: aten op -> one-axis signatures."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch



@dataclass(frozen=True)
class Sig:
    """One mesh axis: a placement per tensor input (in argument order) and per tensor output."""
    inputs: tuple
    outputs: tuple

    def __repr__(self) -> str:
        ins = ", ".join(map(repr, self.inputs))
        outs = ", ".join(map(repr, self.outputs))
        return f"({ins}) -> {outs}"


class OpCtx:
    """What a rule may look at: argument values, tensor input and output shapes."""

    def __init__(self, target, args, kwargs, in_shapes, out_shapes, in_floating=None):
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.out_shapes = [tuple(s) for s in out_shapes]
        self.in_floating = in_floating

    def arg(self, index: int, name: str, default=None):
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def n_in(self) -> int:
        return len(self.in_shapes)

    @property
    def n_out(self) -> int:
        return len(self.out_shapes)


Rule = Callable[[OpCtx], Iterable[Sig]]
RULES: dict = {}


def register(ops: Iterable, rule: Rule) -> None:
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                RULES[getattr(op, name)] = rule
        else:
            RULES[op] = rule


def rule(*ops):
    def deco(fn: Rule) -> Rule:
        register(ops, fn)
        return fn
    return deco


def rule_for(target) -> Optional[Rule]:
    return RULES.get(target)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def replicated_only(ctx: OpCtx):
    """Ops that are right replicated and need no warning (factories, random draws)."""
    return []
