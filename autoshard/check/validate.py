"""Numerical check of the SBP rules (DESIGN.md section 7).

For every case ``(op_overload, args, kwargs)`` (real tensors in ``args``/``kwargs``) and every
one-axis signature the op's rule offers, plus the implicit all-broadcast one, the ``p`` ranks of
one mesh axis are simulated in this process:

* each rank's local inputs are made from the whole ones as the signature says: ``S(d)`` chunk r of
  dim d, ``B`` the whole tensor, ``P`` random pieces that sum to the whole tensor;
* the op runs on each rank's inputs through the rewriter's own lowering
  (``autoshard.passes.rewrite.LOWERINGS``: the size argument of view/reshape/_unsafe_view/expand
  and the sizes of unflatten become the local output shape, a mean left partial over a split dim is
  scaled by 1/p, ...), executed eagerly instead of being emitted into a graph;
* the local outputs are checked to have the shape the output placement implies (``S(d)``: dim d
  divided by p; ``B``/``P``: the whole shape) and the whole dtype, then combined (``S(d)``: cat along
  d; ``B``: every rank must hold the same tensor; ``P``: sum) and compared with the op run on the
  whole inputs (``torch.testing.assert_close``; tolerances by dtype, integers and bools exact).

The tensor inputs of an op are the tensors among ``(args, kwargs)`` in order, lists flattened, the
same order the capture pass gives the graph's fx nodes. The rule sees the arguments as the planner
gives them: every tensor replaced by an ``torch.fx.Node`` placeholder.

An op that leaves its result uninitialized (``new_empty``) is checked with the memory filled as torch
fills it under deterministic algorithms (NaN, an integer dtype's largest value): ``UNINITIALIZED``.

Signatures the planner never offers are counted as *not applicable*, not checked: a split dim that
does not divide by ``p``, or a partial sum on a non-float tensor (``autoshard.placement.is_valid``).

Skipped (their local form calls a runtime function that needs a process group, and is checked by
the multi-process tests instead): ``dropout`` (every signature: it draws random numbers), and
``cross_entropy_loss`` with reduction mean over a split batch (it all-reduces the count of targets).
``cross_entropy_loss`` with reduction ``none`` or ``sum``, and mean with the batch whole, are checked.
So is ``batch_norm`` in training with its statistics dims whole, but not over a split batch (or
other non-channel dim: ``runtime.batch_norm_train`` gathers the statistics) nor over split
channels while it keeps running statistics (it gathers their update); in eval mode every
signature is checked. The grouped expert matmul on a rank's rows or experts
(``experts.grouped_mm``: it reads the rank's coordinate, and exchanges rows by all-to-all) and
the rows of a split tensor taken at a whole index (``experts.gather_rows``, by all-to-all) are
checked by tests/test_moe.py in a real group.

Command line: ``python -m autoshard.check.validate [-p 2 4] [-v]`` checks the built-in cases
(``default_cases()``), prints the report per ``p`` and exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
import torch.fx as fx

from autoshard import placement as pl
from autoshard.passes import rewrite
from autoshard.placement import B, Broadcast, Partial, Split
from autoshard.rules.registry import RULES, OpCtx, Sig, rule_for
from autoshard.rules.conv import batch_norm_axes
from autoshard.rules.nn import count_axes

aten = torch.ops.aten

__all__ = ["Report", "validate", "default_cases", "main"]


# ---- report -----------------------------------------------------------------------------------

@dataclass
class Report:
    p: int
    ops_covered: set = field(default_factory=set)       # op names with a rule and >= 1 signature checked
    checked: int = 0                                     # signatures checked (all-B included)
    checked_nontrivial: int = 0                          # ... of which not all-B
    not_applicable: int = 0                              # split does not divide by p, P on a non-float
    skipped: list = field(default_factory=list)          # (op, sig, why): runtime-lowered cases
    failures: list = field(default_factory=list)         # (op, sig, message)
    no_rule: set = field(default_factory=set)            # op names among the cases without a rule
    per_op: dict = field(default_factory=dict)           # op name -> signatures checked
    ops_seen: set = field(default_factory=set)           # op names among the cases with a rule

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self, verbose: bool = False) -> str:
        lines = [
            f"autoshard rule validation, one mesh axis of size p={self.p}",
            f"  ops covered:          {len(self.ops_covered)}",
            f"  signatures checked:   {self.checked} ({self.checked_nontrivial} besides all-B)",
            f"  not applicable:       {self.not_applicable} (split not divisible by p, or P on a non-float)",
            f"  skipped:              {len(self.skipped)} (runtime-lowered: dropout, mean cross_entropy "
            "over a split batch, batch norm in training that gathers statistics)",
            f"  failures:             {len(self.failures)}",
        ]
        if self.no_rule:
            lines.append(f"  ops without a rule:   {', '.join(sorted(self.no_rule))}")
        uncovered = uncovered_families(self.ops_seen)
        if uncovered:
            lines.append(f"  rule functions with no case: {', '.join(uncovered)}")
        if verbose:
            lines.append("  per op:")
            for op in sorted(self.per_op):
                lines.append(f"    {op:40s} {self.per_op[op]}")
            for op, sig, why in self.skipped:
                lines.append(f"  skipped {op} {sig}: {why}")
        for op, sig, msg in self.failures:
            first = msg.strip().splitlines()
            lines.append(f"  FAIL {op} {sig}: " + "\n        ".join(first[:12]))
        return "\n".join(lines)

    __str__ = format


def op_name(target) -> str:
    return str(target).replace("aten.", "") if isinstance(target, torch._ops.OpOverload) else str(target)


def uncovered_families(covered_names) -> list:
    """Rule functions (one per op family) none of whose ops has a case."""
    by_fn: dict = {}
    for op, fn in RULES.items():
        by_fn.setdefault(fn, []).append(op_name(op))
    out = []
    for fn, names in by_fn.items():
        if not any(n in covered_names for n in names):
            out.append(f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}")
    return sorted(out)


# ---- helpers ----------------------------------------------------------------------------------

def _map_tensors(obj, fn):
    """Replace every tensor in a nest of tuples/lists/dicts by ``fn(tensor)``, in the order the
    capture pass walks fx arguments (args, then kwargs values; lists flattened)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensor_inputs(args, kwargs) -> list:
    found = []
    _map_tensors((args, kwargs), lambda t: found.append(t) or t)
    return found


