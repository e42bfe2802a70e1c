"""The price of ring attention (rules.nn.sdpa's keys and values split along the sequence,
runtime.ring_attention): each rank attends its queries to every block of keys, so its compute is
the all-gather form's; the blocks come round the ring, ``n - 1`` sends of this rank's keys and
values in forward (n blocks over the ring axes), each started before the block it follows is
computed, so a send costs only what that block's compute does not cover; in backward the same
sends carry the keys' and values' gradients beside them, and one last send takes the gradients
home, which nothing hides. Memory shrinks by itself: the keys and values the op keeps are its
split inputs, priced as any input.

    forward   sum over turns of max(0, send(kv) - block forward)
    backward  sum over turns of max(0, send(kv) + send(dkv) - block backward) + send(dkv)

A send on one axis costs the link's launch and one latency step and its bytes at the link's
bandwidth.

Causal attention with its queries' sequence split by one axis is balanced (runtime.attention):
half the queries swapped with the partner rank, each half attending only the keys (or the ring's
blocks) its positions see. Its slowest rank then computes (2p+1)/(4p) of the dense work with the
keys whole ((p+1)/(2p) in the ring, by whole blocks), where unbalanced the last rank computes
nearly all of it; the swap costs two exchanges of half the queries' bytes each way, forward and
backward, which nothing hides. It is done where it pays: where the op's price balanced (its
compute, the swaps, and the ring's sends that less compute leaves exposed) is below its price
unbalanced (``balance_pays``); the plan lists those nodes
(``plan.schedule["balanced_attention"]``) and the rewriter balances them.
"""
from __future__ import annotations

import math

import torch

from autoshard import placement as pl

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def ring_axes(node, strat, mesh_shape, key_shape) -> tuple:
    """The mesh axes ``strat`` passes this attention's keys (of ``key_shape``) round: those that
    split the keys' sequence dim; () for any other op or layout."""
    if node.kind != "op" or node.target is not SDPA or len(strat.inputs) < 2:
        return ()
    kseq = len(key_shape) - 2
    return tuple(a for a, q in enumerate(strat.inputs[1])
                 if isinstance(q, pl.Split) and q.dim == kseq and mesh_shape[a] > 1)


def form(graph, node, strat, mesh_shape) -> str:
    """How ``strat`` computes an attention node: "ring" (keys passed round), "allgather" (the
    queries split along the sequence, keys whole there) or "" (no sequence split, or another op)."""
    if node.kind != "op" or node.target is not SDPA or len(strat.inputs) < 3:
        return ""
    if ring_axes(node, strat, mesh_shape, graph.meta(node.inputs[1]).shape):
        return "ring"
    qseq = len(graph.meta(node.inputs[0]).shape) - 2
    split = any(isinstance(q, pl.Split) and q.dim == qseq and n > 1 for q, n in zip(strat.inputs[0], mesh_shape))
    return "allgather" if split else ""


def balance_axis(q_shape, q_pl, mesh_shape, causal: bool, dropout: float):
    """The axis over which causal attention's work is balanced (the one axis that splits the
    queries' sequence, into even halves on each rank), or None. A mask beside ``is_causal`` is
    swapped with the queries; dropout is not balanced (runtime.attention_dropout)."""
    seq = len(q_shape) - 2
    axes = [a for a, q in enumerate(q_pl) if isinstance(q, pl.Split) and q.dim == seq and mesh_shape[a] > 1]
    if len(axes) != 1 or not causal or dropout:
        return None
    local = pl.local_shape(q_shape, q_pl, mesh_shape)
    return axes[0] if local is not None and local[seq] % 2 == 0 else None


def node_balance(graph, node, strat, mesh_shape):
    """``balance_axis`` of an attention node in ``strat``; None for any other op."""
    if node.kind != "op" or node.target is not SDPA or not strat.inputs:
        return None
    args, kwargs = node.fx_node.args, node.fx_node.kwargs
    arg = lambda i, name, default: args[i] if len(args) > i else kwargs.get(name, default)
    return balance_axis(graph.meta(node.inputs[0]).shape, strat.inputs[0], mesh_shape, arg(5, "is_causal", False),
                        arg(4, "dropout_p", 0.0))


