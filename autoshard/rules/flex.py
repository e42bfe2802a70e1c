"""FlexAttention: the higher-order op torch.export records for ``flex_attention``, its rule, and
the reading of its score and mask mods that the rule rests on.

    flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options,
                   score_mod_other_buffers, mask_mod_other_buffers) -> (out, logsumexp, max)

q (B, Hq, L, E); k and v (B or 1, Hkv, S, E and Ev), Hq a multiple of Hkv (grouped queries);
``block_mask`` the BlockMask as a tuple: (L, S, its tensors, block sizes, mask_mod), each tensor
(B or 1, Hq or 1, ...); the outputs (B, Hq, L, Ev), (B, Hq, L), (B, Hq, L). The mods are
subgraphs of the captured program (``get_attr`` nodes; ``module_of``): score_mod(score, b, h,
q_idx, kv_idx, *score_mod_other_buffers) and mask_mod(b, h, q_idx, kv_idx, *mask_mod_other_buffers).

One axis splits the batch (dim 0) or the heads (dim 1): each rank attends its own rows or heads
with its part of the block mask, and a size-1 dim (a mask for every row alike, the keys and
values of multi-query attention) stays whole. The mods are called with the index ``b`` and ``h``
of the score's row and head, which on a rank is its index among the rank's own. A split is
therefore offered only where every mod reads that index in no way but to pick entries of a
buffer on one dim (a document mask's ``doc[b, q_idx]``), that buffer then split on that dim too:
the local index into the local rows is the global index into the global rows. Where a mod reads
it otherwise (``b % 2``, a slope computed from ``h``), the rank would see the wrong index, and
that split is not offered. The sequence is not split (context parallelism: its own issue).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.placement import B, Split
from autoshard.rules.registry import OpCtx, Sig, rule

aten = torch.ops.aten
FLEX = torch.ops.higher_order.flex_attention
# how the mods of a non-strict export index a buffer (``doc[b, q_idx]``): ModIndex.apply(x,
# indices) through flat_apply, whose arguments unflatten to ((class name, x, indices), {})
_FLAT_APPLY = torch.ops.higher_order.flat_apply
_MOD_INDEX = "ModIndex"


def module_of(arg) -> Optional[fx.GraphModule]:
    """A mod as the op holds it: a ``get_attr`` node of the captured program (planning, the
    rewriter) or the module itself (the validator's real arguments)."""
    if isinstance(arg, fx.GraphModule):
        return arg
    if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.graph.owning_module is not None:
        found = getattr(arg.graph.owning_module, arg.target, None)
        return found if isinstance(found, fx.GraphModule) else None
    return None


def parts(args: tuple) -> tuple:
    """(q, k, v, score_mod, block tuple, scale, kernel_options, score buffers, mask buffers)."""
    return tuple(args) + ((),) * (9 - len(args))


def _is_tensor(x) -> bool:
    return isinstance(x, (fx.Node, torch.Tensor))


def _indexing(gm: fx.GraphModule, node: fx.Node):
    """(x, indices) where ``node`` indexes a tensor with a list of indices, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.index.Tensor:
        return node.args[0], list(node.args[1])
    if node.target is _FLAT_APPLY and len(node.args) >= 2 and isinstance(node.args[1], fx.Node):
        spec = getattr(gm, node.args[1].target, None)
        if not isinstance(spec, pytree.TreeSpec):
            return None
        try:
            args, kwargs = pytree.tree_unflatten(list(node.args[2:]), spec)
        except (TypeError, ValueError):
            return None
        if not kwargs and len(args) == 3 and isinstance(args[0], str) and args[0].endswith(_MOD_INDEX):
            return args[1], list(args[2])
    return None


# factories of a tensor like their first argument: they read its dtype and device, not its values
# (``and_masks`` starts from ``b.new_ones((), dtype=torch.bool)``)
_LIKE = (aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)


def _reads(gm: fx.GraphModule, index: fx.Node, buffers: list) -> Optional[dict]:
    """buffer placeholder -> the dim whose entries ``index`` picks, where the mod reads ``index``
    in no way but that (or for its dtype and device) and reads each such buffer only at ``index``
    on that dim; None otherwise."""
    dims: dict = {}
    for use in index.users:
        if use.op == "call_function" and use.target in _LIKE and use.args[0] is index and index not in use.args[1:]:
            continue
        got = _indexing(gm, use)
        if got is None or got[0] not in buffers:
            return None
        at = [j for j, i in enumerate(got[1]) if i is index]
        if len(at) != 1 or dims.setdefault(got[0], at[0]) != at[0]:
            return None
    for x, j in dims.items():
        for use in x.users:
            got = _indexing(gm, use)
            if got is None or got[0] is not x or len(got[1]) <= j or got[1][j] is not index:
                return None
    return dims


def _buffer_placements(mod, first_buffer: int, which: int, buffers: list, in_shapes: list, size: int):
    """The placements of a mod's buffers where the split index is its placeholder ``which``, or
    None where that split is not right for this mod."""
    gm = module_of(mod)
    if gm is None:
        return None
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != first_buffer + len(buffers):
        return None
    dims = _reads(gm, phs[which], phs[first_buffer:])
    if dims is None:
        return None
    out = []
    for ph, shape in zip(phs[first_buffer:], in_shapes):
        j = dims.get(ph)
        if j is not None and (len(shape) <= j or shape[j] != size):
            return None
        out.append(B if j is None else Split(j))
    return out


@rule(FLEX)
def flex_attention(ctx: OpCtx):
    q, k, v, score_mod, block, _, _, score_bufs, mask_bufs = parts(ctx.args)
    block_tensors = [x for x in tuple(block)[2:-1] if _is_tensor(x)]
    n_block, n_score = len(block_tensors), len(score_bufs)
    shapes = ctx.in_shapes
    if len(shapes) != 3 + n_block + n_score + len(mask_bufs) or len(shapes[0]) != 4:
        return []
    mask_mod = tuple(block)[-1]
    sigs = []
    for d in (0, 1):   # the batch row b, the head h: the mods' placeholders 1 + d (score) and d (mask)
        size = shapes[0][d]
        if size <= 1:
            continue
        score = _buffer_placements(score_mod, 5, 1 + d, list(score_bufs), shapes[3 + n_block:3 + n_block + n_score], size)
        mask = _buffer_placements(mask_mod, 4, d, list(mask_bufs), shapes[3 + n_block + n_score:], size)
        if score is None or mask is None:
            continue
        kv = [Split(d) if s[d] > 1 else B for s in shapes[1:3]]   # one key head for all: every rank's
        blocks = [Split(d) if s[d] == size else B for s in shapes[3:3 + n_block]]
        sigs.append(Sig(tuple([Split(d)] + kv + blocks + score + mask), (Split(d),) * ctx.n_out))
    return sigs


BLOCKS_SAMPLED = 256   # blocks per dim evaluated at most; longer sequences are sampled evenly


def density(node: fx.Node) -> float:
    """The share of (query block, key block) pairs the op's block mask keeps, where its mask mod
    reads nothing but the indices (causal: about a half; a sliding window: its width over the
    keys'): a block-sparse kernel computes only those. A block counts as kept when the mod keeps
    any of its four corners, which is exact for masks bounded by lines (causal, windows, prefixes)
    and an estimate otherwise. 1.0 where the mod reads buffers (a document mask: their values are
    not known when planning) or cannot be evaluated here."""
    _, _, _, _, block, _, _, _, mask_bufs = parts(node.args)
    block = tuple(block)
    mask_mod = module_of(block[-1]) if block else None
    if mask_mod is None or mask_bufs or len(block) < 5 or not all(isinstance(x, int) for x in block[:2] + block[-3:-1]):
        return 1.0
    (length, keys), (q_block, kv_block) = block[:2], block[-3:-1]

    def corners(size: int, step: int) -> torch.Tensor:
        starts = torch.arange(0, size, step)
        if len(starts) > BLOCKS_SAMPLED:
            starts = starts[torch.linspace(0, len(starts) - 1, BLOCKS_SAMPLED).long()]
        return torch.stack([starts, (starts + step - 1).clamp(max=size - 1)], 1)   # (blocks, 2)

    q, kv = corners(length, q_block), corners(keys, kv_block)
    zero = torch.zeros((), dtype=torch.long)
    try:
        with torch.no_grad():
            kept = mask_mod(zero, zero, q.view(-1, 1, 2, 1), kv.view(1, -1, 1, 2))
        kept = torch.as_tensor(kept).broadcast_to((len(q), len(kv), 2, 2))
    except Exception:   # a mod this evaluation cannot run (fake tensors inside it, data-dependent code)
        return 1.0
    return float(kept.flatten(2).any(-1).float().mean())


def bound(score_mod: fx.GraphModule, mask_mod: fx.GraphModule):
    """The op with its two mods bound, for a rank's program to call: a program's code can name a
    module only as an attribute of the program, which the passes after the rewriter rebuild."""
    def flex_attention(q, k, v, block, scale, kernel_options, score_bufs=(), mask_bufs=()):
        return FLEX(q, k, v, score_mod, (*block, mask_mod), scale, kernel_options, tuple(score_bufs),
                    tuple(mask_bufs))
    return flex_attention
