"""Ring attention: attention with the queries, keys and values all split along the sequence, the
keys and values passed round the ranks that split them, each block of keys attended to as it
arrives and the blocks' partial outputs merged by their log-sum-exp (exact: softmax over the
union of the blocks).

Where the keys are split over several mesh axes the ring runs as an odometer: the innermost axis
turns a full round for each step of the next. Forward sends each block ``p - 1`` times in all,
the next block's transfer started before this block is computed. Backward passes the blocks round
again in the same order with the gradients of the keys and values travelling beside them, and
one last send takes each block's gradients home. Only this rank's queries, keys, values, output
and log-sum-exp are kept for backward, not the blocks it saw.

An attention mask (boolean or additive, any shape that broadcasts) comes with its rows split as
the queries are and its columns whole: each block of keys is attended with the mask's columns of
that block, cut on this rank, so nothing of the mask travels; an additive mask that needs a
gradient gets it block by block. A row that no key of a block may see leaves that block out of
its log-sum-exp, a block no row may see is not computed, and a row that sees no key at all
gives zeros, as one device does.

Causal work is balanced (both forms) by a swap: rank r of the axis that splits the queries gives
the second half of its queries to rank p - 1 - r and takes that rank's, so each holds a head and
a tail of the sequence (chunks 2r and 2p - 1 - 2r of 2p); each half attends only the keys its
positions see, and the outputs' halves are swapped back. Nothing else in the program moves: the
swap is exact wherever positions are computed, and costs half the queries and half the output in
forward, their gradients in backward.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard import _compat
from autoshard.cost.attention import turns
from autoshard.runtime.mesh import _mesh


class _Ring:
    """The ring over ``axes``: this rank's coordinates, the global rank of a coordinate, and the
    odometer's steps (which axis turns before each block)."""

    def __init__(self, axes: tuple):
        m = _mesh()
        self.axes = tuple(axes)
        self.shape = m.shape
        self.coords = tuple(m.coords)
        self.ranks = m.device_mesh.mesh

    def rank_of(self, coords) -> int:
        return int(self.ranks[tuple(coords)])

    def moved(self, coords, axis: int, by: int) -> tuple:
        c = list(coords)
        c[axis] = (c[axis] + by) % self.shape[axis]
        return tuple(c)

    def turns(self) -> list:
        """The axis that turns before each block after the first (the odometer: innermost axis
        fastest), len = blocks - 1: as the price counts them (``cost.attention.turns``)."""
        return turns(self.axes, self.shape)

    def start_shift(self, tensors, axis: int) -> tuple:
        """Send ``tensors`` one step along ``axis`` and receive the previous rank's: (received,
        handles to wait on)."""
        to = self.rank_of(self.moved(self.coords, axis, 1))
        frm = self.rank_of(self.moved(self.coords, axis, -1))
        return self._exchange(tensors, to, frm)

    @staticmethod
    def _exchange(tensors, to: int, frm: int) -> tuple:
        got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), to) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, frm) for g in got]
        return got, dist.batch_isend_irecv(ops)

    def send_home(self, tensors, held: tuple) -> list:
        """Each rank holds the block of coordinates ``held``: send it to its owner, receive this
        rank's own from whoever holds it."""
        if held == self.coords:
            return list(tensors)
        offset = [h - c for h, c in zip(held, self.coords)]
        holder = tuple((c - o) % n for c, o, n in zip(self.coords, offset, self.shape))
        got, works = self._exchange(tensors, self.rank_of(held), self.rank_of(holder))
        for w in works:
            w.wait()
        return got


class _SwapHalf(torch.autograd.Function):
    """The second half of ``x`` along ``dim`` exchanged with rank ``partner``'s; its own backward
    (the gradients of the rows received go back where the rows came from)."""

    @staticmethod
    def forward(ctx, x, dim: int, partner: int):
        ctx.args = (dim, partner)
        return _swap(x, dim, partner)

    @staticmethod
    def backward(ctx, grad):
        return _swap(grad, *ctx.args), None, None


def _swap(x, dim: int, partner: int):
    if partner == dist.get_rank():
        return x
    h = x.shape[dim] // 2
    tail = x.narrow(dim, h, x.shape[dim] - h).contiguous()
    got, works = _Ring._exchange([tail], partner, partner)
    for w in works:
        w.wait()
    return torch.cat([x.narrow(dim, 0, h), got[0]], dim)


def partner_of(axis: int) -> int:
    """The global rank of this rank's balancing partner on ``axis`` (coordinate p - 1 - c)."""
    m = _mesh()
    c = list(m.coords)
    c[axis] = m.shape[axis] - 1 - c[axis]
    return int(m.device_mesh.mesh[tuple(c)])