def _substitute(args, kwargs, values):
    it = iter(values)
    new_args, new_kwargs = _map_tensors((args, kwargs), lambda t: next(it))
    return new_args, new_kwargs


def _outputs(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _tolerance(dtype, in_dtypes=()):
    """By the output dtype, loosened to the least precise float input (a cast up keeps the input's
    rounding)."""
    floats = [d for d in in_dtypes if d.is_floating_point or d.is_complex]
    if dtype.is_floating_point or dtype.is_complex:
        for d in floats:
            if d.itemsize < dtype.itemsize:
                dtype = d
    if dtype == torch.float64:
        return dict(rtol=1e-7, atol=1e-9)
    if dtype in (torch.float32, torch.complex64):
        return dict(rtol=1e-4, atol=1e-5)
    if dtype.is_floating_point:  # half, bfloat16
        return dict(rtol=2e-2, atol=2e-2)
    return dict(rtol=0, atol=0)


def _pieces(x: torch.Tensor, p: int, gen: torch.Generator) -> list:
    """p random tensors that sum to x (to rounding). An inf or nan stays whole in the last one:
    finite pieces cannot sum to it."""
    finite = x.isfinite()
    scale = float(x[finite].abs().max()) if finite.any() else 1.0
    scale = scale if scale > 0 else 1.0
    parts = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) * scale for _ in range(p - 1)]
    parts = [q.masked_fill(~finite, 0) for q in parts]
    last = x.clone()
    for q in parts:
        last = last - q
    return parts + [last]


def _local_input(x: torch.Tensor, q, p: int, pieces: Optional[list], r: int) -> torch.Tensor:
    if isinstance(q, Split):
        n = x.shape[q.dim] // p
        return x.narrow(q.dim, r * n, n).clone()
    if isinstance(q, Partial):
        return pieces[r].clone()
    return x.clone()


class _EagerGraph:
    """Stands in for the fx graph a lowering emits into: runs each call at once."""

    def call_function(self, target, args=(), kwargs=None):
        return target(*args, **(kwargs or {}))


# the lowerings whose local form needs a process group
def _runtime_lowered(target, fx_args, fx_kwargs, sig: Sig) -> Optional[str]:
    if target in (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default):
        return "dropout draws from the generator all ranks share (runtime.dropout)"
    if count_axes(target, fx_args, fx_kwargs, [(q,) for q in sig.inputs]):
        return "mean cross_entropy over a split batch all-reduces its count (runtime.cross_entropy_mean)"
    if rewrite.lowering_for(target) is rewrite.lower_grouped_mm and any(
            isinstance(q, Split) and q.dim == 0 for q in sig.inputs[:2]):
        return "an expert matmul on a rank's rows or experts reads its coordinate (experts.grouped_mm)"
    if target == aten.index.Tensor and sig.inputs[0] == Split(0) and fx_args[1][0] is not None:
        return "rows of a split tensor at a whole index come by all-to-all (experts.gather_rows)"
    if sig.inputs and any(batch_norm_axes(target, fx_args, fx_kwargs, (sig.inputs[0],))):
        return ("batch norm in training gathers the statistics of a split batch, or the running-statistics "
                "update of split channels (runtime.batch_norm_train)")
    return None


def _placeholders(args, kwargs, ins):
    """The op's arguments with an fx placeholder for each tensor, its value in ``meta["val"]``
    as a captured graph's nodes carry theirs (a rule may read an index's dtype)."""
    g = fx.Graph()
    nodes = [g.placeholder(f"t{i}") for i in range(len(ins))]
    for node, t in zip(nodes, ins):
        node.meta["val"] = t
    return _substitute(args, kwargs, nodes)


def signatures(target, args, kwargs=None, whole_out=None) -> list:
    """The one-axis signatures the rule for ``target`` offers on these real inputs (the implicit
    all-B one not included), with the rule seeing fx nodes where the tensors are, as in planning."""
    kwargs = dict(kwargs or {})
    rule = rule_for(target)
    if rule is None:
        return []
    ins = tensor_inputs(args, kwargs)
    fx_args, fx_kwargs = _placeholders(tuple(args), kwargs, ins)
    if whole_out is None:
        whole_out = target(*args, **kwargs)
    outs = _outputs(whole_out)
    ctx = OpCtx(target, fx_args, fx_kwargs, [t.shape for t in ins], [t.shape for t in outs])
    return list(rule(ctx))


# ---- one signature ----------------------------------------------------------------------------

# ops whose result is memory they leave uninitialized: checked with it filled (NaN, an integer
# dtype's largest value), as torch fills it under deterministic algorithms, so that ranks compare
UNINITIALIZED = {aten.new_empty.default, aten.empty_like.default, aten.empty.memory_format,
                 aten.empty_strided.default}


@contextlib.contextmanager
def _filled(target):
    if target not in UNINITIALIZED:
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def check_signature(target, args, kwargs, sig: Sig, p: int, seed: int = 0,
                    fx_args=None, fx_kwargs=None, whole_out=None) -> tuple:
    """-> ("ok" | "n/a" | "skip" | "fail", message)."""
    with _filled(target):
        return _check_signature(target, args, kwargs, sig, p, seed, fx_args, fx_kwargs, whole_out)


