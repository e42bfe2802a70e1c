"""Rules for ops real models call that ran replicated for want of one (issue 32): repeat
(DeBERTa-v2), repeat_interleave (Mamba2), new_zeros and the other new_* (DeepSeek-V3's MLA),
copy (a copy_ functionalized), argsort, sort, cumsum, amax/max and argmax (routing), scatter_add and index_add with
their partial sums (a mixture of experts' combine), and a user's own torch.library op through
``autoshard.rules.register``, shown on a copy of torchtitan's ``deterministic_scatter_add``.

Each rule's signatures, literally and checked by the validator against the real op; a small model
of all of them exact against one device in a gloo group of 2, under the solver's plan and a
pinned one; and none of them replicated in a coverage report."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.check.validate import check_signature, default_cases, op_name, signatures, validate
from autoshard.passes.annotate import UnknownOpWarning
from autoshard.placement import B, P, Split
from autoshard.rules import registry
from autoshard.rules.moe import scatter_add_rows
from autoshard.rules.registry import OpCtx, Sig
from cases import against_one_device, by_case, run_each

aten = torch.ops.aten
TOL = 1e-5
SLOW = autoshard.Cluster(name="slow-compute", peak_flops=2e9, peak_flops_fp32=1e9, memory_bandwidth=4e9)


# ---- a user's own op: torchtitan's deterministic_scatter_add (torchtitan.ops.scatter_add), copied --

@torch.library.custom_op("autoshard_test::deterministic_scatter_add", mutates_args=())
def deterministic_scatter_add(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        return out.scatter_add(dim=0, index=index, src=src)
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn_only)


@deterministic_scatter_add.register_fake
def _(out, index, src):
    return torch.empty_like(out)


def _backward(ctx, grad_output):
    (index,) = ctx.saved_tensors
    return grad_output, None, torch.gather(grad_output, dim=0, index=index)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


deterministic_scatter_add.register_autograd(_backward, setup_context=_setup_context)
SCATTER = torch.ops.autoshard_test.deterministic_scatter_add
# out's rows are where index sends src's (data: never split), d every tensor's columns, n the
# rows summed over; out is added to, not multiplied
FACTORS = "_ d, n d, n d -> _ d"


@torch.library.custom_op("autoshard_test::gated", mutates_args=())
def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """An elementwise op of a user's own."""
    return x * torch.sigmoid(gate)


@gated.register_fake
def _(x, gate):
    return torch.empty(torch.broadcast_shapes(x.shape, gate.shape), dtype=x.dtype, device=x.device)


GATED = torch.ops.autoshard_test.gated


@contextlib.contextmanager
def restored():
    """The rule tables put back as they were after the block (the validator's check that every
    rule function has a case reads them)."""
    rules, by_name = dict(registry.RULES), dict(registry.RULES_BY_NAME)
    try:
        yield
    finally:
        registry.RULES.clear()
        registry.RULES.update(rules)
        registry.RULES_BY_NAME.clear()
        registry.RULES_BY_NAME.update(by_name)


@contextlib.contextmanager
def registered():
    """The two custom ops' rules for the block."""
    with restored():
        autoshard.rules.register(SCATTER, FACTORS, additive=(0,))
        autoshard.rules.register(GATED, elementwise=True)
        yield


def _scatter_case(seed=0, rows=8, n=16, d=12):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (n, 1), generator=g).expand(n, d)
    return (torch.randn(rows, d, generator=g, dtype=torch.float64), index,
            torch.randn(n, d, generator=g, dtype=torch.float64))


# ---- (a) each op's signatures, literally, and right against the real op ---------------------------

G = torch.Generator().manual_seed(0)


def rn(*shape):
    return torch.randn(shape, generator=G, dtype=torch.float64)


def ri(high, *shape):
    return torch.randint(0, high, shape, generator=G)


