"""Numerical check of the SBP rules (DESIGN.md section 7).

For every case ``(op_overload, args, kwargs)`` (real tensors in ``args``/``kwargs``) and every
one-axis signature the op's rule offers, plus the implicit all-broadcast one, the ``p`` ranks of
one mesh axis are simulated in this process:

* each rank's local inputs are made from the whole ones as the signature says: ``S(d)`` chunk r of
  dim d, ``B`` the whole tensor, ``P`` random pieces that sum to the whole tensor;
* the op runs on each rank's inputs through the rewriter's own lowering
  (``autoshard.passes.rewrite.LOWERINGS``: the size argument of view/reshape/_unsafe_view/expand
  and the sizes of unflatten become the local output shape, a mean left partial over a split dim is
  scaled by 1/p, causal attention on a part of the sequence masked from the rank's first query
  on, ...), executed eagerly instead of being emitted into a graph;
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
checked by tests/test_moe.py in a real group. A cumsum along a split dim and the split 1-d sort
of integer keys (``runtime.scans``: collectives over the axis) are checked here, in a simulated
group of ``p`` ranks (``autoshard.testing.simulate``), each rank running its lowering on a thread
with a one-axis mesh active (``IN_A_GROUP``). A sort asked for no stability may order equal keys
any way: its indices are checked to be a permutation that orders the keys as the whole op's does
(``UNSTABLE_SORTS``).

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
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh

from autoshard import placement as pl
from autoshard.passes import rewrite
from autoshard.placement import B, Broadcast, Partial, Split
from autoshard.rules.moe import sort_args
from autoshard.rules.registry import RULES, OpCtx, Sig, norm_dim, rule_for
from autoshard.rules.conv import batch_norm_axes
from autoshard.rules.nn import count_axes
from autoshard.check.cases import default_cases
from autoshard.runtime.mesh import RankMesh, active
from autoshard.testing.simulate import SimWorld

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


# lowerings whose local form runs collectives that the ranks of one simulated group can run
# (autoshard.testing.simulate): checked there, each rank on a thread with a one-axis mesh active
IN_A_GROUP = {rewrite.lower_cumsum, rewrite.lower_sort}


def _in_group(run_rank, p: int):
    mesh = RankMesh(init_device_mesh("cpu", (p,)), torch.Generator())
    with active(mesh):
        return run_rank(dist.get_rank())


# the lowerings whose local form needs a process group
def _runtime_lowered(target, fx_args, fx_kwargs, sig: Sig) -> Optional[str]:
    if target in (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default):
        return "dropout draws from the generator all ranks share (runtime.dropout)"
    if target == aten.scaled_dot_product_attention.default and (
            fx_args[4] if len(fx_args) > 4 else fx_kwargs.get("dropout_p", 0.0)):
        return "attention dropout draws from the generator all ranks share (runtime.attention_dropout)"
    if count_axes(target, fx_args, fx_kwargs, [(q,) for q in sig.inputs]):
        return "mean cross_entropy over a split batch all-reduces its count (runtime.cross_entropy_mean)"
    if rewrite.lowering_for(target) is rewrite.lower_grouped_mm and any(
            isinstance(q, Split) and q.dim == 0 for q in sig.inputs[:2]):
        return "an expert matmul on a rank's rows or experts reads its coordinate (experts.grouped_mm)"
    if target == aten.index.Tensor and sig.inputs[0] == Split(0) and fx_args[1][0] is not None:
        return "rows of a split tensor at a whole index come by all-to-all (experts.gather_rows)"
    if target == aten.scaled_dot_product_attention.default and len(sig.inputs) > 1 and \
            sig.inputs[1] == Split(fx_args[1].meta["val"].dim() - 2):
        return "ring attention passes the keys and values round the ranks (runtime.ring_attention)"
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

    def run_rank(r):
        local_ins = [_local_input(t, q, p, pc, r) for t, q, pc in zip(ins, sig.inputs, pieces)]
        largs, lkwargs = _substitute(args, kwargs, local_ins)
        low = rewrite.Lowering(_EagerGraph(), node, largs, lkwargs, in_pl, out_pl, in_shapes, out_shapes, (p,),
                               coords=(r,))
        try:
            return _outputs(lower(low))
        except Exception as e:  # noqa: BLE001 - a local op that cannot run is a wrong signature
            return f"rank {r}: the local op raised {type(e).__name__}: {e}"

    if lower in IN_A_GROUP and any(isinstance(q, Split) for q in sig.inputs):
        try:
            locals_ = SimWorld(p, timeout_s=60.0).run(_in_group, run_rank, p)
        except (RuntimeError, TimeoutError) as e:
            return "fail", f"the ranks' collectives failed: {e}"
    else:
        locals_ = [run_rank(r) for r in range(p)]   # per rank, its list of output tensors (or why not)
    for r, lo in enumerate(locals_):
        if isinstance(lo, str):
            return "fail", lo
        if len(lo) != len(outs):
            return "fail", f"rank {r}: the local op gave {len(lo)} tensor outputs, the whole op {len(outs)}"

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
            if UNSTABLE_SORTS.get(target) == j:
                got = _as_ordered(got, ref, ins[0], norm_dim(sort_args(target, args, kwargs)[0], ins[0].dim()))
            torch.testing.assert_close(got, ref, equal_nan=True, **tol,
                                       msg=lambda m: f"output {j} ({q!r}) combined differs from the whole op: {m}")
        except AssertionError as e:
            return "fail", str(e)
    return "ok", ""


# a sort asked for no stability may order equal keys any way (the CPU's kernel does not keep them
# in order past 16 elements; runtime.scans.sort does): its indices output (by position) is right
# where it is a permutation that orders the keys as the whole op's does
UNSTABLE_SORTS = {aten.sort.default: 1, aten.argsort.default: 0}


def _as_ordered(got, ref, keys, dim: int):
    """``ref`` where ``got`` orders ``keys`` along ``dim`` as ``ref`` does, else ``got``."""
    if not keys.dim() or got.shape != ref.shape or not torch.equal(got.sort(dim).values, ref.sort(dim).values):
        return got    # not a permutation: compared as it is, and fails
    return ref if torch.equal(keys.take_along_dim(got, dim), keys.take_along_dim(ref, dim)) else got


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
