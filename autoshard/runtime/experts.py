"""What the emitted program calls for expert layers (``rules.moe``): the grouped matmul on this
rank's rows and experts, with expert parallelism's all-to-all; the rows of a split tensor taken
by a whole index (the tokens sent to their experts' order and back), by all-to-all; and a
histogram of integers.

The grouped matmul multiplies the rows of each expert, ``x[start(e):end(e)]``, by its weight
``w[e]``, where end(e) = offs[e] and start(e) = offs[e-1] (0 for the first): the rows come
sorted by expert. A rank holds a contiguous chunk of the rows (x split on dim 0 over
``row_axes``) and a contiguous chunk of the experts (w split on dim 0 over ``expert_axes``).
Since offs is whole on every rank, each rank knows which of its rows belong to which rank's
experts:

* over axes that split only the rows, a rank multiplies its own rows by their experts' weights;
* over axes that split only the experts, it multiplies its experts' rows and leaves the others'
  zero: the output is a partial sum there;
* over axes that split both (expert parallelism), the ranks of the group exchange rows: each
  sends every member the rows of that member's experts, multiplies what it received by its own
  experts' weights and sends the products back, two ``all_to_all_single`` with per-rank split
  sizes (the sizes sent and received, from offs); in backward the same exchanges run reversed.

Rows past offs[-1] (tokens routed to no expert) come out zero.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.rules.moe import chunk_of, group_members
from autoshard.runtime.mesh import _mesh


def _overlap(a, b) -> tuple:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else (lo, lo)


def exchange_plan(ends, coords, shape, row_axes, expert_axes, n_rows, n_experts) -> tuple:
    """(my rows, my experts, the global row range sent to each member, the range received from
    each), rows as [lo, hi) of the whole sorted rows, experts as [first, last + 1)."""
    both = tuple(a for a in row_axes if a in expert_axes)

    def rows_of(c):
        lo = chunk_of(c, shape, row_axes) * n_rows
        return lo, lo + n_rows

    def experts_of(c):
        lo = chunk_of(c, shape, expert_axes) * n_experts
        return lo, lo + n_experts

    def expert_rows(c):
        e0, e1 = experts_of(c)
        return (ends[e0 - 1] if e0 else 0), ends[e1 - 1]

    members = group_members(coords, shape, both)
    sent = [_overlap(rows_of(coords), expert_rows(c)) for c in members]
    received = [_overlap(rows_of(c), expert_rows(coords)) for c in members]
    return rows_of(coords), experts_of(coords), sent, received


def _multiply(x, w, ends, first_row, experts) -> torch.Tensor:
    """The products of ``x`` (the rows from ``first_row`` on, all of experts ``experts``) by
    those experts' weights ``w`` (local: w[0] is expert experts[0])."""
    pieces = []
    lo, hi = first_row, first_row + x.shape[0]
    for e in range(*experts):
        start, end = _overlap((lo, hi), ((ends[e - 1] if e else 0), ends[e]))
        if end > start:
            pieces.append(x[start - lo:end - lo] @ w[e - experts[0]])
    if not pieces:
        # none of these rows is of these experts: zeros, still computed from x and w, so that
        # backward reaches this rank's exchanges and its weights' gradient as on every other
        # rank (a rank whose experts got no rows would otherwise skip the collectives of
        # backward that the others wait in)
        return x.new_zeros((x.shape[0], w.shape[-1])) + (x[:0] @ w[0]).sum()
    return torch.cat(pieces)


