"""Uneven splits: a dim that does not divide by its axes split as DTensor's Shard splits it
(torch.chunk: 17 tokens over 4 ranks are 5, 5, 5, 2), exact against one device in a real gloo
group of 4, on meshes (4,) and (2, 2)."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import placement as pl
from autoshard.passes.capture import capture
from autoshard.rules import OpCtx, rule_for
from cases import run_each

aten = torch.ops.aten


class Attention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class ViTBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """16 patches of a 16 x 16 image and a class token: 17 tokens."""

    def __init__(self, d=32, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 17, d) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(2))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)[:, 0])


class TwoLinears(nn.Module):
    """10 features between two linears, and a mean over them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 10), nn.Linear(10, 6)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h).square().mean() + h.mean()


def _make(name):
    torch.manual_seed(0)
    if name == "vit":
        return ViT(), (torch.randn(2, 3, 16, 16),)
    return TwoLinears(), (torch.randn(8, 16),)


def _pins(model, inputs, mesh, ops, shape):
    """Every node of ``ops`` with output ``shape``, pinned to S(1) on every axis."""
    graph = capture(model, inputs)
    return {n.name: ("S(1)",) * len(mesh) for n in graph.nodes
            if n.kind == "op" and n.op_name in ops and n.outputs and n.outputs[0].shape == shape}


def _token_pins(model, inputs, mesh):
    """The tokens split over every axis from the position add through both blocks, and the
    head's 10 classes."""
    return {**_pins(model, inputs, mesh, ("add.Tensor",), (2, 17, 32)),
            **_pins(model, inputs, mesh, ("linear.default",), (2, 10))}


def _feature_pins(model, inputs, mesh):
    """fc1's 10 output features split over every axis, through the relu into fc2 and the mean."""
    return _pins(model, inputs, mesh, ("linear.default", "relu.default"), (8, 10))


def train_case(name, mesh, outputs="whole"):
    model, inputs = _make(name)
    ref = copy.deepcopy(model)
    pins = (_token_pins if name == "vit" else _feature_pins)(model, inputs, mesh)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=pins, outputs=outputs)
    out, ref_out = pm(*inputs), ref(*inputs)
    shares = None
    if outputs == "dtensor":   # the logits kept split: this rank's chunk of the 10 classes
        shares = (tuple(map(str, out.placements)), tuple(out.to_local().shape))
        out = out.full_tensor()
    if name == "vit":   # the loss on the logits
        labels = torch.arange(2) + 3
        out, ref_out = F.cross_entropy(out, labels), F.cross_entropy(ref_out, labels)
    out.backward()
    ref_out.backward()
    ref_params = dict(ref.named_parameters())
    grads = {n: (p.grad.full_tensor() - ref_params[n].grad).abs().max().item() for n, p in pm.named_parameters()}
    uneven = sorted(n for n, c in pm.plan.nodes.items()
                    if c.kind == "op" and any(not pl.is_even(s, tuple(map(pl.parse, o)), mesh)
                                              for s, o in zip(c.shapes, c.outputs)))
    means = [n for n, c in pm.plan.nodes.items() if c.op.startswith("mean") and c.inputs[0][0].startswith("S")]
    return {"out": abs(out.item() - ref_out.item()), "grads": grads, "uneven": uneven, "program": pm.program,
            "split_means": means, "shares": shares,
            "summary": str(pm.plan), "explain": pm.plan.explain(uneven[0]) if uneven else ""}


# every conversion between uneven layouts, run by the runtime's steps against the whole tensor

CONVERSIONS = {
    (4,): [("S(0)", "B"), ("S(0)", "S(1)"), ("S(1)", "S(0)"), ("B", "S(0)"), ("P", "S(0)"), ("P", "S(1)")],
    (2, 2): [(("S(0)", "S(0)"), ("B", "B")), (("S(0)", "S(0)"), ("S(1)", "S(1)")), (("S(0)", "B"), ("S(0)", "S(0)")),
             (("P", "S(0)"), ("S(0)", "S(0)")), (("S(0)", "S(1)"), ("S(1)", "S(0)")), (("P", "P"), ("S(0)", "S(1)")),
             (("P", "P"), ("B", "B")), (("B", "S(0)"), ("S(1)", "P"))],
}