x3 = rn(4, 8, 6)
LITERAL = [   # (op, args, kwargs, offered, not offered)
    (aten.repeat.default, (x3, [1, 2, 1]), {}, ["(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P"], ["(S(1)) -> S(1)"]),
    (aten.repeat.default, (rn(4, 8), [2, 1, 3]), {}, ["(S(0)) -> S(1)"], ["(S(1)) -> S(2)"]),
    (aten.repeat_interleave.self_int, (x3, 2, 1), {}, ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"], []),
    (aten.repeat_interleave.self_int, (x3, 3, -1), {"output_size": 18}, ["(S(1)) -> S(1)"], ["(S(2)) -> S(2)"]),
    (aten.repeat_interleave.self_Tensor, (x3, torch.tensor([1, 2, 0, 3, 1, 1, 2, 2]), 1), {},
     ["(S(0), B) -> S(0)", "(S(2), B) -> S(2)", "(P, B) -> P"], ["(S(1), B) -> S(1)"]),
    (aten.new_zeros.default, (rn(4, 8), [4, 8, 12]), {}, ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(B) -> S(2)"], []),
    (aten.new_ones.default, (rn(4, 8), [4, 12]), {}, ["(S(0)) -> S(0)", "(B) -> S(1)", "(S(1)) -> B", "(P) -> B"],
     []),   # whole, x held as it is: only its dtype is read
    (aten.new_full.default, (rn(8, 12), [8, 12], 2.5), {}, ["(S(0)) -> S(0)", "(S(1)) -> S(1)"], []),
    (aten.new_empty.default, (rn(8), [2, 4, 8]), {}, ["(B) -> S(1)", "(S(0)) -> S(2)"], []),
    (aten.copy.default, (rn(4, 8), rn(8)), {}, ["(S(0), B) -> S(0)", "(S(1), S(0)) -> S(1)", "(B, P) -> P"],
     []),
    (aten.argsort.default, (rn(8, 12), 0, True), {}, ["(S(1)) -> S(1)"], ["(S(0)) -> S(0)"]),
    (aten.argsort.stable, (rn(8, 12),), {"stable": True, "dim": 0}, ["(S(1)) -> S(1)"], ["(S(0)) -> S(0)"]),
    (aten.sort.default, (rn(8, 12),), {}, ["(S(0)) -> S(0), S(0)"], ["(S(1)) -> S(1), S(1)"]),
    (aten.cumsum.default, (rn(4, 8), 1), {}, ["(S(0)) -> S(0)", "(P) -> P", "(S(1)) -> S(1)"], []),
    # a 1-d sort split on its dim: integer keys only (a counting sort)
    (aten.argsort.stable, (ri(4, 16),), {"stable": True}, ["(S(0)) -> S(0)"], []),
    (aten.argsort.stable, (rn(16),), {"stable": True}, [], ["(S(0)) -> S(0)"]),
    (aten.argsort.default, (ri(4, 16),), {}, ["(S(0)) -> S(0)"], []),
    (aten.sort.default, (ri(4, 16), 0, True), {}, ["(S(0)) -> S(0), S(0)"], []),
    (aten.sort.default, (rn(16),), {}, [], ["(S(0)) -> S(0), S(0)"]),
    (aten.scatter_add.default, (rn(8, 12), 0, ri(8, 4, 12), rn(4, 12)), {},
     ["(S(1), S(1), S(1)) -> S(1)", "(P, B, P) -> P", "(P, S(0), S(0)) -> P"], ["(S(0), S(0), S(0)) -> S(0)"]),
    (aten.scatter_add.default, (rn(8, 12), 0, ri(8, 2, 12), rn(4, 12)), {},
     ["(P, B, P) -> P"], ["(P, S(0), S(0)) -> P"]),   # index rows fewer than src's: chunks would not line up
    (aten.index_add.default, (rn(8, 12), 0, ri(8, 16), rn(16, 12)), {},
     ["(S(1), B, S(1)) -> S(1)", "(P, B, P) -> P", "(P, S(0), S(0)) -> P"], ["(S(0), B, S(0)) -> S(0)"]),
    # a max or min (the router's top score): kept dims keep their split, a reduced one is never split
    (aten.amax.default, (x3, [1], True), {}, ["(S(0)) -> S(0)", "(S(2)) -> S(2)"], ["(S(1)) -> S(1)", "(S(1)) -> P"]),
    (aten.amax.default, (x3, [1]), {}, ["(S(2)) -> S(1)"], []),
    (aten.amin.default, (x3, [0, 2]), {}, ["(S(1)) -> S(0)"], ["(S(0)) -> P"]),
    (aten.max.dim, (x3, 2), {}, ["(S(0)) -> S(0), S(0)", "(S(1)) -> S(1), S(1)"], ["(S(2)) -> S(2), S(2)"]),
    (aten.min.dim, (x3, 0, True), {}, ["(S(2)) -> S(2), S(2)"], ["(S(0)) -> S(0), S(0)"]),
    (aten.argmax.default, (x3, 1), {}, ["(S(2)) -> S(1)"], ["(S(1)) -> S(1)"]),
    (aten.argmin.default, (x3,), {}, [], ["(S(0)) -> S(0)"]),
]


@pytest.mark.parametrize("case", LITERAL, ids=lambda c: op_name(c[0]))
def test_signatures(case):
    op, args, kwargs, offered, refused = case
    got = [repr(s) for s in signatures(op, args, kwargs)]
    assert set(offered) <= set(got) and not set(refused) & set(got), got


CUSTOM = {op_name(SCATTER.default), op_name(GATED.default)}
NEW = {"repeat.default", "repeat_interleave.self_int", "repeat_interleave.self_Tensor", "new_zeros.default",
       "new_ones.default", "new_full.default", "new_empty.default", "copy.default", "argsort.default",
       "argsort.stable", "sort.default", "sort.stable", "cumsum.default", "scatter_add.default", "index_add.default",
       "amax.default", "amin.default", "max.dim", "min.dim", "argmax.default"}


@pytest.mark.parametrize("p", (2, 4))
def test_validator_passes_every_new_signature(p):
    cases = [c for c in default_cases() if op_name(c[0]) in NEW] + [c[:3] for c in LITERAL]
    with registered():
        cases += [(SCATTER.default, _scatter_case(s), {}) for s in range(3)]
        cases += [(GATED.default, (rn(4, 8, 12), rn(8, 1)), {})]
        rep = validate(cases, p=p)
    assert rep.ok, rep.format()
    assert {n for n in NEW | CUSTOM if rep.per_op.get(n, 0) < 2} == set(), rep.per_op   # a split checked
    assert rep.checked_nontrivial > 100, rep.format()


def test_a_wrong_signature_fails_the_validator():
    """What the rules leave out, the validator catches."""
    wrong = [(aten.repeat.default, (x3, [1, 2, 1]), {}, Sig((Split(1),), (Split(1),))),
             (aten.repeat_interleave.self_int, (x3, 3, -1), {"output_size": 18}, Sig((Split(2),), (Split(2),))),
             (aten.index_add.default, (rn(8, 12), 0, ri(8, 16), rn(16, 12)), {}, Sig((B, Split(0), Split(0)), (P,))),
             (SCATTER.default, _scatter_case(), {}, Sig((P, Split(1), Split(1)), (P,))),
             (SCATTER.default, _scatter_case(), {}, Sig((Split(0), B, B), (Split(0),))),   # rows are data
             (aten.argsort.stable, (rn(16),), {"stable": True}, Sig((Split(0),), (Split(0),)))]   # float keys: no counting
    for op, args, kwargs, sig in wrong:
        assert check_signature(op, args, kwargs, sig, 2)[0] == "fail", (op, sig)


def test_register_a_custom_op():
    """By the op, by one overload, by the function custom_op made or by name: the factor
    string's signatures, the destination's rows never split (where a row goes is data)."""
    for op in (SCATTER, SCATTER.default, deterministic_scatter_add, "autoshard_test::deterministic_scatter_add"):
        with restored():
            autoshard.rules.register(op, FACTORS, additive=(0,))
            got = [repr(s) for s in signatures(SCATTER.default, _scatter_case(), {})]
        # and (P, P, B) -> P, which no plan takes: an integer index holds no partial sum
        assert set(got) == {"(S(1), S(1), S(1)) -> S(1)", "(P, S(0), S(0)) -> P", "(P, B, P) -> P",
                            "(P, P, B) -> P"}, (op, got)
        assert check_signature(SCATTER.default, _scatter_case(), {}, Sig((P, P, B), (P,)), 2)[0] == "n/a"
    assert registry.rule_for(SCATTER.default) is None   # left as it was
    with restored():
        autoshard.rules.register(GATED, elementwise=True)
        got = [repr(s) for s in signatures(GATED.default, (rn(4, 8, 12), rn(8, 1)), {})]
    assert got == ["(S(0), B) -> S(0)", "(S(1), S(0)) -> S(1)", "(S(2), B) -> S(2)"]


def test_register_says_what_is_wrong():
    with pytest.raises(ValueError, match="aten op"):
        autoshard.rules.register(aten.mm, "m k, k n -> m n")
    with pytest.raises(ValueError, match="one of the two"):
        autoshard.rules.register(SCATTER)
    with pytest.raises(ValueError, match="reads"):
        autoshard.rules.register(SCATTER, "m k, k n")
    with pytest.raises(ValueError, match="diagonal"):
        autoshard.rules.register(SCATTER, "i i -> i")
    with pytest.raises(ValueError, match="additive"):
        autoshard.rules.register(SCATTER, FACTORS, additive=(3,))
    with pytest.raises(TypeError, match="custom op"):
        autoshard.rules.register(len, FACTORS)
    with restored():
        rule = autoshard.rules.register(SCATTER, "m k, k n -> m n")
        ctx = OpCtx(SCATTER.default, (), {}, [(8, 12), (16, 12), (16, 12)], [(8, 12)])
        with pytest.raises(ValueError, match="factors that fit"):
            rule(ctx)


def test_torchtitans_own_op_has_the_scatter_rule():
    """``torchtitan::deterministic_scatter_add`` is found by its name once torchtitan defines it:
    its rule, checked on the copy (the same computation)."""
    assert registry.RULES_BY_NAME["torchtitan::deterministic_scatter_add"] is scatter_add_rows
    args = _scatter_case()
    ctx = OpCtx(SCATTER.default, args, {}, [t.shape for t in args], [args[0].shape])
    sigs = scatter_add_rows(ctx)
    assert {repr(s) for s in sigs} == {"(S(1), S(1), S(1)) -> S(1)", "(P, B, P) -> P", "(P, S(0), S(0)) -> P"}
    for p in (2, 4):
        assert all(check_signature(SCATTER.default, args, {}, s, p)[0] == "ok" for s in sigs)


# ---- (b) a model of them all, exact against one device in a gloo group ----------------------------

BATCH, SEQ, DIM, VOCAB = 8, 8, 16, 32


class Routed(nn.Module):
    """Tokens repeated (DeBERTa's repeat, Mamba2's repeat_interleave), a running sum, and a
    routing step: each sequence's positions ranked by argsort, and every token's features added
    into the rows of its rank by the scatter custom op, into a tensor new_zeros made."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, labels):
        e = self.emb(ids)
        h = self.proj(e)
        h = h.repeat(1, 2, 1) + h.repeat_interleave(2, dim=1)             # (batch, 2 seq, dim)
        h = h.cumsum(1) / (2 * SEQ)
        order = e[..., 0].argsort(dim=-1)                                   # exact values: no ties moved
        rows = torch.cat([order, order + SEQ], 1).flatten()
        index = rows.unsqueeze(-1).expand(-1, DIM)
        pooled = SCATTER(h.new_zeros(2 * SEQ, DIM), index, h.flatten(0, 1))   # (2 seq, dim)
        logits = self.head(h + pooled / BATCH)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def routed_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, 2 * SEQ), generator=g)


# the solver splits the features; pinned, the batch: the scatter as partial sums over its rows,
# repeat_interleave split on the dim it repeats
PINNED = {"argsort": ("S(0)",), "expand": ("S(0)",), "deterministic_scatter_add": ("P",), "repeat": ("S(0)",),
          "repeat_interleave": ("S(1)",), "cumsum": ("S(0)",)}
PLANS = {"solver": None, "pinned": PINNED}
OPS = ("repeat", "repeat_interleave", "cumsum", "argsort", "new_zeros", "deterministic_scatter_add")


def train_case(pin, mesh=(2,)):
    autoshard.rules.register(SCATTER, FACTORS, additive=(0,))   # this rank's rule table
    torch.manual_seed(0)
    model = Routed()
    ref = copy.deepcopy(model)
    ids, labels = routed_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownOpWarning)
        pm = autoshard.parallelize(model, (ids, labels), mesh=mesh, pin=pin, cluster=SLOW)
    return {**against_one_device(pm, ref, (ids, labels)),
            "unknown": sorted({str(w.message) for w in caught if issubclass(w.category, UnknownOpWarning)}),
            "placements": {n: ([tuple(q) for q in node.inputs], [tuple(q) for q in node.outputs])
                           for n, node in pm.plan.nodes.items() if n in OPS}}


@pytest.fixture(scope="module")
def trained(world2):
    per_rank = world2.run(run_each, train_case, [(pin,) for pin in PLANS.values()])
    return by_case(PLANS, per_rank)


# on two axes: each pinned op split (or summed) the same way over both
PLANS_2D = {"solver": None, "pinned": {k: v * 2 for k, v in PINNED.items()}}


@pytest.fixture(scope="module")
def trained_2d(world4):
    per_rank = world4.run(run_each, train_case, [(pin, (2, 2)) for pin in PLANS_2D.values()])
    return by_case(PLANS_2D, per_rank)


@pytest.mark.parametrize("plan", PLANS_2D)
def test_exact_against_one_device_on_two_axes(trained_2d, plan):
    _exact(trained_2d[plan])
    if plan == "pinned":
        assert _whole(trained_2d[plan][0]["placements"]) == []


@pytest.mark.parametrize("plan", PLANS)
def test_exact_against_one_device(trained, plan):
    _exact(trained[plan])


def _exact(ranks):
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["unknown"] == [], res["unknown"]
        assert res["loss"] < TOL and res["logits"] < TOL, res
        bad = {n: e for n, e in res["grads"].items() if e > TOL}
        assert not bad, f"rank {r}: gradients differ: {bad}"


def _whole(placed) -> list:
    return [n for n, (ins, outs) in placed.items() if all(q == ("B",) for q in ins + outs)]


def test_planned_split(trained):
    """The solver splits the scatter (on its columns); pinned, every one of the ops runs split,
    the scatter as partial sums over its rows and repeat_interleave on the dim it repeats."""
    solver, pinned = trained["solver"][0]["placements"], trained["pinned"][0]["placements"]
    assert "deterministic_scatter_add" not in _whole(solver), solver
    assert _whole(pinned) == [], pinned
    assert pinned["deterministic_scatter_add"] == ([("P",), ("S(0)",), ("S(0)",)], [("P",)])
    assert pinned["repeat_interleave"] == ([("S(1)",)], [("S(1)",)])


# ---- (c) none of them replicated in a coverage report ----------------------------------------------

class Every(nn.Module):
    """The ops of this file as models write them (a copy_ into a fresh tensor is functionalized)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):                                                # (batch, seq, dim)
        h = self.proj(x)
        a = h.repeat(1, 2, 1) + h.repeat_interleave(2, dim=1)
        buf = h.new_empty(BATCH, SEQ, DIM)
        buf.copy_(h * 2)
        made = h.new_zeros(BATCH, SEQ, DIM) + h.new_ones(BATCH, SEQ, DIM) + h.new_full((BATCH, SEQ, DIM), 0.5)
        order = h.argsort(-1)
        values, _ = h.sort(1)
        idx = order[..., :4] % SEQ
        sa = torch.zeros_like(h).scatter_add(1, idx, h[..., :4])
        ia = torch.zeros_like(h).index_add(0, order[:, 0, 0] % BATCH, h)
        pooled = SCATTER(h.new_zeros(2 * SEQ, DIM), order[..., :1].flatten(0, 1).expand(-1, DIM) % (2 * SEQ),
                         h.flatten(0, 1))
        return (a.cumsum(1).sum() + buf.sum() + made.sum() + values.sum() + sa.sum() + ia.sum()
                + pooled.sum() + GATED(h, h).sum())


def test_coverage_lists_none_of_them_replicated():
    with registered():
        cov = autoshard.coverage(Every(), (torch.randn(BATCH, SEQ, DIM),), world=2)
    names = {"repeat.default", "repeat_interleave.self_int", "new_empty.default", "new_zeros.default",
             "new_ones.default", "new_full.default", "copy.default", "argsort.default", "sort.default",
             "cumsum.default", "scatter_add.default", "index_add.default",
             "autoshard_test.deterministic_scatter_add.default", "autoshard_test.gated.default"}
    assert names <= {o.op for o in cov.ops}, [o.op for o in cov.ops]
    replicated = {o.op: o.why for o in cov.fallbacks if o.op in names}
    assert replicated == {}, str(cov)
    assert not cov.without_rules, str(cov)
