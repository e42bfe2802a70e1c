"""Every SBP rule checked on the sample inputs of PyTorch's OpInfo database (issue 4).

``autoshard.check.validate`` checks each signature a rule offers on simulated ranks; this module
gives it cases from ``op_db``, PyTorch's own table of sample inputs per operator, instead of
hand-written ones. OpInfo entries are torch-level functions (``torch.add``,
``torch.nn.functional.linear``, ``Tensor.view``); the rules are keyed by aten overloads
(``aten.add.Tensor``, ``aten.linear.default``). A sample becomes cases three ways:

* **direct**: the entry names an aten op (its ``aten_name``, its name, the last part of its name,
  or an alias: ``nn.functional.linear`` -> ``aten.linear``). Each rule overload of that op is called
  on the sample's ``(input, *args, **kwargs)``; it is a case when every tensor lands on a tensor
  parameter of the overload's schema (``_binds``: the binding layer would also read a tensor as
  an int list), the call succeeds, and it gives what the OpInfo function gives on the same sample
  (so ``aten.add.Scalar`` is not credited with a sample whose ``other`` is a tensor). This reaches
  the composite ops (``linear``, ``matmul``, ``softmax.int``, ``reshape``) that decompose before
  any dispatch mode sees them.
* **adapted**: a few functions pass their arguments in another order or form than their aten op
  (``torch.where(cond, x, y)`` has the OpInfo input ``x`` first; the losses take
  ``reduction="mean"`` where aten takes an enum). ``ADAPTERS`` rewrites those samples, under the
  same checks.
* **dispatched**: the OpInfo function runs under a ``TorchDispatchMode`` that records every call
  of a rule overload reaching the dispatcher at the top level, with its inputs cloned as they were
  then (``_softmax``, ``_unsafe_view``, ``_to_copy``, ``embedding``, ``where.self``...). Only the
  entries that name a rule op or an adapter, and those in ``DISPATCH_ONLY``, are run: running all
  of ``op_db`` takes longer than the test suite allows.

Each sample is drawn at the first of float64, int64 and bool that the entry supports (float64:
OpInfo's values reach 9 in magnitude, and the random pieces of a partial sum of them do not add up
to float32's tolerance). Cases are deduplicated by their tensors' shapes and dtypes and their other
arguments, and each overload keeps at most ``max_per_op`` (default ``MAX_PER_OP``; direct and
adapted ones first); the report says how many were dropped. OpInfo's sizes are mostly 5 and 10, so
many splits do not divide by p and are counted as not applicable (``-p 5`` checks them).

Not checked: overloads that write an argument (``out=`` and in-place forms, which the planner never
sees in a functional graph) or return no tensor (TorchScript scalar overloads such as ``add.int``),
and ``UNCOMPARABLE`` ops, whose output differs from run to run (random draws, uninitialized memory).

``op_db`` is a private torch API (``torch.testing._internal``, which also needs the ``expecttest``
package); ``_opinfo_samples`` is the only place that touches it or ``TorchDispatchMode``, and it
undoes the freeze of the ``torch.backends`` flags that importing torch's test utilities does. The
overload's schema (``OpOverload._schema``, no public equivalent) is read by ``_checkable`` and
``_binds`` only.

Command line: ``python -m autoshard.check.opinfo [-p 2 4] [-v]`` prints the report per ``p`` and
exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from autoshard.rules.registry import RULES
from autoshard.check.validate import Report, _map_tensors, op_name, tensor_inputs, validate

aten = torch.ops.aten

__all__ = ["ADAPTERS", "Collection", "checkable_ops", "collect", "format_report", "main", "opinfo_cases"]

DTYPES = (torch.float64, torch.int64, torch.bool)  # the first one an entry supports
MAX_PER_OP = 16  # both p in ~30 s on 2 cores, most of it drawing the samples

# outputs that differ from run to run, so no rank can be compared with the whole op
UNCOMPARABLE = {
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
    "dropout", "feature_dropout", "alpha_dropout",
    "empty", "empty_like", "empty_strided", "new_empty",
}

# entries run only for the rule overloads they dispatch to (their own aten op has no rule)
DISPATCH_ONLY = (
    "mT", "narrow", "ravel", "broadcast_to", "column_stack", "hstack", "nn.functional.softmin",
    "nn.functional.interpolate", "nn.functional.upsample_nearest", "nn.functional.upsample_bilinear",
    "__getitem__",   # x[i, j] with index tensors: aten.index.Tensor
)

_REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def _loss(overload, extra: str = ""):
    """F.<loss>(input, target, ..., reduction=str[, extra]) -> aten (input, target, enum[, extra])."""
    def adapt(x, target, *, reduction="mean", **kw):
        tail = (kw.pop(extra),) if extra and extra in kw else ()
        if kw or reduction not in _REDUCTION:
            return None
        return overload, (x, target, _REDUCTION[reduction]) + tail, {}
    return adapt


def _cross_entropy(x, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """F.cross_entropy's arguments -> aten.cross_entropy_loss's."""
    if size_average is not None or reduce is not None or reduction not in _REDUCTION:
        return None
    return (aten.cross_entropy_loss.default,
            (x, target, weight, _REDUCTION[reduction], ignore_index, label_smoothing), {})


def _batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """F.batch_norm's arguments -> aten.batch_norm's (the affine parameters come first there)."""
    return (aten.batch_norm.default,
            (x, weight, bias, running_mean, running_var, training, momentum, eps, False), {})


# OpInfo name -> function of the sample's (input, *args, **kwargs) giving (overload, args, kwargs)
ADAPTERS: dict = {
    "where": lambda x, cond, other: (aten.where.self, (cond, x, other), {}),
    "einsum": lambda operands, eq: (aten.einsum.default, (eq, list(operands)), {}),
    "broadcast_tensors": lambda *ts: (aten.broadcast_tensors.default, (list(ts),), {}),
    "nn.functional.cross_entropy": _cross_entropy,
    "nn.functional.mse_loss": _loss(aten.mse_loss.default),
    "nn.functional.l1_loss": _loss(aten.l1_loss.default),
    "nn.functional.smooth_l1_loss": _loss(aten.smooth_l1_loss.default, "beta"),
    "nn.functional.huber_loss": _loss(aten.huber_loss.default, "delta"),
    "nn.functional.batch_norm": _batch_norm,
    # x & y reaches a traced graph as __and__ (export records it before it decomposes) and the
    # dispatcher as bitwise_and: the same op, checked on bitwise_and's samples
    "bitwise_and": lambda x, other: (aten.__and__.Tensor, (x, other), {}),
    "bitwise_or": lambda x, other: (aten.__or__.Tensor, (x, other), {}),
    "bitwise_xor": lambda x, other: (aten.__xor__.Tensor, (x, other), {}),
}


# ---- which overloads -----------------------------------------------------------------------------

def _packet(op) -> str:
    return op.overloadpacket.__name__


def _checkable(op) -> bool:
    """An aten overload (a higher-order op such as flex_attention has no OpInfo; its rule has its
    cases in ``check.cases``), functional (writes no argument), returning a tensor."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema
    return not schema.is_mutable and any("Tensor" in str(r.type) for r in schema.returns)