def balanced_share(p: int, ring: bool) -> float:
    """The slowest rank's share of the dense work once balanced."""
    return (p + 1) / (2 * p) if ring else (2 * p + 1) / (4 * p)


def balance_pays(fwd: float, bwd: float, share: float, swap: float, exposed=None, again: bool = False) -> bool:
    """Whether balancing makes the op cheaper, as its price counts it: its compute (``fwd``,
    ``bwd``: unbalanced; the forward run again in backward where ``again``, a checkpointed
    region, which runs the swaps and sends again too) down to ``share``, its swaps (``swap``
    seconds) added, and the sends its compute leaves exposed (``exposed(share)``: the ring's,
    hidden by less compute once balanced) compared."""
    exposed = exposed or (lambda s: 0.0)
    k = 1 + again
    before = k * fwd + bwd + k * exposed(1.0)
    after = share * (k * fwd + bwd) + k * (swap + exposed(share))
    return after < before


def swap_sends(ins: list, itemsize: int, axis: int, link, training: bool) -> list:
    """(phase, axis, bytes, seconds) of the balancing swaps: half the queries and half the output,
    forward, and half a mask's rows where it has them (priced at the op's itemsize); the
    queries' and output's gradients, backward."""
    half = math.prod(ins[0]) * itemsize / 2
    out = [("forward", axis, 2 * half, 2 * send_time(half, link))]
    if len(ins) > 3 and len(ins[3]) >= 2 and ins[3][-2] > 1:
        rows = math.prod(ins[3]) * itemsize / 2
        out.append(("forward", axis, rows, send_time(rows, link)))
    if training:
        out.append(("backward", axis, 2 * half, 2 * send_time(half, link)))
    return out


def swap_comm(ins: list, itemsize: int, link, training: bool) -> float:
    """Seconds of the balancing swaps (``swap_sends``)."""
    return sum(s[3] for s in swap_sends(ins, itemsize, -1, link, training))


def whole_keys(ins: list, axes: tuple, mesh_shape) -> list:
    """The local shapes the op computes on: the keys and values whole along the sequence."""
    n = math.prod(mesh_shape[a] for a in axes)
    out = list(ins)
    for i in (1, 2):
        s = list(out[i])
        s[-2] *= n
        out[i] = tuple(s)
    return out


def send_time(nbytes: float, link) -> float:
    alpha, beta, overhead = link
    return overhead + alpha + nbytes / beta


def turns(axes: tuple, mesh_shape) -> list:
    """The axis each send of the ring goes along (runtime.attention's odometer)."""
    sizes = [mesh_shape[a] for a in axes]
    count, out = [0] * len(sizes), []
    for _ in range(math.prod(sizes) - 1):
        i = len(sizes) - 1
        while count[i] == sizes[i] - 1:
            count[i] = 0
            i -= 1
        count[i] += 1
        out.append(axes[i])
    return out


def ring_sends(ins: list, itemsize: int, axes: tuple, mesh_shape, links, fwd: float, bwd: float,
               training: bool) -> list:
    """(phase, axis, bytes, seconds its block's compute leaves exposed) of each of the ring's sends
    (``fwd``, ``bwd``: the op's compute over all its blocks): the keys and values on to the next
    rank, forward; backward, again with their gradients beside them, and those sent home last."""
    kv = (math.prod(ins[1]) + math.prod(ins[2])) * itemsize
    steps = turns(axes, mesh_shape)
    blocks = len(steps) + 1
    out = [("forward", a, kv, max(0.0, send_time(kv, links[a]) - fwd / blocks)) for a in steps]
    if training:
        grads = (math.prod(ins[1]) + math.prod(ins[2])) * 4   # gradients accumulate in fp32
        out += [("backward", a, kv + grads, max(0.0, send_time(kv, links[a]) + send_time(grads, links[a]) - bwd / blocks))
                for a in steps]
        home = max(axes, key=lambda a: send_time(grads, links[a]))
        out.append(("backward", home, grads, send_time(grads, links[home])))
    return out


def ring_comm(ins: list, itemsize: int, axes: tuple, mesh_shape, links, fwd: float, bwd: float,
              training: bool) -> float:
    """Seconds of the ring's sends that its blocks' compute leaves exposed (``ring_sends``)."""
    return sum(s[3] for s in ring_sends(ins, itemsize, axes, mesh_shape, links, fwd, bwd, training))
