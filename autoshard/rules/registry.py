"""The rule table: aten op -> one-axis signatures."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch



@dataclass(frozen=True)
class Sig:
    """One mesh axis: a placement per tensor input (in argument order) and per tensor output.

    ``whole_after``: inputs (by position) that no later mesh axis may split where an axis takes
    this signature (``passes.annotate.expand`` offers no such combination). For a lowering that
    takes "this rank's chunk over this axis" of what it holds of such an input
    (``experts.gather_rows``: its chunk of the index's positions): a dim split over axes a < b
    holds at rank (i, j) chunk i * (size of b) + j, the lower-numbered axis the major one, so the
    chunk it takes is its chunk of the whole only where the axes that split the input come first."""
    inputs: tuple
    outputs: tuple
    whole_after: tuple = ()

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
# rules for ops a library registers only once it is imported (transformers' custom ops), by the
# op's qualified name ``namespace::name``: found when a captured graph holds one
RULES_BY_NAME: dict = {}


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


def register_by_name(names: Iterable[str], rule: Rule) -> None:
    for name in names:
        RULES_BY_NAME[name] = rule


def qualified_name(target) -> Optional[str]:
    name = getattr(target, "name", None)
    return name() if isinstance(target, torch._ops.OpOverload) and callable(name) else None


def rule_for(target) -> Optional[Rule]:
    found = RULES.get(target)
    if found is None and RULES_BY_NAME:
        found = RULES_BY_NAME.get(qualified_name(target))
    return found


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def replicated_only(ctx: OpCtx):
    """Ops that are right replicated and need no warning (factories, random draws)."""
    return []