def _check_signature(target, args, kwargs, sig: Sig, p: int, seed, fx_args, fx_kwargs, whole_out) -> tuple:
    ins = tensor_inputs(args, kwargs)
    if fx_args is None:
        fx_args, fx_kwargs = _placeholders(args, kwargs, ins)
    if whole_out is None:
        whole_out = target(*args, **kwargs)
    outs = _outputs(whole_out)
    if len(sig.inputs) != len(ins) or len(sig.outputs) != len(outs):
        return "fail", (f"signature has {len(sig.inputs)} inputs and {len(sig.outputs)} outputs; the op "
                        f"has {len(ins)} tensor inputs and {len(outs)} tensor outputs")
    for kind, tensors, places in (("input", ins, sig.inputs), ("output", outs, sig.outputs)):
        for i, (t, q) in enumerate(zip(tensors, places)):
            if not isinstance(q, (Split, Broadcast, Partial)):
                return "fail", f"{kind} {i}: {q!r} is not a placement"
            if isinstance(q, Split) and not (0 <= q.dim < t.dim()):
                return "fail", f"{kind} {i} of shape {list(t.shape)} is split on dim {q.dim}, out of range"
    for t, q in list(zip(ins, sig.inputs)) + list(zip(outs, sig.outputs)):
        if not pl.is_valid(tuple(t.shape), (q,), (p,), _floating(t)):
            return "n/a", ""
    why = _runtime_lowered(target, fx_args, fx_kwargs, sig)
    if why:
        return "skip", why

    gen = torch.Generator().manual_seed(seed)
    pieces = [_pieces(t, p, gen) if isinstance(q, Partial) else None for t, q in zip(ins, sig.inputs)]
    node = SimpleNamespace(target=target, fx_node=SimpleNamespace(args=fx_args, kwargs=fx_kwargs))
    in_pl = [(q,) for q in sig.inputs]
    out_pl = [(q,) for q in sig.outputs]
    in_shapes = [tuple(t.shape) for t in ins]
    out_shapes = [tuple(t.shape) for t in outs]
    lower = rewrite.lowering_for(target)
    locals_: list = []  # per rank, list of output tensors
    for r in range(p):
        local_ins = [_local_input(t, q, p, pc, r) for t, q, pc in zip(ins, sig.inputs, pieces)]
        largs, lkwargs = _substitute(args, kwargs, local_ins)
        low = rewrite.Lowering(_EagerGraph(), node, largs, lkwargs, in_pl, out_pl, in_shapes, out_shapes, (p,))
        try:
            out = lower(low)
        except Exception as e:  # noqa: BLE001 - a local op that cannot run is a wrong signature
            return "fail", f"rank {r}: the local op raised {type(e).__name__}: {e}"
        lo = _outputs(out)
        if len(lo) != len(outs):
            return "fail", f"rank {r}: the local op gave {len(lo)} tensor outputs, the whole op {len(outs)}"
        locals_.append(lo)

    for j, (ref, q) in enumerate(zip(outs, sig.outputs)):
        want = pl.local_shape(tuple(ref.shape), (q,), (p,))
        parts = [locals_[r][j] for r in range(p)]
        for r, t in enumerate(parts):
            if tuple(t.shape) != tuple(want):
                return "fail", (f"output {j} on rank {r} has shape {list(t.shape)}; {q!r} of the whole "
                                f"{list(ref.shape)} means {list(want)}")
            if t.dtype != ref.dtype:
                return "fail", f"output {j} on rank {r} has dtype {t.dtype}, the whole op {ref.dtype}"
        tol = _tolerance(ref.dtype, [t.dtype for t in ins])
        try:
            if isinstance(q, Split):
                got = torch.cat(parts, dim=q.dim)
            elif isinstance(q, Partial):
                got = parts[0]
                for t in parts[1:]:
                    got = got + t
            else:
                for r in range(1, p):
                    torch.testing.assert_close(parts[r], parts[0], equal_nan=True, **tol,
                                               msg=lambda m, r=r: f"B output {j}: rank {r} differs from rank 0: {m}")
                got = parts[0]
            torch.testing.assert_close(got, ref, equal_nan=True, **tol,
                                       msg=lambda m: f"output {j} ({q!r}) combined differs from the whole op: {m}")
        except AssertionError as e:
            return "fail", str(e)
    return "ok", ""


# ---- all cases --------------------------------------------------------------------------------

def validate(cases, p: int = 2, seed: int = 0) -> Report:
    """Check every signature the rules offer for ``cases`` (``(op_overload, args, kwargs)`` with
    real tensors) on one simulated mesh axis of ``p`` ranks."""
    rep = Report(p=p)
    for ci, case in enumerate(cases):
        target, args, kwargs = case[0], tuple(case[1]), dict(case[2] if len(case) > 2 and case[2] else {})
        name = op_name(target)
        rule = rule_for(target)
        if rule is None:
            rep.no_rule.add(name)
            continue
        rep.ops_seen.add(name)
        ins = tensor_inputs(args, kwargs)
        fx_args, fx_kwargs = _placeholders(args, kwargs, ins)
        try:
            with _filled(target):
                whole = target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            rep.failures.append((name, "-", f"case {ci}: the whole op raised {type(e).__name__}: {e}"))
            continue
        try:
            offered = signatures(target, args, kwargs, whole_out=whole)
        except Exception as e:  # noqa: BLE001
            rep.failures.append((name, "-", f"case {ci}: the rule raised {type(e).__name__}: {e}"))
            continue
        outs = _outputs(whole)
        sigs = [Sig((B,) * len(ins), (B,) * len(outs))]
        for s in offered:
            if s not in sigs:
                sigs.append(s)
        for si, sig in enumerate(sigs):
            status, msg = check_signature(target, args, kwargs, sig, p, seed=seed * 100003 + ci * 101 + si,
                                          fx_args=fx_args, fx_kwargs=fx_kwargs, whole_out=whole)
            shapes = " ".join(f"{list(t.shape)}" for t in ins)
            if status == "ok":
                rep.checked += 1
                rep.checked_nontrivial += si > 0
                rep.per_op[name] = rep.per_op.get(name, 0) + 1
                rep.ops_covered.add(name)
            elif status == "n/a":
                rep.not_applicable += 1
            elif status == "skip":
                rep.skipped.append((name, repr(sig), msg))
            else:
                rep.failures.append((name, repr(sig), f"case {ci} (inputs {shapes}): {msg}"))
    return rep


