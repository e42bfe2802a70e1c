"""Scans and sorts along a split dim: what the emitted program calls for a ``cumsum`` along a dim
split over some mesh axes (``rules.indexing.cumsum``) and for the 1-d ``sort`` or ``argsort`` of
integer keys split on its only dim (``rules.moe.sort``: the routing's order of the (token,
expert) pairs).

A dim split over axes ``A`` lies in chunks ordered by the ranks' coordinates on ``A`` flattened
in axis order (``RankMesh.coord``); the ranks of one group over ``A`` hold the chunks, every
group alike. Chunks may be uneven: each rank's sizes come from what it holds, or from what the
group gathered, never from the whole shape.

cumsum: this rank's chunk of the running sum is its local running sum plus the totals of the
earlier ranks' chunks, one slice per rank all-gathered (its bytes: the tensor with the dim cut
to 1). Backward is the running sum taken from the other end, likewise: the local reversed sum
plus the later ranks' totals of the gradient.

sort: a counting sort across the group, stable (a sort asked for no stability may order ties any
way; this one keeps them in order). Each rank counts its keys per value (a histogram over the
keys' range) and the histograms are all-gathered. An element of key ``b`` on rank ``q`` then
stands in the global stable order at (the elements of smaller keys) + (those of key ``b`` on
ranks before ``q``) + (its place among equal keys on ``q``, from a local stable sort). Each rank
sends each (position, global index) pair to the rank that holds that position of the output,
one all-to-all whose split sizes every rank reads off the histograms, and places what it
receives; the sorted keys need no traffic (each key's run of positions is known from the
histograms). Integer keys carry no gradient.

The keys' range is found at run time, by one all-gather of each rank's (min, max, count): three
integers a rank, one collective's latency, where proving it at planning would cover only keys
traced to their source (top-k's indices; ``rules.moe.key_range``, which prices the histograms).
Where the range is wider than the group's elements (keys that are not small integers), the
histograms would outweigh the keys: the keys are all-gathered and sorted whole instead, every
rank taking the same branch (it reads the same gathered ranges).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.runtime import steps
from autoshard.runtime.mesh import _mesh


def _gathered(t: torch.Tensor, group, p: int) -> torch.Tensor:
    """Every rank's ``t`` stacked on a new dim 0, in the group's order."""
    out = t.new_empty((p * t.numel(),))
    steps._all_gather(out, t.reshape(-1).contiguous(), group=group)
    return out.view((p,) + tuple(t.shape))


class _SplitCumsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, dtype, axes):
        m = _mesh()
        group, p, me = m.group(axes), m.size(axes), m.coord(axes)
        ctx.dim, ctx.axes, ctx.x_dtype = dim, axes, x.dtype
        ctx.group, ctx.p, ctx.me = group, p, me
        y = torch.cumsum(x, dim, dtype=dtype)
        totals = _gathered(x.sum(dim, keepdim=True, dtype=y.dtype), group, p)
        return y + totals[:me].sum(0, dtype=y.dtype)

    @staticmethod
    def backward(ctx, g):
        dim = ctx.dim
        local = g.flip(dim).cumsum(dim).flip(dim)
        totals = _gathered(g.sum(dim, keepdim=True), ctx.group, ctx.p)
        return (local + totals[ctx.me + 1:].sum(0)).to(ctx.x_dtype), None, None, None


def cumsum(x: torch.Tensor, dim: int, dtype=None, *, axis: tuple) -> torch.Tensor:
    """``torch.cumsum(x, dim, dtype=dtype)`` of the whole tensor, this rank's chunk, for ``x``
    split on ``dim`` over the mesh axes ``axis``."""
    return _SplitCumsum.apply(x, dim, dtype, tuple(axis))


def sort(keys: torch.Tensor, descending: bool = False, *, axis: tuple, values: bool = False):
    """``torch.sort(keys, stable=True, descending=descending)`` of the whole 1-d integer ``keys``,
    this rank's chunk of it, for ``keys`` split over the mesh axes ``axis``: the indices, or (the sorted
    keys, the indices) with ``values``."""
    m = _mesh()
    group, p, me = m.group(axis), m.size(axis), m.coord(axis)
    k = keys.long()
    if descending:   # ties keep their order: a stable ascending sort of the negated keys
        k = -k
    n = k.shape[0]
    lo, hi = (k.min(), k.max()) if n else (k.new_tensor(0), k.new_tensor(-1))
    ranges = _gathered(torch.stack([lo, hi, k.new_tensor(n)]), group, p).tolist()
    counts = [c for _, _, c in ranges]
    before = sum(counts[:me])
    held = [r for r in ranges if r[2]]
    first, last = (min(r[0] for r in held), max(r[1] for r in held)) if held else (0, -1)
    if last - first + 1 > sum(counts):
        whole, order = _sorted_whole(k, counts, group, p)
        order, sorted_keys = order[before:before + n], whole[order[before:before + n]]
    else:
        order, sorted_keys = _counting_sort(k, first, last - first + 1, counts, before, group, p, me)
    if not values:
        return order
    return (-sorted_keys if descending else sorted_keys).to(keys.dtype), order


def _counting_sort(k, first: int, bins: int, counts: list, before: int, group, p: int, me: int) -> tuple:
    """(this rank's chunk of the stable argsort's global indices, of the sorted keys) of keys
    ``k`` in [first, first + bins): the module docstring's counting sort."""
    n = k.shape[0]
    hist = torch.bincount(k - first, minlength=bins)
    hists = _gathered(hist, group, p)                       # (p, bins)
    total = hists.sum(0)
    ends = total.cumsum(0)
    smaller = ends - total                                   # elements of smaller keys
    earlier = hists[:me].sum(0)                              # of equal keys, on earlier ranks
    order = torch.argsort(k, stable=True)
    b = k[order] - first
    local_start = hist.cumsum(0) - hist                      # where each key starts in the local order
    at = smaller[b] + earlier[b] + torch.arange(n, device=k.device) - local_start[b]
    # the output is split as the keys are: rank q holds positions [starts[q], starts[q] + counts[q])
    starts = [sum(counts[:q]) for q in range(p)]
    bounds = torch.tensor(starts[1:], dtype=torch.long, device=k.device)
    sent = torch.bincount(torch.bucketize(at, bounds, right=True), minlength=p).tolist()
    received = _received(hists, smaller, before, n, p)
    pairs = torch.stack([at, order + before], 1)             # positions rise with the sorted order
    incoming = pairs.new_empty((sum(received), 2))
    dist.all_to_all_single(incoming, pairs.contiguous(), received, sent, group=group)
    out = k.new_empty((n,))
    out[incoming[:, 0] - before] = incoming[:, 1]
    # the key at each of this rank's positions: the one whose run of positions holds it
    mine = torch.arange(before, before + n, device=k.device)
    return out, torch.bucketize(mine, ends, right=True) + first


def _received(hists, smaller, lo: int, n: int, p: int) -> list:
    """How many of each rank's positions fall in [lo, lo + n): rank q's elements of key b stand
    at [smaller[b] + (those of b on ranks before q), + hists[q, b])."""
    start = smaller.unsqueeze(0) + hists.cumsum(0) - hists
    end = start + hists
    return (end.clamp(lo, lo + n) - start.clamp(lo, lo + n)).sum(1).tolist()


def _sorted_whole(k, counts, group, p) -> tuple:
    """(every rank's keys together, their stable argsort), on every rank: the keys all-gathered
    (padded to the largest chunk)."""
    width = max(counts)
    padded = torch.cat([k, k.new_zeros((width - k.shape[0],))])
    whole = torch.cat([row[:c] for row, c in zip(_gathered(padded, group, p), counts)])
    return whole, torch.argsort(whole, stable=True)
