"""Sample inputs for every op family with a rule: what ``autoshard.check.validate`` checks each
rule's signatures on, when run on its own (``python -m autoshard.check.validate``) and by
tests/test_rules.py, which requires a case for every rule function."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def default_cases(seed: int = 0) -> list:
    """Sample inputs for every op family with a rule. Dims are mostly multiples of 4 so that
    splits are checked at p=2 and p=4; a few dims of 6 or 2 exercise the not-applicable path."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def r(*shape, dtype=f64):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    def pos(*shape, dtype=f64):
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    def mask(*shape):
        return torch.rand(shape, generator=g) > 0.5

    C = []

    def add(op, *args, **kwargs):
        C.append((op, args, kwargs))

    # -- matmul-like (factor.py)
    add(aten.linear.default, r(8, 16), r(32, 16), r(32))
    add(aten.linear.default, r(8, 16), r(32, 16))
    add(aten.linear.default, r(4, 8, 16), r(12, 16), r(12))
    add(aten.linear.default, r(4, 8, 16), r(12, 16))
    add(aten.linear.default, r(16), r(8, 16), r(8))               # 1-D input
    add(aten.linear.default, r(2, 4, 8, 16, dtype=torch.float32), r(8, 16, dtype=torch.float32),
        r(8, dtype=torch.float32))
    add(aten.mm.default, r(8, 12), r(12, 16))
    add(aten.mm.default, r(8, 12, dtype=torch.float32), r(12, 4, dtype=torch.float32))
    add(aten.bmm.default, r(4, 8, 12), r(4, 12, 16))
    add(aten.matmul.default, r(8, 12), r(12, 16))
    add(aten.matmul.default, r(4, 8, 12), r(12, 16))
    add(aten.matmul.default, r(2, 4, 8, 12), r(2, 4, 12, 8))
    add(aten.matmul.default, r(4, 1, 8, 12), r(4, 12, 16))       # broadcast batch
    add(aten.matmul.default, r(1, 8, 12), r(4, 12, 8))           # broadcast batch, size 1 in a
    add(aten.matmul.default, r(8, 12), r(12))                    # matrix @ vector
    add(aten.matmul.default, r(12), r(4, 12, 8))                 # vector @ batched matrix
    add(aten.matmul.default, r(12), r(12))                       # dot
    add(aten.addmm.default, r(16), r(8, 12), r(12, 16))
    add(aten.addmm.default, r(8, 16), r(8, 12), r(12, 16), beta=0.5, alpha=2.0)
    add(aten.addmm.default, r(1, 16), r(8, 12), r(12, 16))
    add(aten.baddbmm.default, r(4, 8, 16), r(4, 8, 12), r(4, 12, 16))
    add(aten.baddbmm.default, r(8, 16), r(4, 8, 12), r(4, 12, 16), beta=0.5, alpha=-1.0)
    add(aten.einsum.default, "bij,bjk->bik", [r(4, 8, 12), r(4, 12, 16)])
    add(aten.einsum.default, "ij,jk->ik", [r(8, 12), r(12, 16)])
    add(aten.einsum.default, "bhqd,bhkd->bhqk", [r(2, 4, 8, 12), r(2, 4, 16, 12)])
    add(aten.einsum.default, "i,j->ij", [r(8), r(12)])
    add(aten.einsum.default, "ij,ij->i", [r(8, 12), r(8, 12)])
    add(aten.einsum.default, "ij,jk->i", [r(8, 12), r(12, 4)])
    add(aten.einsum.default, "ij,jk,kl->il", [r(8, 12), r(12, 4), r(4, 16)])
    add(aten.einsum.default, "ii->i", [r(8, 8)])                 # diagonal: all-B only

    # -- pointwise (pointwise.py)
    add(aten.add.Tensor, r(8, 12), r(8, 12))
    add(aten.add.Tensor, r(8, 12), 3.0)
    add(aten.add.Tensor, r(4, 8, 12), r(12))                     # broadcasting
    add(aten.add.Tensor, r(4, 1, 12), r(8, 1))                   # both broadcast
    add(aten.add.Tensor, r(8, 12), r(8, 12), alpha=2)
    add(aten.add.Scalar, r(8, 12), 2.0)
    add(aten.add.Tensor, ints(10, 8, 12), ints(10, 8, 12))
    add(aten.sub.Tensor, r(8, 12), r(12))
    add(aten.sub.Tensor, r(8, 12), 1.5)
    add(aten.mul.Tensor, r(4, 8, 12), r(8, 1))
    add(aten.mul.Tensor, r(8, 12), 0.5)
    add(aten.mul.Tensor, r(8, 12), r(8, 12))
    add(aten.div.Tensor, r(8, 12), pos(8, 12))
    add(aten.div.Tensor, r(4, 8, 12), pos(12))
    add(aten.div.Tensor, r(8, 12), 4.0)
    add(aten.div.Scalar, r(8, 12), 4.0)
    add(aten.div.Tensor_mode, r(8, 12), 0.3, rounding_mode="floor")   # x // 0.3 in export
    add(aten.div.Tensor_mode, r(8, 12), pos(12), rounding_mode="trunc")
    add(aten.neg.default, r(8, 12))
    add(aten.pow.Tensor_Scalar, r(8, 12), 2)
    add(aten.pow.Tensor_Scalar, pos(8, 12), 0.5)
    add(aten.pow.Tensor_Tensor, pos(8, 12), r(12))
    add(aten.exp.default, r(8, 12))
    add(aten.log.default, pos(8, 12))
    add(aten.sqrt.default, pos(8, 12))
    add(aten.abs.default, r(8, 12))
    add(aten.relu.default, r(4, 8, 12))
    add(aten.gelu.default, r(8, 12))
    add(aten.gelu.default, r(8, 12), approximate="tanh")
    add(aten.silu.default, r(8, 12))
    add(aten.tanh.default, r(8, 12))
    add(aten.sigmoid.default, r(8, 12))
    add(aten.rsqrt.default, pos(8, 12))
    add(aten.clamp.default, r(8, 12), -0.5, 0.5)
    add(aten.minimum.default, r(8, 12), r(1, 12))
    add(aten.eq.Tensor, ints(3, 8, 12), ints(3, 8, 12))
    add(aten.gt.Scalar, r(8, 12), 0.0)
    add(aten.lerp.Scalar, r(8, 12), r(8, 12), 0.3)
    add(aten.addcmul.default, r(8, 12), r(8, 12), r(12), value=0.5)
    add(aten.where.self, mask(8, 12), r(8, 12), r(8, 12))
    add(aten.where.self, mask(1, 8, 8), r(4, 8, 8), r(8, 1))
    add(aten.masked_fill.Scalar, r(4, 8, 8), mask(8, 8), -1e9)
    add(aten.masked_fill.Tensor, r(4, 8, 8), mask(4, 1, 8), torch.tensor(-2.0, dtype=f64))
    add(aten.zeros_like.default, r(8, 12))
    add(aten.new_zeros.default, r(4, 8), [4, 8, 12])                # x's dims where they line up
    add(aten.new_ones.default, ints(5, 4, 8), [4, 12], dtype=f64)
    add(aten.new_full.default, r(8, 12), [8, 12], 2.5)
    add(aten.new_empty.default, r(4, 8, 12), [4, 8, 16])            # filled while checked (UNINITIALIZED)
    add(aten.new_empty.default, ints(5, 8), [2, 4, 8])
    add(aten.copy.default, r(4, 8, 12), r(8, 12))                    # copy_ functionalized: src broadcast
    add(aten.copy.default, r(8, 12, dtype=torch.float32), r(8, 12))  # and cast to self's dtype
    add(aten.fill.Scalar, r(8, 12), 0.5)
    add(aten.fill.Tensor, r(4, 8), torch.tensor(2.0, dtype=f64))
    add(aten.zero.default, r(8, 12))
    add(aten.clone.default, r(8, 12))
    add(aten.contiguous.default, r(8, 12))
    add(aten.detach.default, r(8, 12))
    add(aten._to_copy.default, r(8, 12), dtype=torch.float32)
    add(aten._to_copy.default, r(8, 12, dtype=torch.float32), dtype=f64)
    add(aten._to_copy.default, r(8, 12), dtype=torch.int64)
    add(aten.type_as.default, r(8, 12, dtype=torch.float32), r(8, 12))
    add(aten.broadcast_tensors.default, [r(4, 1, 12), r(8, 12)])
    add(aten.broadcast_tensors.default, [r(8, 12), r(8, 12)])

    # -- normalization, softmax, attention, embedding (nn.py)
    add(aten.layer_norm.default, r(4, 8, 16), [16], r(16), r(16), 1e-5, False)
    add(aten.layer_norm.default, r(4, 8, 16), [16], None, None, 1e-5, False)
    add(aten.layer_norm.default, r(4, 8, 16), [8, 16], r(8, 16), r(8, 16), 1e-5, False)
    add(aten.layer_norm.default, r(8, 16, dtype=torch.float32), [16], r(16, dtype=torch.float32),
        r(16, dtype=torch.float32), 1e-5, False)
    add(aten.rms_norm.default, r(4, 8, 16), [16], r(16), 1e-6)
    add(aten.rms_norm.default, r(4, 8, 16), [16])
    add(aten.softmax.int, r(4, 8, 12), -1)
    add(aten.softmax.int, r(4, 8, 12), 1)
    add(aten.log_softmax.int, r(4, 8, 12), -1)
    add(aten._softmax.default, r(4, 8, 12), 2, False)
    add(aten._log_softmax.default, r(4, 8, 12), 0, False)
    q, k, v = r(2, 4, 8, 16), r(2, 4, 12, 16), r(2, 4, 12, 8)
    add(aten.scaled_dot_product_attention.default, q, k, v)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16), is_causal=True)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16), None, 0.0, True)
    add(aten.scaled_dot_product_attention.default, q, k, v, r(8, 12))
    add(aten.scaled_dot_product_attention.default, q, k, v, attn_mask=r(2, 1, 8, 12))
    add(aten.scaled_dot_product_attention.default, q, k, v, mask(2, 4, 8, 12) | torch.eye(8, 12, dtype=torch.bool))
    add(aten.scaled_dot_product_attention.default, q, k, v, scale=0.3)
    add(aten.scaled_dot_product_attention.default, r(2, 8, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16),
        enable_gqa=True)
    add(aten.scaled_dot_product_attention.default, r(2, 8, 8, 16), r(2, 2, 8, 16), r(2, 2, 8, 16),
        is_causal=True, enable_gqa=True)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16, dtype=torch.float32),
        r(2, 4, 8, 16, dtype=torch.float32), r(2, 4, 8, 16, dtype=torch.float32), is_causal=True)
    # causal with the queries split on the sequence (the mask offset by the rank's first query):
    # GQA, an explicit scale, masks combined with the causal one, fewer queries than keys
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 1, 8, 16), r(2, 1, 8, 16),
        is_causal=True, scale=0.3, enable_gqa=True)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 4, 8, 16), r(2, 4, 8, 16),
        mask(8, 8) | torch.eye(8, dtype=torch.bool), 0.0, True)
    add(aten.scaled_dot_product_attention.default, r(2, 4, 8, 16), r(2, 2, 8, 16), r(2, 2, 8, 16),
        r(2, 1, 8, 8), is_causal=True, enable_gqa=True)
    add(aten.scaled_dot_product_attention.default, r(1, 2, 8, 16), r(1, 2, 12, 16), r(1, 2, 12, 8), is_causal=True)
    add(aten.scaled_dot_product_attention.default, q, k, v, None, 0.1)   # dropout draws: skipped
    add(aten.embedding.default, r(20, 16), ints(20, 4, 8))
    add(aten.embedding.default, r(20, 16), ints(20, 8))
    add(aten.embedding.default, r(20, 16), ints(20, 4, 8), 0)

    # -- reductions
    x = r(4, 8, 12)
    add(aten.sum.default, x)
    add(aten.sum.dim_IntList, x, [1])
    add(aten.sum.dim_IntList, x, [1], True)
    add(aten.sum.dim_IntList, x, [0, -1])
    add(aten.sum.dim_IntList, x, [-1], False, dtype=torch.float32)
    add(aten.sum.dim_IntList, x, [])                                 # [] reduces every dim
    for op, *how in ((aten.amax.default, [1]), (aten.amin.default, [0, -1], True), (aten.max.dim, 2),
                     (aten.min.dim, 0, True), (aten.argmax.default, 1), (aten.argmin.default, -1, True)):
        add(op, x, *how)                                             # a max over some dims: the others split
    add(aten.slice_scatter.default, x, r(4, 8, 4), 2, 4, 8)          # a slice written back: other dims split
    add(aten.select_scatter.default, x, r(4, 12), 1, 3)
    add(aten.sum.default, ints(5, 8, 12))
    add(aten.mean.default, x)
    add(aten.mean.dim, x, [1])
    add(aten.mean.dim, x, [-1], True)
    add(aten.mean.dim, x, [0, 2], False)
    add(aten.mean.dim, r(8, 12, dtype=torch.float32), [0])

    # -- views (views.py)
    add(aten.view.default, r(4, 8, 12), [32, 12])
    add(aten.view.default, r(4, 8, 12), [4, 8, 3, 4])
    add(aten.view.default, r(4, 8, 12), [4, -1])
    add(aten.view.default, r(8, 12), [4, 2, 12])
    add(aten.view.default, r(1, 8, 12), [8, 12])
    add(aten.view.default, r(8, 6), [4, 12])
    add(aten.reshape.default, r(4, 8, 12), [4, 8, 4, 3])
    add(aten.reshape.default, r(4, 8, 12), [-1])
    add(aten._unsafe_view.default, r(4, 8, 12), [32, 12])
    add(aten._unsafe_view.default, r(32, 12), [4, 8, 12])
    add(aten.flatten.using_ints, r(4, 8, 12), 0, 1)
    add(aten.flatten.using_ints, r(4, 8, 12), 1, 2)
    add(aten.unflatten.int, r(4, 32, 12), 1, [8, 4])
    add(aten.unflatten.int, r(4, 32, 12), -1, [4, -1])
    add(aten.unsqueeze.default, r(8, 12), 1)
    add(aten.unsqueeze.default, r(8, 12), -1)
    add(aten.squeeze.dim, r(8, 1, 12), 1)
    add(aten.squeeze.dim, r(8, 4, 12), 1)                          # no-op squeeze
    add(aten.squeeze.default, r(1, 8, 12))
    add(aten.squeeze.default, r(1, 4, 12))
    add(aten.squeeze.dims, r(1, 4, 1, 12), [0, 2])
    add(aten.squeeze.dims, r(8, 4, 12), [1])                         # no-op squeeze
    add(aten.view_as.default, r(4, 8, 12), r(32, 12))
    add(aten.expand_as.default, r(4, 1, 12), r(4, 8, 12))
    add(aten.view.dtype, r(8, 12, dtype=torch.float32), torch.int32)
    add(aten.view.dtype, r(8, 12, dtype=torch.float16), torch.bfloat16)
    add(aten.expand.default, r(4, 1, 12), [4, 8, 12])
    add(aten.expand.default, r(8, 12), [4, 8, 12])
    add(aten.expand.default, r(8, 1), [-1, 12])
    add(aten.permute.default, r(4, 8, 12), [2, 0, 1])
    add(aten.permute.default, r(2, 4, 8, 12), [0, 2, 1, 3])
    add(aten.numpy_T.default, r(8, 12))
    add(aten.transpose.int, r(4, 8, 12), 1, 2)
    add(aten.transpose.int, r(4, 8, 12), -1, 0)
    add(aten.t.default, r(8, 12))
    add(aten.t.default, r(8))
    add(aten.split.Tensor, r(4, 8, 12), 4, 2)
    add(aten.split.Tensor, r(4, 8, 12), 3, -1)
    add(aten.split.Tensor, r(8, 12), 4)
    add(aten.split_with_sizes.default, r(4, 8, 12), [4, 8], 2)
    add(aten.split_with_sizes.default, r(4, 8, 12), [2, 6], 1)
    add(aten.chunk.default, r(4, 8, 12), 3, 2)
    add(aten.chunk.default, r(4, 8, 12), 2)
    add(aten.unbind.int, r(4, 8, 12), 1)
    add(aten.unbind.int, r(3, 8, 12))
    add(aten.tensor_split.sections, r(4, 8, 12), 3, 2)
    add(aten.tensor_split.indices, r(4, 8, 12), [2, 5], 1)
    add(aten.cat.default, [r(4, 8, 12), r(4, 8, 4)], 2)
    add(aten.cat.default, [r(4, 8, 12), r(4, 4, 12), r(4, 4, 12)], 1)
    add(aten.cat.default, [r(4, 8), r(4, 8)])
    add(aten.stack.default, [r(8, 12), r(8, 12)])
    add(aten.stack.default, [r(8, 12), r(8, 12), r(8, 12)], 1)
    add(aten.stack.default, [r(8, 12), r(8, 12)], -1)
    add(aten.slice.Tensor, r(4, 8, 12), 1, 2, 6)
    add(aten.slice.Tensor, r(4, 8, 12), 2, 0, 12, 2)
    add(aten.slice.Tensor, r(4, 8, 12), 1, 0, 9223372036854775807)  # whole
    add(aten.slice.Tensor, r(4, 8, 12), 2, None, None)               # whole
    add(aten.slice.Tensor, r(4, 8, 12), -1, 4)
    add(aten.select.int, r(4, 8, 12), 1, 3)
    add(aten.select.int, r(4, 8, 12), -1, -1)
    add(aten.view_as_complex.default, r(4, 8, 6, 2))
    add(aten.view_as_real.default, r(4, 8, 6, dtype=torch.complex128))
    add(aten._assert_tensor_metadata.default, r(4, 8), dtype=f64)
    add(aten.tril.default, r(8, 8))
    add(aten.tril.default, r(4, 8, 8), -1)
    add(aten.triu.default, r(4, 8, 8), 1)
    add(aten.triu.default, r(2, 4, 8, 12))
    add(aten.repeat.default, r(4, 8, 6), [1, 2, 1])                 # dims repeated once keep their split
    add(aten.repeat.default, r(4, 8), [2, 1, 3])                    # a new dim in front
    add(aten.repeat.default, ints(5, 8, 4), [1, 1])
    add(aten.repeat_interleave.self_int, r(4, 8, 6), 2, 1)          # one count: dim 1 split too
    add(aten.repeat_interleave.self_int, r(4, 8, 6), 3, -1, output_size=18)   # Mamba2's heads: dim whole
    add(aten.repeat_interleave.self_int, r(4, 6), 2)                # flattened
    add(aten.repeat_interleave.self_Tensor, r(4, 8, 6), torch.tensor([2]), 1)
    add(aten.repeat_interleave.self_Tensor, r(4, 8, 6), torch.tensor([1, 2, 0, 3, 1, 1, 2, 2]), 1)

    # -- losses
    NONE, MEAN, SUM = 0, 1, 2
    logits, tgt = r(8, 12), ints(12, 8)
    tgt_ign = tgt.clone()
    tgt_ign[1] = -100
    for red in (NONE, SUM):
        add(aten.cross_entropy_loss.default, logits, tgt, None, red, -100, 0.0)
        add(aten.cross_entropy_loss.default, logits, tgt_ign, None, red, -100, 0.1)
        add(aten.cross_entropy_loss.default, r(8, 12, 4), ints(12, 8, 4), None, red, -100, 0.0)
        add(aten.cross_entropy_loss.default, logits, tgt, pos(12), red, -100, 0.0)
        add(aten.cross_entropy_loss.default, logits, torch.softmax(r(8, 12), -1), None, red, -100, 0.0)
    add(aten.cross_entropy_loss.default, logits, tgt, None, MEAN, -100, 0.0)  # split batch: skipped
    for red in (NONE, MEAN, SUM):
        add(aten.mse_loss.default, r(8, 12), r(8, 12), red)
        add(aten.mse_loss.default, r(4, 8, 12), r(4, 8, 12), red)
        add(aten.l1_loss.default, r(8, 12), r(8, 12), red)
        add(aten.smooth_l1_loss.default, r(8, 12), r(8, 12), red, 0.5)
        add(aten.huber_loss.default, r(8, 12), r(8, 12), red, 0.5)
    add(aten.dropout.default, r(8, 12), 0.5, True)  # random: skipped

    # -- convolutional networks (conv.py)
    x4 = r(4, 8, 6, 6)
    add(aten.conv2d.default, x4, r(12, 8, 3, 3), r(12), [1, 1], [1, 1])
    add(aten.conv2d.default, x4, r(12, 8, 3, 3), None, [2, 2], [1, 1])
    add(aten.conv2d.default, x4, r(8, 1, 3, 3), r(8), [1, 1], [1, 1], [1, 1], 8)   # depthwise
    add(aten.conv2d.default, x4, r(4, 2, 3, 3), r(4), [1, 1], [0, 0], [1, 1], 4)   # groups, gcd 1
    add(aten.conv2d.default, x4, r(8, 2, 3, 3), r(8), [1, 1], [1, 1], [1, 1], 4)   # groups, gcd 2
    add(aten.conv2d.default, r(8, 6, 6), r(12, 8, 3, 3), r(12))                     # unbatched
    add(aten.conv2d.padding, x4, r(12, 8, 3, 3), r(12), [1, 1], "same", [2, 2])
    add(aten.conv1d.default, r(4, 8, 10), r(12, 8, 3), r(12), [2], [1])
    add(aten.conv3d.default, r(2, 4, 4, 4, 4), r(8, 4, 3, 3, 3), None, [1, 1, 1], [1, 1, 1])
    add(aten.convolution.default, x4, r(12, 8, 3, 3), r(12), [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    add(aten.convolution.default, r(4, 8, 5, 5), r(8, 12, 3, 3), r(12), [2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    add(aten.conv_transpose2d.input, r(4, 8, 5, 5), r(8, 12, 3, 3), r(12), [2, 2], [1, 1], [1, 1])
    add(aten.conv_transpose2d.input, r(4, 8, 5, 5), r(8, 1, 3, 3), r(4), [1, 1], [0, 0], [0, 0], 4)
    add(aten.conv_transpose1d.default, r(4, 8, 5), r(8, 4, 3))
    rm, rv = r(8), pos(8)
    add(aten.batch_norm.default, x4, pos(8), r(8), rm.clone(), rv.clone(), True, 0.1, 1e-5, False)
    add(aten.batch_norm.default, x4, pos(8), r(8), None, None, True, 0.1, 1e-5, False)
    add(aten.batch_norm.default, r(8, 12), None, None, None, None, True, 0.1, 1e-5, False)
    add(aten.batch_norm.default, x4, pos(8), r(8), rm, rv, False, 0.1, 1e-5, False)       # eval
    add(aten.batch_norm.default, r(8, 8, 6), None, None, rm, rv, False, 0.1, 1e-5, False)
    add(aten.group_norm.default, x4, 2, r(8), r(8), 1e-5, False)
    add(aten.group_norm.default, r(4, 8, 6), 4)
    add(aten.max_pool2d.default, x4, [2, 2], [2, 2])
    add(aten.max_pool2d.default, r(8, 6, 6), [3, 3], [2, 2], [1, 1], [1, 1], True)     # unbatched
    add(aten.max_pool2d_with_indices.default, x4, [3, 3], [2, 2], [1, 1])
    add(aten.max_pool1d.default, r(4, 8, 10), [2])
    add(aten.avg_pool2d.default, x4, [2, 2], [2, 2])
    add(aten.avg_pool2d.default, x4, [3, 3], [2, 2], [1, 1], True, False)
    add(aten.avg_pool3d.default, r(2, 4, 4, 4, 4), [2, 2, 2])
    add(aten.adaptive_avg_pool2d.default, x4, [1, 1])
    add(aten.adaptive_avg_pool2d.default, x4, [4, 3])
    add(aten._adaptive_avg_pool2d.default, x4, [2, 2])
    add(aten.adaptive_max_pool2d.default, x4, [2, 2])
    add(aten.upsample_nearest2d.vec, r(4, 8, 3, 3), None, [2.0, 2.0])
    add(aten.upsample_nearest2d.default, r(4, 8, 3, 3), [6, 5])
    add(aten.upsample_bilinear2d.vec, r(4, 8, 3, 3), None, False, [2.0, 2.0])
    add(aten.upsample_bilinear2d.vec, r(4, 8, 3, 3), [5, 7], True, None)
    add(aten.upsample_bicubic2d.vec, r(4, 8, 3, 3), None, False, [2.0, 2.0])
    add(aten.upsample_linear1d.vec, r(4, 8, 5), None, False, [2.0])

    # -- masks and positions: indexing, scans, differences, pads (indexing.py)
    add(aten.cumsum.default, r(4, 8), 1)
    add(aten.cumsum.default, mask(4, 8), -1)                     # bool in, int64 out
    add(aten.diff.default, r(4, 8), 1, -1, r(4, 1))              # with prepend
    add(aten.diff.default, r(4, 8, 4), 2, 1, None, r(4, 2, 4))   # second difference, append
    add(aten.pad.default, ints(20, 4, 8), [0, 1], "constant", -100.0)   # labels shifted for the loss
    add(aten.pad.default, r(4, 8, 6), [1, 2], "constant", 0.0)
    add(aten.pad.default, r(4, 8, 6), [1, 1], "reflect")
    add(aten.constant_pad_nd.default, r(4, 8, 8), [0, 0, 1, 2], 1.5)
    add(aten.index.Tensor, r(8, 12), [ints(8, 4, 1), ints(12, 1, 8)])              # broadcast indices
    add(aten.index.Tensor, ints(9, 4, 8), [torch.arange(4).view(4, 1, 1, 1), ints(8, 1, 1, 8, 1)])
    add(aten.index.Tensor, r(8, 12, 4), [None, ints(12, 8)])                        # a whole dim first
    add(aten.index.Tensor, r(4, 8, 12), [ints(4, 6), None, ints(12, 6)])           # not adjacent
    add(aten.index.Tensor, r(8, 12), [mask(8)])                                     # a mask: no split
    add(aten.index.Tensor, r(8, 6), [ints(8, 16)])                                  # tokens in experts' order
    add(aten.__and__.Tensor, mask(4, 8, 8), mask(1, 8, 8))

    # -- routing and expert matmuls (moe.py)
    add(aten.topk.default, r(8, 12), 3)
    add(aten.topk.default, r(8, 12), 2, 0, False)
    add(aten.sort.default, r(8, 12))
    add(aten.argsort.default, r(8, 12), 0, True)
    add(aten.sort.stable, ints(4, 8, 12), stable=True, dim=1)
    add(aten.histc.default, r(8, 16), 10, -2, 2)
    add(aten.gather.default, r(8, 12), 1, ints(12, 8, 5))
    add(aten.scatter.src, r(8, 12), 1, r(8, 12).argsort(1)[:, :5], r(8, 5))    # distinct per row
    add(aten.scatter_add.default, r(8, 12), 0, ints(8, 4, 12), r(4, 12))
    add(aten.scatter_add.default, r(8, 12), 0, ints(8, 4, 6), r(4, 12))      # index narrower than src
    add(aten.scatter_add.default, r(8, 12), 0, ints(8, 2, 12), r(4, 12))     # fewer rows: index's split only
    add(aten.scatter_add.default, r(4, 8, 12), 1, ints(8, 4, 16, 12), r(4, 16, 12))
    add(aten.index_add.default, r(8, 12), 0, ints(8, 16), r(16, 12))         # experts' rows back to tokens
    add(aten.index_add.default, r(4, 8, 12), 1, ints(8, 4), r(4, 4, 12), alpha=0.5)
    add(aten.index_add.default, ints(9, 8, 12), 0, ints(8, 4), ints(9, 4, 12))
    add(aten.index_put.default, r(8, 12), [ints(8, 6)], r(6, 12), True)         # accumulate
    add(aten.index_put.default, r(8, 12, 4), [None, r(12).argsort()[:5]], r(5, 4))
    hit = torch.arange(48).reshape(8, 6) % 3 == 0                                 # a 2-d mask covers 2 dims
    add(aten.index_put.default, r(8, 6, 4), [hit], r(4))
    # torch's CPU grouped matmul takes bfloat16 in rows of 16 bytes; values of an eighth keep the
    # rounding of partial sums (bfloat16's 8 bits) within its tolerance's absolute part
    bf16 = torch.bfloat16
    add(aten._grouped_mm.default, (r(16, 32) / 8).to(bf16), (r(4, 32, 32) / 8).to(bf16),
        offs=torch.tensor([3, 8, 8, 16], dtype=torch.int32))

    # -- factories: only all-B
    add(aten.arange.default, 8, dtype=torch.int64)
    add(aten.arange.start_step, 0, 16, 2, dtype=f64)
    add(aten.zeros.default, [4, 8], dtype=f64)
    add(aten.ones.default, [8], dtype=torch.float32)
    add(aten.full.default, [4, 8], 2.5, dtype=f64)

    # -- FlexAttention (flex.py): a causal, a document, a per-head window and an ALiBi-like mask
    C.extend(flex_cases(r))

    # -- along a split dim, by collectives (runtime.scans; checked in a simulated group): the
    # routing's order of the (token, expert) pairs (ties, an expert with no rows, a key range
    # too wide to count: gathered), and the experts' offsets
    keys = ints(6, 24)
    add(aten.argsort.stable, keys.masked_fill(keys == 2, 5), stable=True)
    add(aten.argsort.stable, ints(4, 16).int(), stable=True, descending=True)
    add(aten.argsort.stable, ints(1000, 16), stable=True)
    add(aten.sort.default, ints(4, 32))                          # transformers' (values, order)
    add(aten.sort.stable, ints(4, 16).int(), stable=True, descending=True)
    add(aten.argsort.default, ints(3, 32), 0, True)
    add(aten.cumsum.default, ints(5, 8).int(), 0, dtype=torch.int32)
    return C


# the kernel options torch.export records for flex_attention called with none
FLEX_OPTIONS = {"BACKEND": "AUTO", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False,
                "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": False, "OUTPUT_MAX": False}


def flex_graph(fn, *buffers, score=False):
    """A mod as torch.export holds it: traced on scalar indices (and score), its buffers after."""
    from torch.fx.experimental.proxy_tensor import make_fx
    scalars = ([torch.zeros((), dtype=torch.float64)] if score else []) + \
        [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    return make_fx(fn)(*scalars, *buffers)


def flex_case(q, k, v, mask_mod, mask_bufs=(), mask_b=None, mask_h=None, score_mod=None, score_bufs=(), block=64):
    """(op, args): flex_attention's higher-order op on real tensors, with a BlockMask made by
    create_block_mask over (mask_b, mask_h) rows and heads (None: one for all) and mods traced
    as export traces them. Mods index buffers with ``aten.index`` (export's ``buf[b, q_idx]``)."""
    from autoshard.rules.flex import FLEX
    from torch.nn.attention.flex_attention import create_block_mask
    score_mod = score_mod or (lambda score, b, h, q_idx, kv_idx: score)
    block = create_block_mask(lambda b, h, i, j: mask_mod(b, h, i, j, *mask_bufs), mask_b, mask_h,
                              q.shape[2], k.shape[2], device="cpu", BLOCK_SIZE=block)
    mods = flex_graph(score_mod, *score_bufs, score=True), flex_graph(mask_mod, *mask_bufs)
    return (FLEX, (q, k, v, mods[0], block.as_tuple()[:-1] + (mods[1],), q.shape[-1] ** -0.5, dict(FLEX_OPTIONS),
                   tuple(score_bufs), tuple(mask_bufs)), {})


def flex_cases(r) -> list:
    index = aten.index.Tensor
    n, heads, seq = 4, 4, 128    # two blocks of 64 each way
    at = torch.arange(seq)
    doc = (at >= torch.tensor([[20], [45], [70], [95]])).long() + (at >= 110).long()   # each row its own documents
    window = torch.tensor([8, 32, 100, 128])           # a window per head
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def causal(b, h, i, j):
        return i >= j

    def document(b, h, i, j, d):
        return (index(d, [b, i]) == index(d, [b, j])) & (i >= j)

    def windowed(b, h, i, j, w):
        return (i >= j) & (i - j < index(w, [h]))

    def alibi(score, b, h, i, j, s):
        return score + index(s, [h]) * (j - i)

    qkv = [r(n, heads, seq, 8) for _ in range(3)]
    return [flex_case(*qkv, causal),
            flex_case(*qkv, document, (doc,), mask_b=n),
            flex_case(r(n, heads, seq, 8), r(n, 2, seq, 8), r(n, 2, seq, 4), windowed, (window,), mask_h=heads),
            flex_case(*qkv, causal, mask_b=n, mask_h=heads, score_mod=alibi, score_bufs=(slopes,))]


# ---- command line -----------------------------------------------------------------------------
