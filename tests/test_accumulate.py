"""Gradient accumulation with ``ParallelModule.no_sync()``: micro-batches whose backward reduces
no parameter gradient, then one that reduces the sum; the gradients equal one device's
accumulated over the same micro-batches (real gloo groups)."""
import copy

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard import schemes
from autoshard.runtime import steps as runtime_steps
from models import GPT, MLP

DP = {"x": ("S(0)",)} | {n: ("B",) for n, _ in MLP().named_parameters()}
FSDP = ({"x": ("S(0)",)} | {n: ("S(0)",) for n, _ in MLP().named_parameters()}
        | {f"linear{s}": ("S(0)",) for s in ("", "_1", "_2", "_3", "_4")})


class _Counted:
    """Counts the gradient reductions the runtime issues (all-reduces and reduce-scatters)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self.saved = dist.all_reduce, runtime_steps._reduce_scatter

        def count(fn):
            def call(*a, **k):
                self.calls += 1
                return fn(*a, **k)
            return call
        dist.all_reduce, runtime_steps._reduce_scatter = (count(f) for f in self.saved)
        return self

    def __exit__(self, *exc):
        dist.all_reduce, runtime_steps._reduce_scatter = self.saved


def _model(name):
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(vocab=64, d=32, heads=4, layers=2, seq=16)
        micro = []
        for _ in range(3):
            idx = torch.randint(0, 64, (8, 16))
            micro.append((idx, torch.roll(idx, -1, dims=1)))
        return model, micro, lambda m, b: m(*b)
    model = MLP()
    return model, [(torch.randn(8, 32),) for _ in range(3)], lambda m, b: (m(*b) ** 2).sum()


def accumulate_case(name, pin, mesh, overlap):
    """Three micro-batches, the first two under no_sync: the largest gradient difference from
    one device, whether ``param.grad`` stayed empty for the reduced parameters under no_sync, and
    the gradient reductions each no_sync backward issued."""
    model, micro, loss = _model(name)
    ref = copy.deepcopy(model)
    if name == "gpt":
        pin = schemes.megatron(model, micro[0], mesh)   # tensor parallel on the last axis
    elif pin == "hybrid":   # FSDP on the last axis, data parallel on the first
        pin = schemes.fsdp(model, micro[0], mesh, shard=1)
    pm = autoshard.parallelize(model, micro[0], pin=pin, mesh=mesh, overlap=overlap)
    reduced = {n for n, p in pm.named_parameters() if "Replicate()" in str(p.placements) or len(p.placements) > 1}
    counts, empty = [], True
    for b in micro[:2]:
        with pm.no_sync():
            out = loss(pm, b)
        with _Counted() as c:
            out.backward()
        counts.append(c.calls)
        empty &= all(p.grad is None for n, p in pm.named_parameters() if n in reduced and overlap)
    loss(pm, micro[2]).backward()
    for b in micro:
        loss(ref, b).backward()
    refp = dict(ref.named_parameters())
    diff = max(((p.grad.full_tensor() - refp[n].grad).abs().max() / refp[n].grad.abs().max().clamp_min(1e-6)).item()
               for n, p in pm.named_parameters())
    return diff, empty, counts


@pytest.mark.parametrize("name,pin,mesh,overlap", [
    ("mlp", DP, (4,), True), ("mlp", DP, (4,), False), ("mlp", FSDP, (4,), True), ("mlp", FSDP, (4,), False),
    ("mlp", None, (2, 2), True), ("gpt", None, (2, 2), True), ("mlp", "hybrid", (2, 2), True)],
    ids=["dp", "dp-unscheduled", "fsdp", "fsdp-unscheduled", "default-2x2", "megatron-2x2", "hybrid-fsdp-2x2"])
def test_no_sync_accumulates_exactly(world4, name, pin, mesh, overlap):
    for diff, empty, counts in world4.run(accumulate_case, name, pin, mesh, overlap):
        assert diff <= 1e-5, diff
        assert empty
        if name == "mlp" and pin is DP or pin in (FSDP, "hybrid") and overlap:
            # data parallel and bucketed FSDP: nothing reduced until the last micro-batch
            assert counts == [0, 0], counts


def no_sync_alone_case():
    """no_sync is a context: outside it, every backward reduces."""
    model, micro, loss = _model("mlp")
    pm = autoshard.parallelize(model, micro[0], pin=DP)
    with pm.no_sync():
        pass
    loss(pm, micro[0]).backward()
    return all(p.grad is not None for p in pm.parameters())


def test_outside_no_sync_gradients_are_reduced(world4):
    assert all(world4.run(no_sync_alone_case))
