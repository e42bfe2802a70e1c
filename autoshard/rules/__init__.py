"""SBP rules: for each aten op, the signatures it offers on one mesh axis.

A rule is a function of the op's context (shapes, arguments) returning a list of ``Sig``; the
all-broadcast signature is implicit and always offered. ``autoshard.passes.annotate`` expands these
one-axis signatures to every mesh axis. Importing this package registers every rule.
``register(op, "m k, k n -> m n")`` gives a user's own op a rule (``rules.custom``).
"""
from autoshard.rules.registry import RULES, OpCtx, Sig, rule_for  # noqa: F401
from autoshard.rules import factor, pointwise, views, nn, conv, indexing, moe, flex  # noqa: F401  (register)
from autoshard.rules.custom import register  # noqa: F401