def conversions_case(mesh):
    """Each conversion of CONVERSIONS on a (17, 10) tensor, forward and the dual in backward:
    where this rank's result or gradient differs from the whole tensor's chunk, a message."""
    from torch.distributed.device_mesh import init_device_mesh
    from autoshard import runtime
    from autoshard import convert
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(17, 10, generator=g), torch.randn(17, 10, generator=g)
    rm = runtime.RankMesh(init_device_mesh("cpu", mesh), torch.Generator())
    coords = rm.coords
    share = [(c + 1) / sum(range(1, n + 1)) for c, n in zip(coords, mesh)]   # a partial sum's part

    def cut(t, placement, keep=(pl.Split,)):
        for a, q in enumerate(placement):
            if isinstance(q, pl.Split) and pl.Split in keep:
                t = t.chunk(mesh[a], q.dim)[coords[a]]
            elif isinstance(q, pl.Partial) and pl.Partial in keep:
                t = t * share[a]
        return t

    bad = []
    with runtime.active(rm):
        for src, dst in CONVERSIONS[mesh]:
            src, dst = pl.parse_nd(src, len(mesh)), pl.parse_nd(dst, len(mesh))
            local = cut(x, src, (pl.Split, pl.Partial)).clone().requires_grad_()
            steps = convert.transition(pl.local_shape(x.shape, src, mesh), src, dst, mesh, whole=x.shape)
            out = local
            for st, kw in zip(steps, convert.rank_sizes(x.shape, src, steps, mesh, coords)):
                kw = {"axis": st.axis, **kw, **{k: v for k, v in (("dim", st.dim), ("dim2", st.dim2)) if v is not None}}
                out = runtime.STEP_FUNCTIONS[st.kind](out, **kw)
            got = out.detach()
            for a, q in enumerate(dst):   # a partial result: summed over its axis, as P means
                if isinstance(q, pl.Partial):
                    torch.distributed.all_reduce(got, group=rm.groups[a])
            if not torch.allclose(got, cut(x, dst), atol=1e-6):
                bad.append(f"{src} -> {dst}: forward differs")
            (out * cut(w, dst)).sum().backward()
            grad = local.grad
            for a, q in enumerate(src):   # a broadcast input's gradient arrives partial: sum it
                if isinstance(q, pl.Broadcast) and mesh[a] > 1:
                    torch.distributed.all_reduce(grad, group=rm.groups[a])
            held = math.prod(n for q, n in zip(dst, mesh) if isinstance(q, pl.Broadcast))
            if not torch.allclose(grad, cut(w * held, src), atol=1e-5):
                bad.append(f"{src} -> {dst}: gradient differs")
    return {"bad": bad}


def conversions():
    return [conversions_case((4,)), conversions_case((2, 2))]


CASES = [("vit", (4,)), ("vit", (2, 2)), ("linears", (4,)), ("linears", (2, 2))]


def run_cases(cases):
    return run_each(train_case, cases + [("vit", (4,), "dtensor")])


@pytest.fixture(scope="module")
def results(world4):
    return dict(zip(CASES + [("vit", (4,), "dtensor")], world4.run(run_cases, CASES)[0]))


def test_every_uneven_conversion_and_its_dual(world4):
    """Gathers, reduce-scatters, all-to-alls, slices and pads of 17 x 10 over (4,) and (2, 2)
    (5, 5, 5, 2 rows, 3, 3, 3, 1 columns; nested, 5, 4, 4, 4): every rank's result is its chunk
    of the whole tensor, and backward's dual gives its chunk of the gradient."""
    for rank, res in enumerate(world4.run(conversions)):
        for mesh, one in zip(((4,), (2, 2)), res):
            assert not one["bad"], (rank, mesh, one["bad"])


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_uneven_split_matches_single_device(results, case):
    res = results[case]
    assert "error" not in res, res.get("error")
    assert res["out"] <= 1e-5, res["out"]
    for n, e in res["grads"].items():
        assert e <= 1e-5, (n, e)
    assert res["uneven"], "the plan splits nothing unevenly: nothing was tested"
    # rank 0's program holds its groups' chunks: 17 over 4; over (2, 2) 9, 8 on axis 0, then its
    # 9 as 5, 4 on axis 1; 10 over 4; over (2, 2) 5, 5 (even) and its 5 as 3, 2
    want = {("vit", (4,)): ["(5, 5, 5, 2)"], ("vit", (2, 2)): ["(9, 8)", "(5, 4)"],
            ("linears", (4,)): ["(3, 3, 3, 1)"], ("linears", (2, 2)): ["(3, 2)"]}[case]
    for sizes in want:
        assert sizes in res["program"], (sizes, res["program"])
    if case[0] == "linears":   # a mean over the uneven features: each rank's scaled by its own share
        assert res["split_means"], res["summary"]


def test_uneven_output_is_dtensors_own_layout(results):
    """outputs="dtensor": the logits' 10 classes handed back as DTensor's Shard(1) holds them
    (rank 0: 3 of 3, 3, 3, 1), its full tensor and every gradient those of one device."""
    res = results[("vit", (4,), "dtensor")]
    assert "error" not in res, res.get("error")
    assert res["shares"] == (("S(1)",), (2, 3)), res["shares"]
    assert res["out"] <= 1e-5 and max(res["grads"].values()) <= 1e-5, res