def _placed(pieces, n_rows, first_row, like) -> torch.Tensor:
    """Rows [first_row, first_row + n_rows) with each (global lo, tensor) piece in its place,
    zeros elsewhere. Empty pieces are kept (at the end, adding no row): the result is computed
    from every piece, so backward runs through each on every rank."""
    parts, at = [], first_row
    empty = [t for _, t in pieces if t.shape[0] == 0]
    for lo, t in sorted(((lo, t) for lo, t in pieces if t.shape[0]), key=lambda p: p[0]):
        if lo > at:
            parts.append(like.new_zeros((lo - at, like.shape[1])))
        parts.append(t)
        at = lo + t.shape[0]
    if at < first_row + n_rows:
        parts.append(like.new_zeros((first_row + n_rows - at, like.shape[1])))
    parts += empty
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class _Exchange(torch.autograd.Function):
    """all_to_all_single with per-rank split sizes; backward sends the gradients back the way
    the rows came."""

    @staticmethod
    def forward(ctx, x, sent, received, group):
        ctx.args = (sent, received, group)
        out = x.new_empty((sum(received),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        sent, received, group = ctx.args
        return _Exchange.apply(g.contiguous(), received, sent, group), None, None, None


def grouped_mm(x, w, offs, row_axes: tuple, expert_axes: tuple, axis: tuple = (), out_dtype=None):
    """This rank's part of the grouped matmul of x (rows, k) by w (experts, k, n) at offsets
    offs (experts,): see the module docstring. ``axis``: the axes that split both the rows and
    the experts, over which rows are exchanged."""
    m = _mesh()
    ends = [int(e) for e in offs.tolist()]
    n_experts = w.shape[0]
    mine, experts, sent, received = exchange_plan(ends, m.coords, m.shape, row_axes, expert_axes,
                                                  x.shape[0], n_experts)
    both = tuple(axis)
    out_dtype = out_dtype or x.dtype
    x = x.to(w.dtype)
    if not both:
        lo, hi = sent[0]
        y = _multiply(x[lo - mine[0]:hi - mine[0]], w, ends, lo, experts)
        template = y.new_empty((0, y.shape[1]))
        return _placed([(lo, y)], x.shape[0], mine[0], template).to(out_dtype)
    group = m.group(both)
    send_sizes = [hi - lo for lo, hi in sent]
    recv_sizes = [hi - lo for lo, hi in received]
    outgoing = torch.cat([x[lo - mine[0]:hi - mine[0]] for lo, hi in sent])
    incoming = _Exchange.apply(outgoing, send_sizes, recv_sizes, group)
    products = [_multiply(part, w, ends, lo, experts)
                for part, (lo, _) in zip(incoming.split(recv_sizes), received)]
    products = torch.cat(products) if products else incoming.new_zeros((0, w.shape[-1]))
    back = _Exchange.apply(products, recv_sizes, send_sizes, group)
    pieces = [(lo, t) for (lo, _), t in zip(sent, back.split(send_sizes))]
    return _placed(pieces, x.shape[0], mine[0], back[:0]).to(out_dtype)


def gather_rows(x, index, axis: tuple):
    """``x[index]`` for x split on dim 0 over ``axis`` and index (1-d) whole over those axes:
    this rank's chunk of the index's positions, each row sent by the rank that holds it
    (all-to-all with per-rank split sizes, which every rank reads off the index). The index may
    be split by axes before ``axis`` (never after: ``rules.indexing.index``), which the members
    of this rank's group share: the chunk it takes of its own chunk is then its chunk of the
    output."""
    m = _mesh()
    group, p, me = m.group(axis), m.size(axis), m.coord(axis)
    n = x.shape[0]
    index = index.remainder(n * p)
    owner = torch.div(index, n, rounding_mode="floor")
    chunks = index.chunk(p)
    owners = owner.chunk(p)
    mine = owners[me]
    # to each member, the rows of its positions that this rank holds, in their order
    sent = [chunks[q][owners[q] == me] - me * n for q in range(p)]
    sent_sizes = [len(t) for t in sent]
    received_sizes = torch.bincount(mine, minlength=p).tolist()
    incoming = _Exchange.apply(x[torch.cat(sent)], sent_sizes, received_sizes, group)
    # received grouped by sender: put each row back at its position
    order = torch.argsort(mine, stable=True)
    return incoming[torch.argsort(order)]


def histc(x, bins: int = 100, min=0, max=0):
    """torch.histc, for integers too: a model captured on the meta device may take the branch
    it takes on GPUs (transformers' experts histogram their int32 expert ids there), which the
    CPU kernel refuses; counted in float32 (exact up to 2**24) and returned in x's dtype."""
    if x.dtype.is_floating_point:
        return torch.histc(x, bins, min, max)
    return torch.histc(x.float(), bins, min, max).to(x.dtype)
