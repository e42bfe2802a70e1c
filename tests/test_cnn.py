"""Convolutional networks train exactly as on one device: a ResNet and a UNet in a real gloo group
of 4 (1-D and 2x2 meshes) against an unsharded reference, for the default plan, a data-parallel
and a tensor-parallel pinned plan; batch norm over a split batch uses the whole batch's
statistics."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.passes.annotate import UnknownOpWarning
from autoshard.check.validate import signatures
from cases import step_on_the_same_gradients
from models_cnn import RESNET_TP, UNET_TP, ResNet, UNet

aten = torch.ops.aten
TOL = 1e-5


def _parallelize(model, inputs, **kwargs):
    with warnings.catch_warnings():
        # num_batches_tracked += 1 runs replicated, as it must
        warnings.filterwarnings("ignore", "autoshard has no sharding rule for add_", UnknownOpWarning)
        return autoshard.parallelize(model, inputs, **kwargs)


def _weighted(out, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (out * torch.randn(out.shape, generator=g)).mean()


def _err(got, want) -> float:
    """Largest difference, relative to the reference's largest magnitude where that is above 1."""
    got, want = got.detach().double(), want.detach().double()
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _max_diff(a: dict, b: dict) -> dict:
    return {n: _err(a[n], b[n]) for n in b}


