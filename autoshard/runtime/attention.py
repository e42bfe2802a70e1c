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
        fastest), len = blocks - 1."""
        sizes = [self.shape[a] for a in self.axes]
        count = [0] * len(sizes)
        out = []
        for _ in range(math.prod(sizes) - 1):
            i = len(sizes) - 1
            while count[i] == sizes[i] - 1:
                count[i] = 0
                i -= 1
            count[i] += 1
            out.append(self.axes[i])
        return out

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


def balanced_attention(q, k, v, scale, enable_gqa: bool, start: int, partner_start: int, axis: int):
    """Causal attention, keys and values whole, of this rank's queries (their first at ``start``)
    with the causal work balanced: the second half of the queries swapped with the partner's on
    ``axis`` (whose first is at ``partner_start``), each half attending the keys up to its own last
    position, the output's halves swapped back."""
    partner = partner_of(axis)
    h = q.shape[-2] // 2
    mixed = _SwapHalf.apply(q, q.dim() - 2, partner)
    # (first row, rows, first position) of the two halves this rank now computes
    segments = ((0, h, start), (h, q.shape[-2] - h, partner_start + h))
    outs = []
    for row, n, first in segments:
        seen = first + n
        rows = torch.arange(first, seen, device=q.device)
        mask = torch.arange(seen, device=q.device) <= rows[:, None]
        outs.append(F.scaled_dot_product_attention(
            mixed.narrow(-2, row, n), k.narrow(-2, 0, seen), v.narrow(-2, 0, seen), attn_mask=mask,
            scale=scale, enable_gqa=enable_gqa))
    return _SwapHalf.apply(torch.cat(outs, -2), q.dim() - 2, partner)


def _scores(q, k, scale, q_start, k_start, causal):
    """(b, kv heads, group, q len, k len) scores in fp32, causal positions masked; None where the
    block is all masked."""
    tq, tk = q.shape[-2], k.shape[-2]
    if causal and k_start > q_start + tq - 1:
        return None
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal and k_start + tk - 1 > q_start:
        rows = torch.arange(q_start, q_start + tq, device=q.device)
        hidden = torch.arange(k_start, k_start + tk, device=q.device) > rows[:, None]
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _finite(x):
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


class _RingAttention(torch.autograd.Function):
    """``segments``: (first row, rows, first position) of each run of this rank's queries that lies
    contiguous in the sequence; each attends only the blocks its positions see."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, segments, k_starts, axes):
        ring = _Ring(axes)
        b, h, tq, e = q.shape
        hk = k.shape[1]
        qg = q.float().reshape(b, hk, h // hk, tq, e)
        outs = [torch.zeros(b, hk, h // hk, n, v.shape[-1], dtype=torch.float32, device=q.device) for _, n, _ in segments]
        lses = [torch.full((b, hk, h // hk, n), float("-inf"), dtype=torch.float32, device=q.device)
                for _, n, _ in segments]
        held, kv = ring.coords, (k, v)
        turns = ring.turns()
        for i in range(len(turns) + 1):
            works = ()
            if i < len(turns):   # the next block on its way while this one is computed
                nxt, works = ring.start_shift(kv, turns[i])
            kf, vf = kv[0].float(), kv[1].float().unsqueeze(2)
            for j, (row, n, first) in enumerate(segments):
                s = _scores(qg.narrow(3, row, n), kf, scale, first, k_starts[held], causal)
                if s is None:
                    continue
                blk = torch.logsumexp(s, -1)
                o = torch.matmul(torch.exp(s - _finite(blk)[..., None]), vf)
                new = torch.logaddexp(lses[j], blk)
                safe = _finite(new)
                outs[j] = outs[j] * torch.exp(lses[j] - safe)[..., None] + o * torch.exp(blk - safe)[..., None]
                lses[j] = new
            for w in works:
                w.wait()
            if i < len(turns):
                kv, held = tuple(nxt), ring.moved(held, turns[i], -1)
        out, lse = torch.cat(outs, 3), torch.cat(lses, 3)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, segments, k_starts, ring)   # backward runs outside the mesh's call
        return out.reshape(b, h, tq, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, segments, k_starts, ring = ctx.args
        b, h, tq, e = q.shape
        hk = k.shape[1]
        qg = q.float().reshape(b, hk, h // hk, tq, e)
        do = grad.float().reshape(out.shape)
        rowdot = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qg)
        held, kv = ring.coords, (k, v)
        dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        turns = ring.turns()
        for i in range(len(turns) + 1):
            works = ()
            if i < len(turns):   # the next keys and values on their way; the gradients follow them
                nxt, works = ring.start_shift(kv, turns[i])
            kf, vf = kv[0].float().unsqueeze(2), kv[1].float().unsqueeze(2)
            for row, n, first in segments:
                qs = qg.narrow(3, row, n)
                s = _scores(qs, kv[0].float(), scale, first, k_starts[held], causal)
                if s is None:
                    continue
                p = torch.exp(s - _finite(lse.narrow(3, row, n))[..., None])
                dos = do.narrow(3, row, n)
                dv = torch.matmul(p.transpose(-1, -2), dos).sum(2)
                ds = p * (torch.matmul(dos, vf.transpose(-1, -2)) - rowdot.narrow(3, row, n))
                dq.narrow(3, row, n).add_(torch.matmul(ds, kf) * scale)
                dk = torch.matmul(ds.transpose(-1, -2), qs).sum(2) * scale
                dkv = (dkv[0] + dk, dkv[1] + dv)
            for w in works:
                w.wait()
            if i < len(turns):
                dkv, gw = ring.start_shift(dkv, turns[i])
                for w in gw:
                    w.wait()
                kv, held = tuple(nxt), ring.moved(held, turns[i], -1)
        dk, dv = ring.send_home(dkv, held)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, scale, causal: bool, q_start: int, k_starts: tuple, axes: tuple, balance=None):
    """Attention of this rank's queries (b, heads, Lq, E) to the keys and values of every rank
    along ``axes`` (b, kv heads, Lk, E), passed round the ring: ``k_starts`` maps each block's
    coordinates (this rank's with the ring axes changed; pairs) to its first key's position, ``q_start``
    is this rank's first query's. Grouped key/value heads are attended by their group of query
    heads. ``scale``: None for 1/sqrt(E). ``balance``: (the partner's first query's
    position, the axis): the second half of the queries swapped with the partner's there first (and the
    output's back after), so causal work is even."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    starts = {tuple(c): s for c, s in k_starts}
    tq = q.shape[-2]
    if balance is None:
        return _RingAttention.apply(q, k, v, scale, causal, ((0, tq, q_start),), starts, tuple(axes))
    partner_start, axis = balance
    partner, h = partner_of(axis), tq // 2
    mixed = _SwapHalf.apply(q, 2, partner)
    segments = ((0, h, q_start), (h, tq - h, partner_start + h))
    return _SwapHalf.apply(_RingAttention.apply(mixed, k, v, scale, causal, segments, starts, tuple(axes)), 2, partner)