def _binds(op, args, kwargs) -> bool:
    """Every tensor of the call is at a tensor parameter of ``op`` (the binding layer would also
    read a tensor as an int list or a number, which is not that overload's use)."""
    params = op._schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    by_name = {a.name: a for a in params}
    if len(args) > len(positional) or not kwargs.keys() <= by_name.keys():
        return False
    pairs = list(zip(positional, args)) + [(by_name[k], v) for k, v in kwargs.items()]
    return all("Tensor" in str(a.type) or not tensor_inputs((v,), {}) for a, v in pairs)


def checkable_ops() -> list:
    """The rule overloads a case can check, in registration order."""
    return [op for op in RULES if _checkable(op) and _packet(op) not in UNCOMPARABLE]


# ---- the private API, in one place ---------------------------------------------------------------

class _Sample(NamedTuple):
    name: str                # OpInfo name
    entry: str               # ... and variant
    aten_names: frozenset    # the aten op names the entry may stand for
    args: tuple              # (input, *args)
    kwargs: dict
    result: object           # the OpInfo function on (args, kwargs)
    dispatched: list         # (overload, args, kwargs) of the rule overloads it dispatched


def _opinfo_samples(names: set, wanted: set, seed: int) -> Iterator[_Sample]:
    """Every sample of the ``op_db`` entries named in ``names`` (their name or any aten name),
    run once under a dispatch mode that records calls of the overloads in ``wanted``."""
    frozen = torch.backends.flags_frozen()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal.common_methods_invocations import op_db
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as e:
        raise RuntimeError(
            "autoshard.check.opinfo needs PyTorch's OpInfo database "
            "(torch.testing._internal.common_methods_invocations), which this torch cannot import: "
            f"{e}. It needs the test-only package expecttest: pip install expecttest") from e
    if not frozen:  # torch's test utilities freeze the torch.backends flags of the whole process
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in wanted:  # cloned now: a later in-place op may change the tensors
                self.calls.append((func, *_map_tensors((args, kwargs), torch.Tensor.clone)))
            return func(*args, **kwargs)

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        for info in op_db:
            aten_names = frozenset({info.name, info.name.rsplit(".", 1)[-1], info.aten_name}
                                   | {a.name for a in info.aliases})
            if not (aten_names & names or info.name in names):
                continue
            supported = info.supported_dtypes("cpu")
            dtype = next((d for d in DTYPES if d in supported), None)
            if dtype is None:
                continue
            entry = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
            try:
                samples = list(info.sample_inputs("cpu", dtype))
            except Exception:  # noqa: BLE001 - an entry this build cannot sample gives no case
                continue
            for s in samples:
                args, kwargs = (s.input, *s.args), dict(s.kwargs)
                rec = Record()
                try:
                    with rec:
                        result = info.op(*args, **kwargs)
                except Exception:  # noqa: BLE001 - a sample this build cannot run gives no case
                    continue
                yield _Sample(info.name, entry, aten_names, args, kwargs, result, rec.calls)