def balanced_attention(q, k, v, scale, enable_gqa: bool, start: int, partner_start: int, axis: int, attn_mask=None):
    """Causal attention, keys and values whole, of this rank's queries (their first at ``start``)
    with the causal work balanced: the second half of the queries swapped with the partner's on
    ``axis`` (whose first is at ``partner_start``), each half attending the keys up to its own last
    position, the output's halves swapped back. A mask's rows (where it has them) are swapped as
    the queries are; its columns are every key's."""
    partner = partner_of(axis)
    h = q.shape[-2] // 2
    mixed = _SwapHalf.apply(q, q.dim() - 2, partner)
    user = _rows_swapped(_additive(attn_mask, q.dim()), partner)
    # (first row, rows, first position) of the two halves this rank now computes
    segments = ((0, h, start), (h, q.shape[-2] - h, partner_start + h))
    outs = []
    for row, n, first in segments:
        seen = first + n
        rows = torch.arange(first, seen, device=q.device)
        mask = torch.arange(seen, device=q.device) <= rows[:, None]
        if user is not None:
            block = user if user.shape[-2] == 1 else user.narrow(-2, row, n)
            block = block if block.shape[-1] == 1 else block.narrow(-1, 0, seen)
            mask = block.to(q.dtype).masked_fill(~mask, float("-inf"))
        outs.append(F.scaled_dot_product_attention(
            mixed.narrow(-2, row, n), k.narrow(-2, 0, seen), v.narrow(-2, 0, seen), attn_mask=mask,
            scale=scale, enable_gqa=enable_gqa))
    return _SwapHalf.apply(torch.cat(outs, -2), q.dim() - 2, partner)


def _rows_swapped(mask, partner: int):
    """A mask's second half of rows exchanged with the partner's, as the queries are; one that
    broadcasts its rows (or None) as it is."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    return _SwapHalf.apply(mask, mask.dim() - 2, partner)


def _block_mask(first: int, n: int, k_start: int, m: int, causal: bool, device):
    """(first row that sees the block, additive mask or None) of ``n`` queries from position
    ``first`` against ``m`` keys from ``k_start``; None where no row sees the block."""
    if not causal:
        return 0, None
    row = max(0, k_start - first)
    if row >= n:
        return None
    if k_start + m - 1 <= first + row:   # every key seen by every row from ``row`` on
        return row, None
    rows = torch.arange(first + row, first + n, device=device)
    hidden = torch.arange(k_start, k_start + m, device=device) > rows[:, None]
    return row, torch.zeros(hidden.shape, device=device).masked_fill(hidden, float("-inf"))


def _finite(x):
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _heads(x, group: int):
    """Key/value heads repeated for their group of query heads (the fused block wants equal heads)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _grouped(dx, group: int):
    """A gradient of repeated key/value heads summed back to one per head."""
    return dx if group == 1 else dx.unflatten(1, (-1, group)).sum(2)


def _user_block(mask, rows: slice, k_start: int, m: int):
    """The block of the (additive, four-dim) mask for ``rows`` of this rank's queries and the ``m``
    keys from ``k_start``: rows and columns of size 1 broadcast."""
    if mask is None:
        return None
    if mask.shape[-2] > 1:
        mask = mask[..., rows, :]
    return mask if mask.shape[-1] == 1 else mask.narrow(-1, k_start, m)


def _combined(causal_mask, user_mask):
    if user_mask is None:
        return causal_mask
    return user_mask if causal_mask is None else user_mask + causal_mask


def _dead(mask, lse_shape):
    """The rows (of ``lse_shape``) for which every key of the block is masked, or None."""
    if mask is None:
        return None
    return torch.isneginf(mask).all(-1).expand(lse_shape)


def _hidden(mask, block) -> bool:
    """Whether a user's ``mask`` hides every key of this ``block`` from every row (a sliding
    window's blocks far from the diagonal): read off the mask, the same on forward and backward."""
    return mask is not None and bool(torch.isneginf(block).all())


def _reduced(grad, shape):
    """``grad`` summed over the dims it was broadcast along to ``shape``."""
    dims = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g > 1)
    return grad.sum(dims, keepdim=True) if dims else grad