def test_plan_shows_uneven_sizes(results):
    res = results[("vit", (4,))]
    assert "sizes 5,5,5,2" in res["summary"], res["summary"]
    assert "5,5,5,2" in res["explain"], res["explain"]
    res = results[("vit", (2, 2))]
    assert "sizes 5,4,4,4" in res["summary"], res["summary"]   # 17 cut by axis 0 (9, 8), then by axis 1
    assert "sizes 3,3,3,1" in results[("linears", (4,))]["summary"]


def test_vit_has_no_compute_fallback():
    """17 tokens on a mesh of 4: the position add and the blocks split the tokens unevenly."""
    cov = autoshard.coverage(*_make("vit"), world=4)
    assert not cov.compute_fallbacks, cov


def test_uneven_chunks_are_dtensors():
    """The layout followed is DTensor's own (torch.chunk), not one extra row on the first ranks."""
    assert pl.chunk_sizes(17, 4) == (5, 5, 5, 2) == tuple(len(c) for c in torch.arange(17).chunk(4))
    assert pl.local_shape((2, 17, 8), (pl.S(1),), (4,)) == (2, 5, 8)   # priced by the largest
    assert pl.rank_shape((2, 17, 8), (pl.S(1),), (4,), (3,)) == (2, 2, 8)
    assert pl.rank_shape((2, 17, 8), (pl.S(1), pl.S(1)), (2, 2), (1, 0)) == (2, 4, 8)
    assert pl.local_shape((5,), (pl.S(0),), (4,)) is None   # a rank would hold nothing


def test_merging_an_uneven_dim_is_refused():
    """(17, 2, 32) viewed as (34, 32): a chunk of the 17 tokens (5, 5, 5, 2) is no chunk of the
    34 rows (9, 9, 9, 7); evenly, (16, 2, 32) as (32, 32), it is."""
    from autoshard.passes.annotate import expand
    from autoshard.ir import TensorMeta
    from autoshard.rules.uneven import allows_uneven
    rule = rule_for(aten.view.default)
    assert allows_uneven(aten.view.default)
    for n, ok in ((17, False), (16, True)):
        a, b = TensorMeta((n, 2, 32), torch.float32), TensorMeta((2 * n, 32), torch.float32)
        sigs = rule(OpCtx(aten.view.default, (None, [2 * n, 32]), {}, [a.shape], [b.shape]))
        outs = {repr(s.outputs[0]) for s in expand(sigs, [a], [b], (4,), True)}
        assert ("(S(0),)" in outs) == ok and "(S(1),)" in outs, (n, outs)
    a = TensorMeta((17, 32), torch.float32)
    sigs = rule(OpCtx(aten.view.default, (None, [17, 4, 8]), {}, [a.shape], [(17, 4, 8)]))
    ok = expand(sigs, [a], [TensorMeta((17, 4, 8), torch.float32)], (4,), True)
    assert any(s.inputs[0] == s.outputs[0] == (pl.S(0),) for s in ok)     # the tokens kept as a dim: fine


def test_a_two_dim_mask_covers_two_dims_of_index_put():
    """x[mask] = v with an (8, 6) boolean mask indexes dims 0 and 1 of x (v broadcast over the
    true entries): only dim 2 splits. Taken for one dim, the mask let dim 1 split."""
    from autoshard.check import validate
    x, hit = torch.randn(8, 6, 4, dtype=torch.float64), torch.arange(48).reshape(8, 6) % 3 == 0
    args = (x, [hit], torch.randn(4, dtype=torch.float64))
    sigs = validate.signatures(aten.index_put.default, args)
    assert [repr(s) for s in sigs] == ["(S(2), B, S(0)) -> S(2)"]
    for s in sigs:
        assert validate.check_signature(aten.index_put.default, args, {}, s, 2)[0] == "ok", s


def test_priced_by_the_largest_chunk():
    """10 features over 4 are priced as 12 would be, 3 per rank: the linear's compute and the
    output's gather (8 x 3 floats from each rank); memory counts local_shape, the largest chunk."""
    def planned(n):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, n), nn.ReLU())
        inputs = (torch.randn(8, 16),)
        pins = _pins(model, inputs, (4,), ("linear.default",), (8, n))
        plan = autoshard.plan(model, inputs, mesh=(4,), pin=pins)
        gathers = [(c.kind, c.bytes) for c in plan.collectives if c.kind == "all_gather"]
        return plan.nodes[next(iter(pins))].compute, gathers
    ten = planned(10)
    assert ten == planned(12) and ten[1] == [("all_gather", 8 * 3 * 4)], ten
