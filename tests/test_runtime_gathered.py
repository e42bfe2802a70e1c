"""A linear on an all-gathered input, decomposed (runtime.linear_local_part / linear_gathered):
the same output and gradients as the linear on the whole input, and the weight's gradient made
by one matmul over every gathered row, with no weight-sized sum of two halves."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from autoshard import runtime


def _mesh(p, me):
    """What linear_gathered asks of the rank's mesh: the axis's size and this rank's place."""
    return SimpleNamespace(size=lambda axis: p, coord=lambda axis: me)


def _case(shape, dim, p, me, bias=True):
    torch.manual_seed(0)
    whole = torch.randn(*shape, dtype=torch.float64)
    w = torch.randn(24, shape[-1], dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, requires_grad=True) if bias else None
    g = torch.randn(*shape[:-1], 24, dtype=torch.float64)
    # the reference: the undecomposed linear on the whole input
    ref_in = whole.clone().requires_grad_()
    F.linear(ref_in, w, b).backward(g)
    ref = (ref_in.grad, w.grad.clone(), None if b is None else b.grad.clone())
    w.grad = None
    if b is not None:
        b.grad = None
    # this rank's own block, and the gather's result (whose own block is that block)
    own = whole.chunk(p, dim)[me].clone().requires_grad_()
    gathered = whole.clone().requires_grad_()
    with runtime.active(_mesh(p, me)):
        part = runtime.linear_local_part(own, w, b, dim)
        out = runtime.linear_gathered(gathered, part, w, b, 0, dim)
    return out, g, own, gathered, w, b, ref


@pytest.mark.parametrize("shape,dim,p,me", [((8, 16), 0, 2, 1), ((4, 6, 16), 1, 3, 0), ((4, 6, 16), 0, 4, 2)])
def test_decomposed_linear_equals_the_linear_on_the_whole_input(shape, dim, p, me):
    out, g, own, gathered, w, b, ref = _case(shape, dim, p, me)
    assert torch.allclose(out, F.linear(gathered.detach(), w, b))
    out.backward(g)
    # the gathered input's own block gets nothing from linear_gathered (the dual reduce-scatter
    # sums the other ranks' contributions there); linear_local_part gives this rank's own
    blocks = list(gathered.grad.chunk(p, dim))
    assert torch.count_nonzero(blocks[me]) == 0
    blocks[me] = own.grad
    assert torch.allclose(torch.cat(blocks, dim), ref[0])
    assert torch.allclose(w.grad, ref[1]) and torch.allclose(b.grad, ref[2])


def test_decomposed_linear_without_bias_and_without_grad():
    out, g, own, gathered, w, b, ref = _case((8, 16), 0, 2, 0, bias=False)
    out.backward(g)
    assert torch.allclose(w.grad, ref[1])
    with torch.no_grad(), runtime.active(_mesh(2, 1)):
        x = gathered.detach()
        part = runtime.linear_local_part(x.chunk(2, 0)[1], w, None, 0)
        assert torch.allclose(runtime.linear_gathered(x, part, w, None, 0, 0), F.linear(x, w))
    # the features' dim gathered: no own rows to compute early
    assert runtime.linear_local_part(own, w, None, -1) is None


def test_weight_gradient_is_one_matmul_with_no_sum_of_halves():
    out, g, own, gathered, w, b, _ = _case((64, 32), 0, 2, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.backward(g)
    ops = [e.name for e in prof.events()]
    # other rows' input gradient, own rows' input gradient, the weight's gradient: three matmuls,
    # and no add of two weight-sized halves (autograd's accumulation of a weight used twice)
    assert ops.count("aten::mm") == 3, ops
    assert "aten::add" not in ops and "aten::add_" not in ops, ops