class _RingAttention(torch.autograd.Function):
    """``segments``: (first row, rows, first position) of each run of this rank's queries that lies
    contiguous in the sequence; each attends only the blocks (and rows only the keys) its
    positions see. ``mask``: additive, four-dim, its rows this rank's and its columns whole, or
    None. Blocks are computed in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal, segments, k_starts, axes):
        ring = _Ring(axes)
        group = q.shape[1] // k.shape[1]
        qf = q.float()
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        held, kv = ring.coords, (k, v)
        turns = ring.turns()
        for i in range(len(turns) + 1):
            works = ()
            if i < len(turns):   # the next block on its way while this one is computed
                nxt, works = ring.start_shift(kv, turns[i])
            kf, vf = _heads(kv[0].float(), group), _heads(kv[1].float(), group)
            for row, n, first in segments:
                seen = _block_mask(first, n, k_starts[held], kf.shape[-2], causal, q.device)
                if seen is None:
                    continue
                r0, block = seen
                rows = slice(row + r0, row + n)
                block = _combined(block, _user_block(mask, rows, k_starts[held], kf.shape[-2]))
                if _hidden(mask, block):   # no row sees a key of this block: nothing to add
                    continue
                o, blk = _compat.attention_block(qf[:, :, rows], kf, vf, scale, block)
                dead = _dead(block, blk.shape)
                if dead is not None:   # the kernel's log-sum-exp of a row that sees nothing here
                    blk = blk.masked_fill(dead, float("-inf"))
                    o = o.masked_fill(dead[..., None], 0.0)
                new = torch.logaddexp(lse[:, :, rows], blk)
                safe = _finite(new)
                out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - safe)[..., None] \
                    + o * torch.exp(blk - safe)[..., None]
                lse[:, :, rows] = new
            for w in works:
                w.wait()
            if i < len(turns):
                kv, held = tuple(nxt), ring.moved(held, turns[i], -1)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.args = (scale, causal, segments, k_starts, ring)   # backward runs outside the mesh's call
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, out, lse = ctx.saved_tensors
        scale, causal, segments, k_starts, ring = ctx.args
        want_mask = ctx.needs_input_grad[3]
        group = q.shape[1] // k.shape[1]
        qf, do = q.float(), grad.float().contiguous()
        lse = _finite(lse)   # a row that sees no key: its probabilities exp(-inf - 0) = 0
        dq = torch.zeros_like(qf)
        dmask = torch.zeros_like(mask) if want_mask else None
        held, kv = ring.coords, (k, v)
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        turns = ring.turns()
        for i in range(len(turns) + 1):
            works = ()
            if i < len(turns):   # the next keys and values on their way; the gradients follow them
                nxt, works = ring.start_shift(kv, turns[i])
            kf, vf = _heads(kv[0].float(), group), _heads(kv[1].float(), group)
            for row, n, first in segments:
                seen = _block_mask(first, n, k_starts[held], kf.shape[-2], causal, q.device)
                if seen is None:
                    continue
                r0, block = seen
                rows = slice(row + r0, row + n)
                block = _combined(block, _user_block(mask, rows, k_starts[held], kf.shape[-2]))
                if _hidden(mask, block):   # as in forward: no gradient flows through it
                    continue
                parts = _compat.attention_block_backward(
                    do[:, :, rows], qf[:, :, rows].contiguous(), kf, vf, out[:, :, rows].contiguous(),
                    lse[:, :, rows].contiguous(), scale, block, scores_grad=want_mask)
                dq[:, :, rows] += parts[0]
                dkv = (dkv[0] + _grouped(parts[1], group), dkv[1] + _grouped(parts[2], group))
                if want_mask:   # the mask's block: the scores' gradient, summed where it broadcasts
                    rows_at = rows if mask.shape[-2] > 1 else slice(None)
                    cols = slice(None) if mask.shape[-1] == 1 else slice(k_starts[held], k_starts[held] + kf.shape[-2])
                    dmask[..., rows_at, cols] += _reduced(parts[3], dmask[..., rows_at, cols].shape)
            for w in works:
                w.wait()
            if i < len(turns):
                dkv, gw = ring.start_shift(dkv, turns[i])
                for w in gw:
                    w.wait()
                kv, held = tuple(nxt), ring.moved(held, turns[i], -1)
        dk, dv = ring.send_home(dkv, held)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None, None, None, None, None


def ring_attention(q, k, v, scale, causal: bool, q_start: int, k_starts: tuple, axes: tuple, balance=None,
                   attn_mask=None):
    """Attention of this rank's queries (b, heads, Lq, E) to the keys and values of every rank
    along ``axes`` (b, kv heads, Lk, E), passed round the ring: ``k_starts`` maps each block's
    coordinates (this rank's with the ring axes changed; pairs) to its first key's position, ``q_start``
    is this rank's first query's. Grouped key/value heads are attended by their group of query
    heads. ``scale``: None for 1/sqrt(E). ``balance``: (the partner's first query's
    position, the axis): the second half of the queries swapped with the partner's there first (and the
    output's back after), so causal work is even. ``attn_mask``: boolean or additive, its rows
    this rank's queries' (or one, broadcast) and its columns every key's, or None."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    starts = {tuple(c): s for c, s in k_starts}
    tq = q.shape[-2]
    mask = _additive(attn_mask, 4)
    if balance is None:
        return _RingAttention.apply(q, k, v, mask, scale, causal, ((0, tq, q_start),), starts, tuple(axes))
    partner_start, axis = balance
    partner, h = partner_of(axis), tq // 2
    mixed = _SwapHalf.apply(q, 2, partner)
    segments = ((0, h, q_start), (h, tq - h, partner_start + h))
    out = _RingAttention.apply(mixed, k, v, _rows_swapped(mask, partner), scale, causal, segments, starts, tuple(axes))
    return _SwapHalf.apply(out, 2, partner)


def _additive(mask, dims: int):
    """``mask`` as fp32 added to the scores (a boolean one's False entries -inf), ``dims`` dims
    (leading ones added), or None."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float().reshape((1,) * (dims - mask.dim()) + tuple(mask.shape))