# ---- built-in cases ---------------------------------------------------------------------------

def default_cases(seed: int = 0) -> list:
    """Sample inputs for every op family with a rule. Dims are mostly multiples of 4 so that
    splits are checked at p=2 and p=4; a few dims of 6 or 2 exercise the not-applicable path."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def r(*shape, dtype=f64):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    def pos(*shape, dtype=f64):
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    def mask(*shape):
        return torch.rand(shape, generator=g) > 0.5

    C = []

    def add(op, *args, **kwargs):
        C.append((op, args, kwargs))

    # -- matmul-like (factor.py)
    add(aten.linear.default, r(8, 16), r(32, 16), r(32))
    add(aten.linear.default, r(8, 16), r(32, 16))
    add(aten.linear.default, r(4, 8, 16), r(12, 16), r(12))
    add(aten.linear.default, r(4, 8, 16), r(12, 16))
    add(aten.linear.default, r(16), r(8, 16), r(8))               # 1-D input
    add(aten.linear.default, r(2, 4, 8, 16, dtype=torch.float32), r(8, 16, dtype=torch.float32),
        r(8, dtype=torch.float32))
    add(aten.mm.default, r(8, 12), r(12, 16))
    add(aten.mm.default, r(8, 12, dtype=torch.float32), r(12, 4, dtype=torch.float32))
    add(aten.bmm.default, r(4, 8, 12), r(4, 12, 16))
    add(aten.matmul.default, r(8, 12), r(12, 16))
    add(aten.matmul.default, r(4, 8, 12), r(12, 16))
    add(aten.matmul.default, r(2, 4, 8, 12), r(2, 4, 12, 8))
    add(aten.matmul.default, r(4, 1, 8, 12), r(4, 12, 16))       # broadcast batch
    add(aten.matmul.default, r(1, 8, 12), r(4, 12, 8))           # broadcast batch, size 1 in a
    add(aten.matmul.default, r(8, 12), r(12))                    # matrix @ vector
    add(aten.matmul.default, r(12), r(4, 12, 8))                 # vector @ batched matrix
    add(aten.matmul.default, r(12), r(12))                       # dot
    add(aten.addmm.default, r(16), r(8, 12), r(12, 16))
    add(aten.addmm.default, r(8, 16), r(8, 12), r(12, 16), beta=0.5, alpha=2.0)
    add(aten.addmm.default, r(1, 16), r(8, 12), r(12, 16))
    add(aten.baddbmm.default, r(4, 8, 16), r(4, 8, 12), r(4, 12, 16))
    add(aten.baddbmm.default, r(8, 16), r(4, 8, 12), r(4, 12, 16), beta=0.5, alpha=-1.0)
    add(aten.einsum.default, "bij,bjk->bik", [r(4, 8, 12), r(4, 12, 16)])
    add(aten.einsum.default, "ij,jk->ik", [r(8, 12), r(12, 16)])
    add(aten.einsum.default, "bhqd,bhkd->bhqk", [r(2, 4, 8, 12), r(2, 4, 16, 12)])
    add(aten.einsum.default, "i,j->ij", [r(8), r(12)])
    add(aten.einsum.default, "ij,ij->i", [r(8, 12), r(8, 12)])
    add(aten.einsum.default, "ij,jk->i", [r(8, 12), r(12, 4)])
    add(aten.einsum.default, "ij,jk,kl->il", [r(8, 12), r(12, 4), r(4, 16)])
    add(aten.einsum.default, "ii->i", [r(8, 8)])                 # diagonal: all-B only

    # -- pointwise (pointwise.py)
    add(aten.add.Tensor, r(8, 12), r(8, 12))
    add(aten.add.Tensor, r(8, 12), 3.0)
    add(aten.add.Tensor, r(4, 8, 12), r(12))                     # broadcasting
    add(aten.add.Tensor, r(4, 1, 12), r(8, 1))                   # both broadcast
    add(aten.add.Tensor, r(8, 12), r(8, 12), alpha=2)
    add(aten.add.Scalar, r(8, 12), 2.0)
    add(aten.add.Tensor, ints(10, 8, 12), ints(10, 8, 12))
    add(aten.sub.Tensor, r(8, 12), r(12))
    add(aten.sub.Tensor, r(8, 12), 1.5)
    add(aten.mul.Tensor, r(4, 8, 12), r(8, 1))
    add(aten.mul.Tensor, r(8, 12), 0.5)
    add(aten.mul.Tensor, r(8, 12), r(8, 12))
    add(aten.div.Tensor, r(8, 12), pos(8, 12))
    add(aten.div.Tensor, r(4, 8, 12), pos(12))
    add(aten.div.Tensor, r(8, 12), 4.0)
    add(aten.div.Scalar, r(8, 12), 4.0)
    add(aten.div.Tensor_mode, r(8, 12), 0.3, rounding_mode="floor")   # x // 0.3 in export
    add(aten.div.Tensor_mode, r(8, 12), pos(12), rounding_mode="trunc")
    add(aten.neg.default, r(8, 12))
    add(aten.pow.Tensor_Scalar, r(8, 12), 2)
    add(aten.pow.Tensor_Scalar, pos(8, 12), 0.5)
    add(aten.pow.Tensor_Tensor, pos(8, 12), r(12))
    add(aten.exp.default, r(8, 12))
    add(aten.log.default, pos(8, 12))
    add(aten.sqrt.default, pos(8, 12))
    add(aten.abs.default, r(8, 12))
    add(aten.relu.default, r(4, 8, 12))
    add(aten.gelu.default, r(8, 12))
    add(aten.gelu.default, r(8, 12), approximate="tanh")
    add(aten.silu.default, r(8, 12))
    add(aten.tanh.default, r(8, 12))
    add(aten.sigmoid.default, r(8, 12))
    add(aten.rsqrt.default, pos(8, 12))
    add(aten.clamp.default, r(8, 12), -0.5, 0.5)
    add(aten.minimum.default, r(8, 12), r(1, 12))
    add(aten.eq.Tensor, ints(3, 8, 12), ints(3, 8, 12))
    add(aten.gt.Scalar, r(8, 12), 0.0)
    add(aten.lerp.Scalar, r(8, 12), r(8, 12), 0.3)
    add(aten.addcmul.default, r(8, 12), r(8, 12), r(12), value=0.5)
    add(aten.where.self, mask(8, 12), r(8, 12), r(8, 12))
    add(aten.where.self, mask(1, 8, 8), r(4, 8, 8), r(8, 1))
    add(aten.masked_fill.Scalar, r(4, 8, 8), mask(8, 8), -1e9)
    add(aten.masked_fill.Tensor, r(4, 8, 8), mask(4, 1, 8), torch.tensor(-2.0, dtype=f64))
    add(aten.zeros_like.default, r(8, 12))
    add(aten.new_zeros.default, r(4, 8), [4, 8, 12])                # x's dims where they line up
    add(aten.new_ones.default, ints(5, 4, 8), [4, 12], dtype=f64)
    add(aten.new_full.default, r(8, 12), [8, 12], 2.5)
    add(aten.new_empty.default, r(4, 8, 12), [4, 8, 16])            # filled while checked (UNINITIALIZED)
    add(aten.new_empty.default, ints(5, 8), [2, 4, 8])
    add(aten.copy.default, r(4, 8, 12), r(8, 12))                    # copy_ functionalized: src broadcast
    add(aten.copy.default, r(8, 12, dtype=torch.float32), r(8, 12))  # and cast to self's dtype
    add(aten.fill.Scalar, r(8, 12), 0.5)
    add(aten.fill.Tensor, r(4, 8), torch.tensor(2.0, dtype=f64))
    add(aten.zero.default, r(8, 12))
    add(aten.clone.default, r(8, 12))
    add(aten.contiguous.default, r(8, 12))
    add(aten.detach.default, r(8, 12))
    add(aten._to_copy.default, r(8, 12), dtype=torch.float32)
    add(aten._to_copy.default, r(8, 12, dtype=torch.float32), dtype=f64)
    add(aten._to_copy.default, r(8, 12), dtype=torch.int64)
    add(aten.type_as.default, r(8, 12, dtype=torch.float32), r(8, 12))
    add(aten.broadcast_tensors.default, [r(4, 1, 12), r(8, 12)])
    add(aten.broadcast_tensors.default, [r(8, 12), r(8, 12)])

    # -- normalization, softmax, attention, embedding (nn.py)
    add(aten.layer_norm.default, r(4, 8, 16), [16], r(16), r(16), 1e-5, False)
    add(aten.layer_norm.default, r(4, 8, 16), [16], None, None, 1e-5, False)
    add(aten.layer_norm.default, r(4, 8, 16), [8, 16], r(8, 16), r(8, 16), 1e-5, False)
    add(aten.layer_norm.default, r(8, 16, dtype=torch.float32), [16], r(16, dtype=torch.float32),
        r(16, dtype=torch.float32), 1e-5, False)
    add(aten.rms_norm.default, r(4, 8, 16), [16], r(16), 1e-6)
    add(aten.rms_norm.default, r(4, 8, 16), [16])
    add(aten.softmax.int, r(4, 8, 12), -1)
    add(aten.softmax.int, r(4, 8, 12), 1)
    add(aten.log_softmax.int, r(4, 8, 12), -1)
    add(aten._softmax.default, r(4, 8, 12), 2, False)
    add(aten._log_softmax.default, r(4, 8, 12), 0, False)
    q, k, v = r(2, 4, 8, 16), r(2, 4, 12, 16), r(2, 4, 12, 8)
    add(aten.scaled_dot_product_attention.default, q, k, v)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16), is_causal=True)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16), None, 0.0, True)
    add(aten.scaled_dot_product_attention.default, q, k, v, r(8, 12))
    add(aten.scaled_dot_product_attention.default, q, k, v, attn_mask=r(2, 1, 8, 12))
    add(aten.scaled_dot_product_attention.default, q, k, v, mask(2, 4, 8, 12) | torch.eye(8, 12, dtype=torch.bool))
    add(aten.scaled_dot_product_attention.default, q, k, v, scale=0.3)
    add(aten.scaled_dot_product_attention.default, r(2, 8, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16),
        enable_gqa=True)
    add(aten.scaled_dot_product_attention.default, r(2, 8, 8, 16), r(2, 2, 8, 16), r(2, 2, 8, 16),
        is_causal=True, enable_gqa=True)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16, dtype=torch.float32),
        r(2, 4, 8, 16, dtype=torch.float32), r(2, 4, 8, 16, dtype=torch.float32), is_causal=True)
    add(aten.embedding.default, r(20, 16), ints(20, 4, 8))
    add(aten.embedding.default, r(20, 16), ints(20, 8))
    add(aten.embedding.default, r(20, 16), ints(20, 4, 8), 0)

    # -- reductions
    x = r(4, 8, 12)
    add(aten.sum.default, x)
    add(aten.sum.dim_IntList, x, [1])
    add(aten.sum.dim_IntList, x, [1], True)
    add(aten.sum.dim_IntList, x, [0, -1])
    add(aten.sum.dim_IntList, x, [-1], False, dtype=torch.float32)
    add(aten.sum.dim_IntList, x, [])                                 # [] reduces every dim
    for op, *how in ((aten.amax.default, [1]), (aten.amin.default, [0, -1], True), (aten.max.dim, 2),
                     (aten.min.dim, 0, True), (aten.argmax.default, 1), (aten.argmin.default, -1, True)):
        add(op, x, *how)                                             # a max over some dims: the others split
    add(aten.sum.default, ints(5, 8, 12))
    add(aten.mean.default, x)
    add(aten.mean.dim, x, [1])
    add(aten.mean.dim, x, [-1], True)
    add(aten.mean.dim, x, [0, 2], False)
    add(aten.mean.dim, r(8, 12, dtype=torch.float32), [0])

    # -- views (views.py)
    add(aten.view.default, r(4, 8, 12), [32, 12])
    add(aten.view.default, r(4, 8, 12), [4, 8, 3, 4])
    add(aten.view.default, r(4, 8, 12), [4, -1])
    add(aten.view.default, r(8, 12), [4, 2, 12])
    add(aten.view.default, r(1, 8, 12), [8, 12])
    add(aten.view.default, r(8, 6), [4, 12])
    add(aten.reshape.default, r(4, 8, 12), [4, 8, 4, 3])
    add(aten.reshape.default, r(4, 8, 12), [-1])
    add(aten._unsafe_view.default, r(4, 8, 12), [32, 12])
    add(aten._unsafe_view.default, r(32, 12), [4, 8, 12])
    add(aten.flatten.using_ints, r(4, 8, 12), 0, 1)
    add(aten.flatten.using_ints, r(4, 8, 12), 1, 2)
    add(aten.unflatten.int, r(4, 32, 12), 1, [8, 4])
    add(aten.unflatten.int, r(4, 32, 12), -1, [4, -1])
    add(aten.unsqueeze.default, r(8, 12), 1)
    add(aten.unsqueeze.default, r(8, 12), -1)
    add(aten.squeeze.dim, r(8, 1, 12), 1)
    add(aten.squeeze.dim, r(8, 4, 12), 1)                          # no-op squeeze
    add(aten.squeeze.default, r(1, 8, 12))
    add(aten.squeeze.default, r(1, 4, 12))
    add(aten.squeeze.dims, r(1, 4, 1, 12), [0, 2])
    add(aten.squeeze.dims, r(8, 4, 12), [1])                         # no-op squeeze
    add(aten.view_as.default, r(4, 8, 12), r(32, 12))
    add(aten.expand_as.default, r(4, 1, 12), r(4, 8, 12))
    add(aten.view.dtype, r(8, 12, dtype=torch.float32), torch.int32)
    add(aten.view.dtype, r(8, 12, dtype=torch.float16), torch.bfloat16)
    add(aten.expand.default, r(4, 1, 12), [4, 8, 12])
    add(aten.expand.default, r(8, 12), [4, 8, 12])
    add(aten.expand.default, r(8, 1), [-1, 12])
    add(aten.permute.default, r(4, 8, 12), [2, 0, 1])
    add(aten.permute.default, r(2, 4, 8, 12), [0, 2, 1, 3])
    add(aten.numpy_T.default, r(8, 12))
    add(aten.transpose.int, r(4, 8, 12), 1, 2)
    add(aten.transpose.int, r(4, 8, 12), -1, 0)
    add(aten.t.default, r(8, 12))
    add(aten.t.default, r(8))
    add(aten.split.Tensor, r(4, 8, 12), 4, 2)
    add(aten.split.Tensor, r(4, 8, 12), 3, -1)
    add(aten.split.Tensor, r(8, 12), 4)
    add(aten.split_with_sizes.default, r(4, 8, 12), [4, 8], 2)
    add(aten.split_with_sizes.default, r(4, 8, 12), [2, 6], 1)
    add(aten.chunk.default, r(4, 8, 12), 3, 2)
    add(aten.chunk.default, r(4, 8, 12), 2)
    add(aten.unbind.int, r(4, 8, 12), 1)
    add(aten.unbind.int, r(3, 8, 12))
    add(aten.tensor_split.sections, r(4, 8, 12), 3, 2)
    add(aten.tensor_split.indices, r(4, 8, 12), [2, 5], 1)
    add(aten.cat.default, [r(4, 8, 12), r(4, 8, 4)], 2)
    add(aten.cat.default, [r(4, 8, 12), r(4, 4, 12), r(4, 4, 12)], 1)
    add(aten.cat.default, [r(4, 8), r(4, 8)])
    add(aten.stack.default, [r(8, 12), r(8, 12)])
    add(aten.stack.default, [r(8, 12), r(8, 12), r(8, 12)], 1)
    add(aten.stack.default, [r(8, 12), r(8, 12)], -1)
    add(aten.slice.Tensor, r(4, 8, 12), 1, 2, 6)
    add(aten.slice.Tensor, r(4, 8, 12), 2, 0, 12, 2)
    add(aten.slice.Tensor, r(4, 8, 12), 1, 0, 9223372036854775807)  # whole
    add(aten.slice.Tensor, r(4, 8, 12), 2, None, None)               # whole
    add(aten.slice.Tensor, r(4, 8, 12), -1, 4)
    add(aten.select.int, r(4, 8, 12), 1, 3)
    add(aten.select.int, r(4, 8, 12), -1, -1)
    add(aten.view_as_complex.default, r(4, 8, 6, 2))
    add(aten.view_as_real.default, r(4, 8, 6, dtype=torch.complex128))
    add(aten._assert_tensor_metadata.default, r(4, 8), dtype=f64)
    add(aten.tril.default, r(8, 8))
    add(aten.tril.default, r(4, 8, 8), -1)
    add(aten.triu.default, r(4, 8, 8), 1)
    add(aten.triu.default, r(2, 4, 8, 12))
    add(aten.repeat.default, r(4, 8, 6), [1, 2, 1])                 # dims repeated once keep their split
    add(aten.repeat.default, r(4, 8), [2, 1, 3])                    # a new dim in front
    add(aten.repeat.default, ints(5, 8, 4), [1, 1])
    add(aten.repeat_interleave.self_int, r(4, 8, 6), 2, 1)          # one count: dim 1 split too
    add(aten.repeat_interleave.self_int, r(4, 8, 6), 3, -1, output_size=18)   # Mamba2's heads: dim whole
    add(aten.repeat_interleave.self_int, r(4, 6), 2)                # flattened
    add(aten.repeat_interleave.self_Tensor, r(4, 8, 6), torch.tensor([2]), 1)
    add(aten.repeat_interleave.self_Tensor, r(4, 8, 6), torch.tensor([1, 2, 0, 3, 1, 1, 2, 2]), 1)

    # -- losses
    NONE, MEAN, SUM = 0, 1, 2
    logits, tgt = r(8, 12), ints(12, 8)
    tgt_ign = tgt.clone()
    tgt_ign[1] = -100
    for red in (NONE, SUM):
        add(aten.cross_entropy_loss.default, logits, tgt, None, red, -100, 0.0)
        add(aten.cross_entropy_loss.default, logits, tgt_ign, None, red, -100, 0.1)
        add(aten.cross_entropy_loss.default, r(8, 12, 4), ints(12, 8, 4), None, red, -100, 0.0)
        add(aten.cross_entropy_loss.default, logits, tgt, pos(12), red, -100, 0.0)
        add(aten.cross_entropy_loss.default, logits, torch.softmax(r(8, 12), -1), None, red, -100, 0.0)
    add(aten.cross_entropy_loss.default, logits, tgt, None, MEAN, -100, 0.0)  # split batch: skipped
    for red in (NONE, MEAN, SUM):
        add(aten.mse_loss.default, r(8, 12), r(8, 12), red)
        add(aten.mse_loss.default, r(4, 8, 12), r(4, 8, 12), red)
        add(aten.l1_loss.default, r(8, 12), r(8, 12), red)
        add(aten.smooth_l1_loss.default, r(8, 12), r(8, 12), red, 0.5)
        add(aten.huber_loss.default, r(8, 12), r(8, 12), red, 0.5)
    add(aten.dropout.default, r(8, 12), 0.5, True)  # random: skipped

    # -- convolutional networks (conv.py)
    x4 = r(4, 8, 6, 6)
    add(aten.conv2d.default, x4, r(12, 8, 3, 3), r(12), [1, 1], [1, 1])
    add(aten.conv2d.default, x4, r(12, 8, 3, 3), None, [2, 2], [1, 1])
    add(aten.conv2d.default, x4, r(8, 1, 3, 3), r(8), [1, 1], [1, 1], [1, 1], 8)   # depthwise
    add(aten.conv2d.default, x4, r(4, 2, 3, 3), r(4), [1, 1], [0, 0], [1, 1], 4)   # groups, gcd 1
    add(aten.conv2d.default, x4, r(8, 2, 3, 3), r(8), [1, 1], [1, 1], [1, 1], 4)   # groups, gcd 2
    add(aten.conv2d.default, r(8, 6, 6), r(12, 8, 3, 3), r(12))                     # unbatched
    add(aten.conv2d.padding, x4, r(12, 8, 3, 3), r(12), [1, 1], "same", [2, 2])
    add(aten.conv1d.default, r(4, 8, 10), r(12, 8, 3), r(12), [2], [1])
    add(aten.conv3d.default, r(2, 4, 4, 4, 4), r(8, 4, 3, 3, 3), None, [1, 1, 1], [1, 1, 1])
    add(aten.convolution.default, x4, r(12, 8, 3, 3), r(12), [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    add(aten.convolution.default, r(4, 8, 5, 5), r(8, 12, 3, 3), r(12), [2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    add(aten.conv_transpose2d.input, r(4, 8, 5, 5), r(8, 12, 3, 3), r(12), [2, 2], [1, 1], [1, 1])
    add(aten.conv_transpose2d.input, r(4, 8, 5, 5), r(8, 1, 3, 3), r(4), [1, 1], [0, 0], [0, 0], 4)
    add(aten.conv_transpose1d.default, r(4, 8, 5), r(8, 4, 3))
    rm, rv = r(8), pos(8)
    add(aten.batch_norm.default, x4, pos(8), r(8), rm.clone(), rv.clone(), True, 0.1, 1e-5, False)
    add(aten.batch_norm.default, x4, pos(8), r(8), None, None, True, 0.1, 1e-5, False)
    add(aten.batch_norm.default, r(8, 12), None, None, None, None, True, 0.1, 1e-5, False)
    add(aten.batch_norm.default, x4, pos(8), r(8), rm, rv, False, 0.1, 1e-5, False)       # eval
    add(aten.batch_norm.default, r(8, 8, 6), None, None, rm, rv, False, 0.1, 1e-5, False)
    add(aten.group_norm.default, x4, 2, r(8), r(8), 1e-5, False)
    add(aten.group_norm.default, r(4, 8, 6), 4)
    add(aten.max_pool2d.default, x4, [2, 2], [2, 2])
    add(aten.max_pool2d.default, r(8, 6, 6), [3, 3], [2, 2], [1, 1], [1, 1], True)     # unbatched
    add(aten.max_pool2d_with_indices.default, x4, [3, 3], [2, 2], [1, 1])
    add(aten.max_pool1d.default, r(4, 8, 10), [2])
    add(aten.avg_pool2d.default, x4, [2, 2], [2, 2])
    add(aten.avg_pool2d.default, x4, [3, 3], [2, 2], [1, 1], True, False)
    add(aten.avg_pool3d.default, r(2, 4, 4, 4, 4), [2, 2, 2])
    add(aten.adaptive_avg_pool2d.default, x4, [1, 1])
    add(aten.adaptive_avg_pool2d.default, x4, [4, 3])
    add(aten._adaptive_avg_pool2d.default, x4, [2, 2])
    add(aten.adaptive_max_pool2d.default, x4, [2, 2])
    add(aten.upsample_nearest2d.vec, r(4, 8, 3, 3), None, [2.0, 2.0])
    add(aten.upsample_nearest2d.default, r(4, 8, 3, 3), [6, 5])
    add(aten.upsample_bilinear2d.vec, r(4, 8, 3, 3), None, False, [2.0, 2.0])
    add(aten.upsample_bilinear2d.vec, r(4, 8, 3, 3), [5, 7], True, None)
    add(aten.upsample_bicubic2d.vec, r(4, 8, 3, 3), None, False, [2.0, 2.0])
    add(aten.upsample_linear1d.vec, r(4, 8, 5), None, False, [2.0])

    # -- masks and positions: indexing, scans, differences, pads (indexing.py)
    add(aten.cumsum.default, r(4, 8), 1)
    add(aten.cumsum.default, mask(4, 8), -1)                     # bool in, int64 out
    add(aten.diff.default, r(4, 8), 1, -1, r(4, 1))              # with prepend
    add(aten.diff.default, r(4, 8, 4), 2, 1, None, r(4, 2, 4))   # second difference, append
    add(aten.pad.default, ints(20, 4, 8), [0, 1], "constant", -100.0)   # labels shifted for the loss
    add(aten.pad.default, r(4, 8, 6), [1, 2], "constant", 0.0)
    add(aten.pad.default, r(4, 8, 6), [1, 1], "reflect")
    add(aten.constant_pad_nd.default, r(4, 8, 8), [0, 0, 1, 2], 1.5)
    add(aten.index.Tensor, r(8, 12), [ints(8, 4, 1), ints(12, 1, 8)])              # broadcast indices
    add(aten.index.Tensor, ints(9, 4, 8), [torch.arange(4).view(4, 1, 1, 1), ints(8, 1, 1, 8, 1)])
    add(aten.index.Tensor, r(8, 12, 4), [None, ints(12, 8)])                        # a whole dim first
    add(aten.index.Tensor, r(4, 8, 12), [ints(4, 6), None, ints(12, 6)])           # not adjacent
    add(aten.index.Tensor, r(8, 12), [mask(8)])                                     # a mask: no split
    add(aten.index.Tensor, r(8, 6), [ints(8, 16)])                                  # tokens in experts' order
    add(aten.__and__.Tensor, mask(4, 8, 8), mask(1, 8, 8))

    # -- routing and expert matmuls (moe.py)
    add(aten.topk.default, r(8, 12), 3)
    add(aten.topk.default, r(8, 12), 2, 0, False)
    add(aten.sort.default, r(8, 12))
    add(aten.argsort.default, r(8, 12), 0, True)
    add(aten.sort.stable, ints(4, 8, 12), stable=True, dim=1)
    add(aten.histc.default, r(8, 16), 10, -2, 2)
    add(aten.gather.default, r(8, 12), 1, ints(12, 8, 5))
    add(aten.scatter.src, r(8, 12), 1, r(8, 12).argsort(1)[:, :5], r(8, 5))    # distinct per row
    add(aten.scatter_add.default, r(8, 12), 0, ints(8, 4, 12), r(4, 12))
    add(aten.scatter_add.default, r(8, 12), 0, ints(8, 4, 6), r(4, 12))      # index narrower than src
    add(aten.scatter_add.default, r(8, 12), 0, ints(8, 2, 12), r(4, 12))     # fewer rows: index's split only
    add(aten.scatter_add.default, r(4, 8, 12), 1, ints(8, 4, 16, 12), r(4, 16, 12))
    add(aten.index_add.default, r(8, 12), 0, ints(8, 16), r(16, 12))         # experts' rows back to tokens
    add(aten.index_add.default, r(4, 8, 12), 1, ints(8, 4), r(4, 4, 12), alpha=0.5)
    add(aten.index_add.default, ints(9, 8, 12), 0, ints(8, 4), ints(9, 4, 12))
    add(aten.index_put.default, r(8, 12), [ints(8, 6)], r(6, 12), True)         # accumulate
    add(aten.index_put.default, r(8, 12, 4), [None, r(12).argsort()[:5]], r(5, 4))
    hit = torch.arange(48).reshape(8, 6) % 3 == 0                                 # a 2-d mask covers 2 dims
    add(aten.index_put.default, r(8, 6, 4), [hit], r(4))
    # torch's CPU grouped matmul takes bfloat16 in rows of 16 bytes; values of an eighth keep the
    # rounding of partial sums (bfloat16's 8 bits) within its tolerance's absolute part
    bf16 = torch.bfloat16
    add(aten._grouped_mm.default, (r(16, 32) / 8).to(bf16), (r(4, 32, 32) / 8).to(bf16),
        offs=torch.tensor([3, 8, 8, 16], dtype=torch.int32))

    # -- factories: only all-B
    add(aten.arange.default, 8, dtype=torch.int64)
    add(aten.arange.start_step, 0, 16, 2, dtype=f64)
    add(aten.zeros.default, [4, 8], dtype=f64)
    add(aten.ones.default, [8], dtype=torch.float32)
    add(aten.full.default, [4, 8], 2.5, dtype=f64)
    return C


# ---- command line -----------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoshard.check.validate",
                                 description="check every SBP rule signature numerically on simulated ranks")
    ap.add_argument("-p", type=int, nargs="+", default=[2, 4], help="mesh axis sizes to simulate (default 2 4)")
    ap.add_argument("-v", "--verbose", action="store_true", help="per-op counts and skipped signatures")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    cases = default_cases(ns.seed)
    failed = False
    for p in ns.p:
        rep = validate(cases, p=p, seed=ns.seed)
        print(rep.format(verbose=ns.verbose))
        print()
        failed |= not rep.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