# ---- cases -----------------------------------------------------------------------------------------

@dataclass
class Collection:
    cases: list = field(default_factory=list)        # (overload, args, kwargs)
    sources: dict = field(default_factory=dict)      # "direct" | "adapted" | "dispatched" -> cases kept
    capped: dict = field(default_factory=dict)       # op name -> distinct cases dropped by max_per_op
    entries: set = field(default_factory=set)        # OpInfo entries that gave a case
    max_per_op: int = MAX_PER_OP
    seconds: float = 0.0


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
            return False
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError:
            return False
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return False


def _key(op, args, kwargs) -> tuple:
    def describe(t):
        return ("T", tuple(t.shape), t.dtype, t.layout)
    return op, repr(_map_tensors((args, kwargs), describe))


def _plain(args, kwargs) -> bool:
    """Dense real tensors only: the validator splits with narrow and cat."""
    return all(t.layout == torch.strided and not t.is_quantized and not t.is_complex()
               for t in tensor_inputs(args, kwargs))


def collect(max_per_op: int = MAX_PER_OP, seed: int = 0) -> Collection:
    """The validator cases of every checkable rule overload from OpInfo's samples, with where they
    came from."""
    start = time.perf_counter()
    ops = checkable_ops()
    by_packet: dict = {}
    for op in ops:
        by_packet.setdefault(_packet(op), []).append(op)
    named = set(by_packet) | set(ADAPTERS) | set(DISPATCH_ONLY)

    found = {"direct": [], "adapted": [], "dispatched": []}
    for s in _opinfo_samples(named, set(ops), seed):
        for name in s.aten_names & by_packet.keys():
            for op in by_packet[name]:
                if not _binds(op, s.args, s.kwargs):
                    continue
                try:
                    ok = _same(op(*s.args, **s.kwargs), s.result)
                except Exception:  # noqa: BLE001 - the sample does not bind to this overload
                    ok = False
                if ok:
                    found["direct"].append((s.entry, op, s.args, s.kwargs))
        adapter = ADAPTERS.get(s.name)
        if adapter is not None:
            try:
                case = adapter(*s.args, **s.kwargs)
                ok = case is not None and _binds(*case) and _same(case[0](*case[1], **case[2]), s.result)
            except Exception:  # noqa: BLE001 - the adapter does not fit this sample
                ok = False
            if ok:
                found["adapted"].append((s.entry, *case))
        for call in s.dispatched:
            found["dispatched"].append((s.entry, *call))

    col = Collection(max_per_op=max_per_op)
    seen: set = set()
    kept: dict = {}
    for source in ("direct", "adapted", "dispatched"):
        col.sources[source] = 0
        for entry, op, args, kwargs in found[source]:
            if not _plain(args, kwargs):
                continue
            key = _key(op, args, kwargs)
            if key in seen:
                continue
            seen.add(key)
            if kept.get(op, 0) >= max_per_op:
                col.capped[op_name(op)] = col.capped.get(op_name(op), 0) + 1
                continue
            kept[op] = kept.get(op, 0) + 1
            col.cases.append((op, tuple(args), dict(kwargs)))
            col.sources[source] += 1
            col.entries.add(entry)
    col.seconds = time.perf_counter() - start
    return col