def cnn_case(name, mesh, pin, optimizer="sgd", check_eval=False):
    """Two training steps and, optionally, an eval-mode call on the parallel model and on the
    reference: how far apart their outputs, gradients, parameters and buffers are."""
    torch.manual_seed(0)
    model = {"resnet": ResNet, "unet": UNet}[name]()
    x = torch.randn(8, 3, 16, 16)
    ref = copy.deepcopy(model)
    pm = _parallelize(model, (x,), mesh=mesh, pin=pin)
    make_opt = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
                "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1)}[optimizer]
    opt, ref_opt = make_opt(pm.parameters()), make_opt(ref.parameters())
    res = {}
    out, ref_out = pm(x), ref(x)
    _weighted(out).backward()
    _weighted(ref_out).backward()
    res["out"] = _err(out, ref_out)
    res["program"] = pm.program
    ref_params = dict(ref.named_parameters())
    res["grads"] = {n: _err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()}
    res["buffers"] = _max_diff(dict(pm.named_buffers()), dict(ref.named_buffers()))
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    res["params"] = {n: _err(p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()}
    opt.zero_grad()
    res["out2"] = _err(pm(x), ref(x))
    res["buffers2"] = _max_diff(dict(pm.named_buffers()), dict(ref.named_buffers()))
    if check_eval:
        pm.eval()
        ref.eval()
        with torch.no_grad():
            res["eval"] = _err(pm(x), ref(x))
    res["placements"] = {n: pm.plan.placement(n) for n, _ in pm.named_parameters()}
    res["bn_inputs"] = [c.inputs[0] for c in pm.plan.nodes.values() if c.op == "batch_norm.default"]
    return res


def _assert_exact(res):
    for key in ("out", "out2", "eval"):
        assert res.get(key, 0.0) <= TOL, (key, res[key])
    for key in ("grads", "params", "buffers", "buffers2"):
        bad = {n: e for n, e in res[key].items() if e > TOL}
        assert not bad, (key, bad)


def norms(count, placement):
    """Pins of a model's batch norm nodes (named batch_norm, batch_norm_1, ... by torch.export):
    for these small models the solver prefers to gather the batch over gathering the statistics."""
    return {"batch_norm" + (f"_{i}" if i else ""): placement for i in range(count)}


BATCH_NORMS = {"resnet": 6, "unet": 4}
TP_WEIGHTS = {"resnet": RESNET_TP, "unet": UNET_TP}
# batch norm over a split batch
DP = {name: {"x": ("S(0)",), **norms(n, ("S(0)",))} for name, n in BATCH_NORMS.items()}
# batch norm over split channels, keeping running statistics whole
TP = {name: {**TP_WEIGHTS[name], **norms(n, ("S(1)",))} for name, n in BATCH_NORMS.items()}
# data parallel on axis 0, tensor parallel on axis 1
TP2 = {name: {**{k: ("B",) + v for k, v in TP_WEIGHTS[name].items()}, "x": ("S(0)", "B"),
              **norms(n, ("S(0)", "S(1)"))} for name, n in BATCH_NORMS.items()}

CASES = [(name, mesh, pins, kind) for name in ("resnet", "unet") for mesh, pins, kind in (
    ((4,), None, "default"), ((4,), DP[name], "dp"), ((4,), TP[name], "tp"),
    ((2, 2), None, "default"), ((2, 2), TP2[name], "tp"))]


@pytest.mark.parametrize("name,mesh,pin,kind", CASES, ids=[f"{n}-{'x'.join(map(str, m))}-{k}" for n, m, _, k in CASES])
def test_cnn_matches_single_device(world4, name, mesh, pin, kind):
    res = world4.run(cnn_case, name, mesh, pin, "adam" if kind == "tp" else "sgd", kind == "dp")
    for r in res:
        _assert_exact(r)
    r = res[0]
    if kind != "default":
        # a split batch: statistics gathered; split channels: running-statistics updates gathered
        assert r["bn_inputs"] == [pin["batch_norm"]] * BATCH_NORMS[name], r["bn_inputs"]
        assert "autoshard_runtime_batch_norm_train" in r["program"]
    if kind == "tp":
        for k, v in pin.items():
            if k in r["placements"]:
                assert r["placements"][k] == v, (k, r["placements"][k])


# ---- batch norm over a split batch is the whole batch's --------------------------------------------

class Norm(nn.Module):
    def __init__(self, channels, spatial, affine):
        super().__init__()
        self.bn = (nn.BatchNorm1d if spatial < 2 else nn.BatchNorm2d)(channels, affine=affine)
        if affine:
            with torch.no_grad():
                self.bn.weight.uniform_(0.5, 1.5)
                self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return self.bn(x)


def bn_case(mesh, pin, shape, affine=True):
    """A batch whose shards have very different statistics, normalized by a parallel batch norm and
    by a single-device one; and by batch norm on this rank's shard alone, which must differ."""
    torch.manual_seed(0)
    model = Norm(shape[1], len(shape) - 2, affine)
    x = torch.randn(shape)
    quarter = shape[0] // 4
    for r in range(4):   # shard r: mean 4r, spread r + 1
        x[r * quarter:(r + 1) * quarter] = x[r * quarter:(r + 1) * quarter] * (r + 1) + 4 * r
    ref = copy.deepcopy(model)
    pm = _parallelize(model, (x,), mesh=mesh, pin=pin)
    xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref_out = pm(xp), ref(xr)
    _weighted(out).backward()
    _weighted(ref_out).backward()
    res = {"out": _err(out, ref_out), "x.grad": _err(xp.grad, xr.grad)}
    ref_params = dict(ref.named_parameters())
    res.update({n: _err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()})
    res.update(_max_diff(dict(pm.named_buffers()), dict(ref.named_buffers())))
    rank = torch.distributed.get_rank()
    local = slice(rank * quarter, (rank + 1) * quarter)
    per_shard = nn.functional.batch_norm(x[local], None, None, training=True)
    whole = nn.functional.batch_norm(x, None, None, training=True)
    res["per_shard_gap"] = (per_shard - whole[local]).abs().max().item()
    res["program"] = pm.program
    return res


BN_CASES = [
    ((4,), ("S(0)",), (8, 4, 4, 4)),
    ((4,), ("S(0)",), (16, 6)),                   # BatchNorm1d on (N, C)
    ((2, 2), ("S(0)", "S(0)"), (8, 4, 4, 4)),     # the batch cut by both axes
    ((2, 2), ("S(0)", "S(2)"), (8, 4, 4, 4)),     # batch on one axis, height on the other
    ((2, 2), ("S(0)", "S(1)"), (8, 4, 6)),        # batch on one axis, channels on the other
]


@pytest.mark.parametrize("mesh,placement,shape", BN_CASES, ids=[f"{'x'.join(map(str, m))}-{','.join(p)}-{len(s)}d"
                                                                for m, p, s in BN_CASES])
def test_batch_norm_uses_the_whole_batch(world4, mesh, placement, shape):
    pin = {"x": placement, "batch_norm": placement}
    for r in world4.run(bn_case, mesh, pin, shape, len(shape) != 2):
        assert r["per_shard_gap"] > 0.5      # a per-shard batch norm would be far off
        assert "autoshard_runtime_batch_norm_train" in r["program"]
        bad = {k: v for k, v in r.items() if k not in ("per_shard_gap", "program") and v > TOL}
        assert not bad, bad


# ---- rules, literally ------------------------------------------------------------------------------

def sigs(op, *args):
    return [repr(s) for s in signatures(op, args)]


def test_convolution_signatures():
    x, w, b = torch.randn(4, 8, 6, 6), torch.randn(12, 8, 3, 3), torch.randn(12)
    assert sigs(aten.conv2d.default, x, w, b, [1, 1], [1, 1]) == [
        "(S(0), B, B) -> S(0)", "(B, S(0), S(0)) -> S(1)", "(S(1), S(1), P) -> P", "(P, B, P) -> P", "(B, P, P) -> P"]
    # depthwise: each rank holds whole groups; groups of 4 input and 4 output channels: no channel split
    grouped = (x, torch.randn(8, 1, 3, 3), None, [1, 1], [1, 1], [1, 1])
    assert "(S(1), S(0)) -> S(1)" in sigs(aten.conv2d.default, *grouped, 8)
    grouped = (x, torch.randn(8, 2, 3, 3), None, [1, 1], [1, 1], [1, 1])
    assert not any("S(1)" in s for s in sigs(aten.conv2d.default, *grouped, 4))
    # transposed: the weight is (in, out, k, k)
    assert sigs(aten.conv_transpose2d.input, x, torch.randn(8, 12, 3, 3)) == [
        "(S(0), B) -> S(0)", "(B, S(1)) -> S(1)", "(S(1), S(0)) -> P", "(P, B) -> P", "(B, P) -> P"]


def test_norm_and_pool_signatures():
    x, c = torch.randn(8, 4, 6, 6), torch.randn(4)
    train = sigs(aten.batch_norm.default, x, c, c, c, c.abs(), True, 0.1, 1e-5, False)
    assert train == ["(S(0), B, B, B, B) -> S(0)", "(S(2), B, B, B, B) -> S(2)", "(S(3), B, B, B, B) -> S(3)",
                     "(S(1), S(0), S(0), B, B) -> S(1)"]
    assert sigs(aten.batch_norm.default, x, c, c, c, c.abs(), False, 0.1, 1e-5, False)[-1] == \
        "(S(1), S(0), S(0), S(0), S(0)) -> S(1)"
    assert sigs(aten.max_pool2d.default, x, [2, 2]) == ["(S(0)) -> S(0)", "(S(1)) -> S(1)"]
    assert sigs(aten.avg_pool2d.default, x, [2, 2]) == ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"]
    assert sigs(aten.upsample_bilinear2d.vec, x, None, False, [2.0, 2.0])[-1] == "(P) -> P"
