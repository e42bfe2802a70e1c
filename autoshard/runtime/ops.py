"""The ops whose local form differs from the global one: dropout drawn from the generator every
rank shares, a mean cross-entropy over a split batch, batch norm with the whole batch's
statistics, causal attention on a run of the sequence's queries, and attention that drops
probabilities (its dropout drawn as one device draws it).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard import placement as pl
from autoshard.runtime.edges import _convert, _whole
from autoshard.runtime.mesh import _mesh, by_key
from autoshard.runtime.steps import _run, _slice, all_gather


def dropout(x, p: float, train: bool, placement: tuple):
    """Draw the whole mask from the generator all ranks share and keep this rank's part: replicas
    agree, and the result equals a single-device draw from the same seed."""
    if not train or p == 0:
        return x
    m = _mesh()
    pls = tuple(pl.parse(q) for q in placement)
    shape = list(x.shape)
    for q, n in zip(pls, m.shape):
        if isinstance(q, pl.Split):
            shape[q.dim] *= n
    if p == 1:
        return x * 0
    if torch.compiler.is_compiling():
        noise = shared_mask(x.detach(), p, shape, m.key)
    else:
        noise = _draw(x, p, shape, m.generator)
    for a, (q, n) in enumerate(zip(pls, m.shape)):
        if isinstance(q, pl.Split):
            noise = _slice(noise, n, m.coords[a], q.dim)
    return x * noise


def _draw(x, p: float, shape, generator) -> torch.Tensor:
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=generator)
    return noise.div_(1 - p)


# Traced (torch.compile), dropout's mask is drawn by an op the compiler calls as it is, from the
# generator every rank shares, as eager autoshard draws it: dynamo cannot take a torch.Generator,
# and the compiler's own random ops draw from other streams (inductor's), so compiled and eager
# would drop different units. Tagged random, so the compiler neither merges two draws nor draws
# again in backward (it keeps the mask); ``x``, the tensor it masks, orders the draw after what
# computes it, so the draws come in the program's order.
@torch.library.custom_op("autoshard::shared_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def shared_mask(x: torch.Tensor, p: float, shape: list[int], mesh: int) -> torch.Tensor:
    """Dropout's whole mask (scaled by 1 / (1 - p)) for ``x``, drawn from the generator of the
    mesh keyed ``mesh`` (``RankMesh.key``)."""
    return _draw(x, p, shape, by_key(mesh).generator)


@shared_mask.register_fake
def _(x, p, shape, mesh):
    return x.new_empty(shape)


def causal_attention(q, k, v, attn_mask, dropout_p: float, scale, enable_gqa: bool, start: int):
    """Causal attention of the queries at positions ``start``, ``start + 1``, ... of the sequence
    to every key: query i sees keys j <= start + i (``is_causal`` on the local queries would mean
    j <= i). An attention mask given is combined with that one, as ``is_causal`` combines it."""
    rows = torch.arange(start, start + q.shape[-2], device=q.device)
    seen = torch.arange(k.shape[-2], device=q.device) <= rows[:, None]
    if attn_mask is None:
        mask = seen
    elif attn_mask.dtype == torch.bool:
        mask = attn_mask & seen
    else:
        mask = attn_mask.masked_fill(~seen, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=False,
                                          scale=scale, enable_gqa=enable_gqa)


def attention_dropout(q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool, start: int,
                      placement: tuple):
    """Attention with dropout on its probabilities, as torch computes it on one device (softmax,
    rows that see no key all zeros; dropout; times the values): the dropout's mask is drawn whole,
    (..., heads, Lq, Lk) of the op's global shape, from the generator every rank shares, and this
    rank's part kept (its output's ``placement``: batch, heads or query rows), so the result is
    one device's from the same seed. Causal queries are at positions ``start``, ``start + 1``, ...
    (a split sequence's); the keys are whole along the sequence."""
    m = _mesh()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        rows = torch.arange(start, start + q.shape[-2], device=q.device)
        s = s.masked_fill(torch.arange(k.shape[-2], device=q.device) > rows[:, None], float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    dead = torch.isneginf(s).all(-1, keepdim=True)   # rows that see no key: zeros, their gradient none
    probs = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    pls = tuple(pl.parse(x) for x in placement)
    shape = list(probs.shape)
    for x, n in zip(pls, m.shape):
        if isinstance(x, pl.Split):
            shape[x.dim] *= n
    noise = torch.empty(shape, dtype=probs.dtype, device=probs.device).bernoulli_(1 - dropout_p, generator=m.generator)
    noise.div_(1 - dropout_p)
    for a, (x, n) in enumerate(zip(pls, m.shape)):
        if isinstance(x, pl.Split):
            noise = _slice(noise, n, m.coords[a], x.dim)
    return torch.matmul(probs * noise, v)


def cross_entropy_mean(x, target, weight, ignore_index: int, label_smoothing: float, axes: tuple,
                       whole_target=None):
    """Mean cross-entropy over a batch split on ``axes``: this rank's sum divided by the count of
    counted targets over all ranks (weighted, as torch does), so the partial sums add up to the
    single-device mean. Given ``whole_target`` (the targets of the whole batch, unweighted), the
    count is taken there, with no all-reduce."""
    m = _mesh()
    total = F.cross_entropy(x, target, weight=weight, reduction="sum", ignore_index=ignore_index,
                            label_smoothing=label_smoothing)
    if whole_target is not None and weight is None:
        with torch.no_grad():
            denom = (whole_target != ignore_index).sum().to(torch.float64)
        return total / denom.to(total.dtype)
    with torch.no_grad():
        counted = target != ignore_index
        if weight is not None:
            denom = weight[target.clamp(min=0)].masked_fill(~counted, 0).sum().to(torch.float64)
        else:
            denom = counted.sum().to(torch.float64)
        for a in axes:
            if torch.compiler.is_compiling():   # traced: a functional all-reduce
                denom = _run(denom, "all_reduce", m.groups[a], None, None, None, None)
            else:
                dist.all_reduce(denom, group=m.groups[a])
    return total / denom.to(total.dtype)


def batch_norm_train(x, weight, bias, running_mean, running_var, momentum: float, eps: float,
                     placement: tuple):
    """Batch norm in training mode on this rank's share ``placement`` of the input, with the
    statistics of the whole batch, as single-device batch norm computes them.

    Each rank takes the mean and the sum of squared deviations (M2) of its share per channel.
    On each axis that splits a dim the statistics run over, the ranks gather each other's
    (mean, M2) and combine them (Chan et al.): mean = the mean of the means (the shares are
    equal), M2 = sum of M2 + n * sum of (mean_i - mean)^2. Unlike sum and sum of squares this
    does not cancel when the mean is large. Everything is differentiable local ops and the
    gather, whose backward is the dual reduce-scatter: each rank gets the gradient that every
    rank's loss sends to its own statistics, so backward is that of the global batch norm too.
    Running statistics (whole on every rank) move by the global mean and unbiased variance; on
    axes that split the channels each rank's update is gathered first, so every rank's buffers
    stay whole and equal."""
    m = _mesh()
    pls = tuple(pl.parse(q) for q in placement)
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1, -1] + [1] * (x.dim() - 2)
    n = x.numel() // max(x.shape[1], 1)
    mean = xs.mean(dims)
    m2 = (xs - mean.view(shape)).square().sum(dims)
    for a, q in enumerate(pls):
        if isinstance(q, pl.Split) and q.dim != 1 and m.shape[a] > 1:
            both = all_gather(torch.stack([mean, m2]).unsqueeze(0), a, 0)   # (p, 2, C)
            means = both[:, 0]
            mean = means.mean(0)
            m2 = both[:, 1].sum(0) + n * (means - mean).square().sum(0)
            n *= m.shape[a]
    var = m2 / n
    out = (xs - mean.view(shape)) * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None or running_var is not None:
        with torch.no_grad():
            update = torch.stack([mean, var * (n / max(n - 1, 1))]).detach()
            channels = tuple(q if isinstance(q, pl.Split) and q.dim == 1 else pl.B for q in pls)
            update = _convert(update, channels, _whole(len(pls)), m)
            for buf, new in ((running_mean, update[0]), (running_var, update[1])):
                if buf is not None:
                    buf.mul_(1 - momentum).add_(new.to(buf.dtype), alpha=momentum)
    return out.to(x.dtype)