def opinfo_cases(max_per_op: int = MAX_PER_OP, seed: int = 0) -> list:
    """Validator cases ``(overload, args, kwargs)`` from the OpInfo samples of the rule overloads."""
    return collect(max_per_op, seed).cases


# ---- report ----------------------------------------------------------------------------------------

def format_report(col: Collection, rep: Report, verbose: bool = False) -> str:
    ops = checkable_ops()
    sampled = {op_name(c[0]) for c in col.cases}
    missing = sorted(op_name(op) for op in ops if op_name(op) not in sampled)
    lines = [
        f"autoshard rules on PyTorch OpInfo samples, one mesh axis of size p={rep.p}",
        (f"  ops with a rule:      {len(ops)} checkable overloads ({len(RULES)} registered; out=, in-place, "
         "scalar-only and random ones left out)"),
        (f"  ops with samples:     {len(sampled)}, {len(col.cases)} cases from {len(col.entries)} OpInfo "
         f"entries ({', '.join(f'{n} {k}' for k, n in col.sources.items())}); at most {col.max_per_op} "
         f"per op, {sum(col.capped.values())} more dropped"),
    ]
    lines += rep.format(verbose).splitlines()[1:]
    if verbose:
        lines.append("  distinct cases dropped by the cap: "
                     + ", ".join(f"{op} {n}" for op, n in sorted(col.capped.items())))
        lines.append(f"  not comparable (random or uninitialized output): {', '.join(sorted(UNCOMPARABLE))}")
    lines.append(f"  rule ops with no OpInfo sample ({len(missing)}): " + ", ".join(missing))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoshard.check.opinfo",
                                 description="check every SBP rule signature on PyTorch's OpInfo samples")
    ap.add_argument("-p", type=int, nargs="+", default=[2, 4], help="mesh axis sizes to simulate (default 2 4)")
    ap.add_argument("-v", "--verbose", action="store_true", help="per-op counts and skipped signatures")
    ap.add_argument("--max-per-op", type=int, default=MAX_PER_OP, help="distinct cases kept per overload")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    col = collect(ns.max_per_op, ns.seed)
    print(f"collected {len(col.cases)} cases in {col.seconds:.1f} s\n")
    failed = False
    for p in ns.p:
        start = time.perf_counter()
        rep = validate(col.cases, p=p, seed=ns.seed)
        print(format_report(col, rep, ns.verbose))
        print(f"  ({time.perf_counter() - start:.1f} s)\n")
        failed |= not rep.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
